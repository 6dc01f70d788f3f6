// A helper process for test_oom: runs one big attention call under an address-space limit.
//
//   oom_probe measure BACKEND DTYPE        prints "base NEED": the address space in use before
//                                          the big call (after a small warm-up call) and what
//                                          the call adds to it at its peak, in bytes
//   oom_probe run BACKEND DTYPE LIMIT      sets RLIMIT_AS to LIMIT after the warm-up, runs the
//                                          big call, prints "ok" or "bad_alloc", lifts the limit,
//                                          runs the call again and checks it against REFERENCE
//
// Any exit but 0 is a failure: an exception that escaped an OpenMP region ends the process in
// std::terminate (SIGABRT, 134), which is what the test looks for. Each limit needs a fresh
// process (libgomp's threads are not fork-safe), so test_oom execs this program once per limit.
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <new>
#include <string>

#include "dattn/attention.hpp"
#include "test_inputs.hpp"

namespace {

using namespace dattn;
using namespace dattn::testing;

// VmSize or VmPeak of this process, in bytes.
long long vm_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1) * 1024;
  return -1;
}

struct Call {
  Tensor q, k, v, out;
};

Call make_call(DType dtype, std::int64_t s, std::int64_t h, std::int64_t d, std::uint32_t seed) {
  return {random_tensor({1, s, h, d}, dtype, seed), random_tensor({1, s, h, d}, dtype, seed + 1),
          random_tensor({1, s, h, d}, dtype, seed + 2), Tensor::zeros({1, s, h, d}, dtype)};
}

constexpr std::int64_t kH = 4, kD = 128;

int run(const std::string& mode, const std::string& backend, DType dtype, long long limit) {
  // Warm-up: a small call at another head size, so that the big call's per-thread buffers grow
  // inside FLASH's parallel region (the case that used to end in std::terminate).
  {
    const Attention small(layer_config(backend, 2, 2, 64));
    Call c = make_call(dtype, 64, 2, 64, 1);
    small.forward_into(c.q, c.k, c.v, {}, c.out);
  }
  // REFERENCE is slow on purpose: a shorter sequence keeps its runs short.
  const std::int64_t kS = backend == "REFERENCE" ? 256 : 2048;
  const Attention layer(layer_config(backend, kH, kH, kD));
  Call c = make_call(dtype, kS, kH, kD, 7);
  if (mode == "measure") {
    const long long base = vm_bytes("VmSize");
    layer.forward_into(c.q, c.k, c.v, {}, c.out);
    std::cout << base << ' ' << vm_bytes("VmPeak") - base << '\n';
    return 0;
  }
  rlimit old{};
  getrlimit(RLIMIT_AS, &old);
  rlimit low = old;
  low.rlim_cur = static_cast<rlim_t>(limit);
  if (setrlimit(RLIMIT_AS, &low) != 0) return 3;
  bool failed = false;
  try {
    layer.forward_into(c.q, c.k, c.v, {}, c.out);
  } catch (const std::bad_alloc&) {
    failed = true;
  }
  setrlimit(RLIMIT_AS, &old);  // the soft limit back up to the hard one
  std::cout << (failed ? "bad_alloc" : "ok") << '\n';
  // The layer works afterwards, and right.
  Call again = make_call(dtype, kS, kH, kD, 7);
  layer.forward_into(again.q, again.k, again.v, {}, again.out);
  if (backend != "REFERENCE") {
    const Attention ref(layer_config("REFERENCE", kH, kH, kD));
    Tensor want = Tensor::zeros({1, kS, kH, kD}, dtype);
    // REFERENCE on the first rows only (all of it would take seconds).
    const TensorView rows_q = again.q.view().sliced(1, 0, 64);
    const TensorView rows_want = want.view().sliced(1, 0, 64);
    ref.forward_into(rows_q, again.k, again.v, {}, rows_want);
    const Difference d = compare(again.out.view().sliced(1, 0, 64), rows_want);
    if (d.nan || d.normwise_rel > tolerance_for(dtype)) {
      std::cerr << "wrong result after the fault: normwise " << d.normwise_rel << '\n';
      return 4;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: oom_probe measure|run BACKEND f32|bf16 [LIMIT]\n";
    return 2;
  }
  const std::string mode = argv[1], backend = argv[2], dtype = argv[3];
  const long long limit = argc > 4 ? std::atoll(argv[4]) : 0;
  try {
    return run(mode, backend, dtype == "bf16" ? DType::BF16 : DType::F32, limit);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << '\n';
    return 5;
  }
}
