// Sequence parallelism across processes: run under `mpirun -np P` (P = 2, 3, 4; CTest does).
// Every process is a rank; each strategy's rows must equal the single-process result.
#include <gtest/gtest.h>
#include <omp.h>

#include "dattn/errors.hpp"
#include "dattn/mpi.hpp"
#include "parallel_cases.hpp"

namespace dattn::testing {
namespace {

std::shared_ptr<Communicator> world() {
  static std::shared_ptr<Communicator> w = mpi_world();
  return w;
}

std::vector<std::string> strategies() {
  const int P = world()->size();
  std::vector<std::string> s{"ulysses", "ring", "allgather"};
  if (P % 2 == 0) s.push_back("hybrid:2x" + std::to_string(P / 2));
  if (P > 2 && P % 2 == 0) s.push_back("hybrid:" + std::to_string(P / 2) + "x2");
  return s;
}

void expect_matches(const ParallelCase& c, double tol = 1e-5) {
  const ParallelOutcome o = run_parallel_case(world(), c);
  EXPECT_LE(o.out_err, tol) << c.strategy << " rank " << world()->rank();
  EXPECT_LE(o.lse_err, tol * 10) << c.strategy << " rank " << world()->rank();
}

TEST(ParallelMpi, EveryStrategyMatchesOneProcess) {
  for (const std::string& s : strategies()) {
    ParallelCase c;
    c.strategy = s;
    expect_matches(c);
    c.joint = 5;
    c.front = false;
    expect_matches(c);
    c.front = true;
    c.heads = 28, c.kv_heads = 7, c.d = 16, c.dv = 16, c.batch = 1;  // uneven head padding
    expect_matches(c);
  }
}

TEST(ParallelMpi, CausalAndValidKvLength) {
  for (const std::string& s : strategies()) {
    ParallelCase c;
    c.strategy = s;
    c.valid_kv_length = 23;
    expect_matches(c);
    if (s == "allgather") continue;
    c.valid_kv_length.reset();
    c.causal = true;
    c.joint = 3;
    expect_matches(c);
  }
}

TEST(ParallelMpi, UnevenShardsWithAnEmptyOne) {
  std::vector<std::int64_t> lengths(std::size_t(world()->size()), 7);
  lengths[0] = 0;
  for (const std::string s : {"ulysses", "ring", "allgather"}) {
    ParallelCase c;
    c.strategy = s;
    c.lengths = lengths;
    c.joint = 2;
    expect_matches(c);
  }
}

TEST(ParallelMpi, MasksUnderUlyssesAndAllGather) {
  for (const std::string s : {"ulysses", "allgather"}) {
    ParallelCase c;
    c.strategy = s;
    c.key_mask = true;
    c.joint = 4, c.joint_mask = true;
    expect_matches(c);
  }
}

TEST(ParallelMpi, BadInputOnOneRankRaisesOnAll) {
  for (const std::string& s : strategies()) {
    ParallelCase c;
    c.strategy = s;
    c.bad_rank = world()->size() - 1;
    c.bad_key_head_size = 48;
    try {
      run_parallel_case(world(), c);
      ADD_FAILURE() << s << ": rank " << world()->rank() << " did not raise";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), "key") << e.what();
    }
  }
}

}  // namespace
}  // namespace dattn::testing

int main(int argc, char** argv) {
  dattn::MpiSession mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  omp_set_num_threads(1);
  // Only rank 0 prints the test log; every rank's failures still fail the run.
  if (dattn::testing::world()->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  // Every rank's verdict decides the exit status of every rank.
  int all = 0;
  const auto w = dattn::testing::world();
  std::vector<int> codes(std::size_t(w->size()));
  w->all_gather(&rc, sizeof(int), codes.data());
  for (int c : codes) all |= c;
  if (all != 0 && rc == 0 && w->rank() == 0) std::fprintf(stderr, "another rank failed\n");
  return all;
}
