// Out of memory inside a call (docs/semantics.md, "Faults"): under address-space limits spread
// across a big call's need, the call either completes or throws std::bad_alloc to the caller,
// the process lives, and the layer computes right afterwards. Each limit runs in a fresh
// process (oom_probe); an exception escaping an OpenMP region would end it with SIGABRT.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Result {
  int status = -1;
  std::string out;
};

Result run(const std::string& command) {
  Result r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 256> buf{};
  while (fgets(buf.data(), int(buf.size()), p) != nullptr) r.out += buf.data();
  r.status = pclose(p);
  return r;
}

class OutOfMemory : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(OutOfMemory, ReachesTheCallerAtEveryLimit) {
  const auto [backend, dtype] = GetParam();
  std::string probe = DATTN_OOM_PROBE;
  probe += ' ';
  const std::string args = std::string(backend) + " " + dtype;
  const Result m = run("OMP_NUM_THREADS=2 " + probe + "measure " + args);
  ASSERT_EQ(m.status, 0) << m.out;
  long long base = 0, need = 0;
  std::istringstream(m.out) >> base >> need;
  ASSERT_GT(base, 0) << m.out;
  // Ten limits spread over the call's need; then ten more, twice, across the step where the
  // call starts to succeed: the last allocations before success (FLASH's per-thread buffers,
  // grown inside its parallel region) fail only in a narrow band of limits.
  int faults = 0;
  long long lo = base, hi = base + need;
  for (int round = 0; round < 3; ++round) {
    std::vector<std::pair<long long, bool>> outcomes;  // (limit, the call failed)
    for (int i = 0; i <= 10; ++i) {
      const long long limit = lo + (hi - lo) * i / 10;
      const Result r =
          run("OMP_NUM_THREADS=2 " + probe + "run " + args + " " + std::to_string(limit));
      EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0)
          << "limit " << limit << " (base " << base << ", need " << need << "): status " << r.status
          << ": " << r.out;
      const bool failed = r.out.find("bad_alloc") != std::string::npos;
      faults += failed;
      outcomes.emplace_back(limit, failed);
    }
    // The band between the highest failing limit and the next one that succeeds.
    long long last_fault = -1;
    for (const auto& [limit, failed] : outcomes)
      if (failed) last_fault = limit;
    if (last_fault < 0 || last_fault == outcomes.back().first) break;
    lo = last_fault;
    hi = lo + (hi - lo) / 10;
  }
  if (need > 1 << 20) {
    EXPECT_GT(faults, 0) << "no limit made the call fail: the test tests nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, OutOfMemory,
                         ::testing::Values(std::pair{"FLASH", "f32"}, std::pair{"FLASH", "bf16"},
                                           std::pair{"REFERENCE", "f32"}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.first) + "_" +
                                  param_info.param.second;
                         });

}  // namespace
