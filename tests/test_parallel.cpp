// Sequence parallelism with threads as ranks (the in-process communicator): every strategy
// against the single-process result, the LSE merge, the uneven all-to-all, the verdict.
#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>
#include <exception>
#include <future>
#include <limits>
#include <mutex>
#include <thread>

#include "dattn/errors.hpp"
#include "parallel/exchange.hpp"
#include "parallel_cases.hpp"

namespace dattn::testing {
namespace {

using i64 = std::int64_t;

// Runs fn(comm) on `ranks` threads; returns each rank's exception (null if none). Fails the
// test (instead of hanging) if the ranks do not finish within `timeout`.
template <class Fn>
std::vector<std::exception_ptr> on_ranks(int ranks, Fn fn,
                                         std::chrono::seconds timeout = std::chrono::seconds(60)) {
  auto comms = make_in_process_group(ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  auto done = std::make_shared<std::promise<void>>();
  auto left = std::make_shared<std::atomic<int>>(ranks);
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r, done, left] {
      omp_set_num_threads(1);
      try {
        fn(comms[std::size_t(r)]);
      } catch (...) {
        errors[std::size_t(r)] = std::current_exception();
      }
      if (--*left == 0) done->set_value();
    });
  const bool finished = done->get_future().wait_for(timeout) == std::future_status::ready;
  if (!finished) {
    ADD_FAILURE() << "ranks did not finish within " << timeout.count() << " s (a hang)";
    std::terminate();  // threads blocked in a collective cannot be joined
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::string what(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return "?";
}

// Every rank's rows equal the single-process result (f32: 1e-5).
void expect_matches(int ranks, const ParallelCase& c, double tol = 1e-5) {
  std::mutex m;
  std::vector<ParallelOutcome> outcomes(static_cast<std::size_t>(ranks));
  auto errors = on_ranks(ranks, [&](const std::shared_ptr<Communicator>& comm) {
    const ParallelOutcome o = run_parallel_case(comm, c);
    std::lock_guard lock(m);
    outcomes[std::size_t(comm->rank())] = o;
  });
  for (int r = 0; r < ranks; ++r) {
    ASSERT_FALSE(errors[std::size_t(r)]) << "rank " << r << ": " << what(errors[std::size_t(r)]);
    EXPECT_LE(outcomes[std::size_t(r)].out_err, tol)
        << c.strategy << " P=" << ranks << " rank " << r;
    EXPECT_LE(outcomes[std::size_t(r)].lse_err, tol * 10)
        << c.strategy << " P=" << ranks << " rank " << r;
  }
}

// Every rank raises an error of type E naming `field`.
template <class E>
void expect_raises_everywhere(int ranks, const ParallelCase& c, const std::string& field) {
  auto errors = on_ranks(
      ranks, [&](const std::shared_ptr<Communicator>& comm) { run_parallel_case(comm, c); });
  for (int r = 0; r < ranks; ++r) {
    ASSERT_TRUE(errors[std::size_t(r)]) << "rank " << r << " did not raise";
    try {
      std::rethrow_exception(errors[std::size_t(r)]);
    } catch (const E& e) {
      EXPECT_EQ(e.field(), field) << "rank " << r << ": " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " raised the wrong type: " << e.what();
    }
  }
}

std::vector<std::string> strategies_for(int ranks) {
  std::vector<std::string> s{"ulysses", "ring", "allgather"};
  if (ranks == 4) s.push_back("hybrid:2x2");
  if (ranks == 2) s.push_back("hybrid:1x2"), s.push_back("hybrid:2x1");
  if (ranks == 3) s.push_back("hybrid:3x1");
  return s;
}

class EveryStrategy : public ::testing::TestWithParam<int> {};

TEST_P(EveryStrategy, MatchesOneProcessGqa) {
  for (const std::string& s : strategies_for(GetParam())) {
    ParallelCase c;
    c.strategy = s;
    expect_matches(GetParam(), c);
  }
}

TEST_P(EveryStrategy, JointTokensFrontAndRear) {
  for (const std::string& s : strategies_for(GetParam()))
    for (bool front : {true, false}) {
      ParallelCase c;
      c.strategy = s;
      c.joint = 6;
      c.front = front;
      c.heads = 4, c.kv_heads = 4, c.d = 24, c.dv = 16;
      expect_matches(GetParam(), c);
    }
}

TEST_P(EveryStrategy, UnevenHeadPaddingGqa28To7) {
  for (const std::string& s : strategies_for(GetParam())) {
    ParallelCase c;
    c.strategy = s;
    c.heads = 28, c.kv_heads = 7, c.d = 16, c.dv = 16, c.rows = 19, c.batch = 1;
    c.joint = 3;
    expect_matches(GetParam(), c);
  }
}

TEST_P(EveryStrategy, CausalWhereAllowed) {
  for (const std::string& s : strategies_for(GetParam())) {
    if (s == "allgather") continue;
    ParallelCase c;
    c.strategy = s;
    c.causal = true;
    expect_matches(GetParam(), c);
    c.joint = 4;  // joint rows are positions too
    expect_matches(GetParam(), c);
  }
}

TEST_P(EveryStrategy, ValidKvLengthTrims) {
  for (const std::string& s : strategies_for(GetParam()))
    for (i64 vl : {1, 20, 37}) {
      ParallelCase c;
      c.strategy = s;
      c.valid_kv_length = vl;
      c.joint = vl == 20 ? 5 : 0;
      expect_matches(GetParam(), c);
    }
}

TEST_P(EveryStrategy, UnevenShardsWithAnEmptyOne) {
  std::vector<i64> lengths(std::size_t(GetParam()), 9);
  lengths[1] = 0;
  lengths[0] = 14;
  for (const std::string& s : strategies_for(GetParam())) {
    ParallelCase c;
    c.strategy = s;
    c.lengths = lengths;
    c.joint = 2;
    expect_matches(GetParam(), c);
  }
}

TEST_P(EveryStrategy, BadInputOnOneRankRaisesOnAll) {
  for (const std::string& s : strategies_for(GetParam())) {
    ParallelCase c;
    c.strategy = s;
    // Rank 1 passes keys with another head size: caught before any exchange.
    c.bad_rank = 1;
    c.bad_key_head_size = 48;
    expect_raises_everywhere<InvalidArgument>(GetParam(), c, "key");
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, EveryStrategy, ::testing::Values(2, 3, 4),
                         [](const auto& param_info) {
                           return "P" + std::to_string(param_info.param);
                         });

TEST(Parallel, MasksAndPackedUnderUlyssesAndAllGather) {
  for (int P : {2, 3})
    for (const std::string s : {"ulysses", "allgather"}) {
      ParallelCase c;
      c.strategy = s;
      c.key_mask = true;
      expect_matches(P, c);
      c.joint = 5, c.joint_mask = true;
      expect_matches(P, c);
      ParallelCase d;
      d.strategy = s;
      d.dense_mask = true;
      d.joint = 3;
      expect_matches(P, d);
      ParallelCase p;
      p.strategy = s;
      p.packed = true;
      expect_matches(P, p);
    }
}

TEST(Parallel, StrictUlysses) {
  ParallelCase c;
  c.strategy = "ulysses-strict";
  c.rows = 36;
  expect_matches(2, c);
  ParallelCase six;
  six.strategy = "ulysses-strict";
  six.heads = 6, six.kv_heads = 3, six.rows = 36;
  expect_matches(3, six);
  c.rows = 37;  // unequal shards
  expect_raises_everywhere<InvalidArgument>(2, c, "query");
  c.rows = 36, c.heads = 6, c.kv_heads = 3;  // 3 KV heads over 2 ranks
  expect_raises_everywhere<InvalidArgument>(2, c, "num_heads");
}

TEST(Parallel, RingRejectsMasksAndCausalValidKvLength) {
  ParallelCase c;
  c.strategy = "ring";
  c.key_mask = true;
  expect_raises_everywhere<Unsupported>(3, c, "attn_mask");
  c.key_mask = false, c.causal = true, c.valid_kv_length = 10;
  expect_raises_everywhere<Unsupported>(3, c, "valid_kv_length");
  c.causal = false, c.valid_kv_length.reset(), c.packed = true;
  expect_raises_everywhere<Unsupported>(2, c, "cu_seqlens_q");
}

TEST(Parallel, AllGatherRejectsCausal) {
  ParallelCase c;
  c.strategy = "allgather";
  c.causal = true;
  expect_raises_everywhere<Unsupported>(2, c, "causal");
}

TEST(Parallel, VideoLayoutOnlyUnderUlysses) {
  ParallelCase c;
  c.video_layout = true;
  c.strategy = "ulysses";  // dense FLASH ignores the layout; Ulysses passes it whole
  expect_matches(3, c);
  for (const std::string s : {"ring", "allgather"}) {
    c.strategy = s;
    expect_raises_everywhere<Unsupported>(3, c, "video_layout");
  }
}

TEST(Parallel, ErrorFoundByTheKernelOnOneRankRaisesOnAll) {
  // valid_kv_length past the keys on rank 2 only: Ulysses finds it after the exchange (the
  // kernel's checks), the ring before it; every rank raises either way.
  for (const std::string s : {"ulysses", "ring", "allgather"}) {
    ParallelCase c;
    c.strategy = s;
    c.bad_rank = 2;
    c.bad_valid_kv_length = 1000;
    expect_raises_everywhere<InvalidArgument>(3, c, "valid_kv_length");
  }
}

TEST(Parallel, Bf16InputsMoveAsBf16) {
  for (const std::string s : {"ulysses", "ring", "hybrid:2x2", "allgather"}) {
    ParallelCase c;
    c.strategy = s;
    c.dtype = DType::BF16;
    c.joint = 3;
    expect_matches(4, c, 1e-2);  // bf16 output: one rounding of the same f32 result
  }
}

TEST(Parallel, BhsdViews) {
  for (const std::string s : {"ulysses", "ring", "hybrid:2x2", "allgather"}) {
    ParallelCase c;
    c.strategy = s;
    c.bhsd = true;
    c.joint = 3;
    c.front = false;
    expect_matches(4, c);
  }
}

TEST(Parallel, StrategyNames) {
  auto comms = make_in_process_group(1);
  EXPECT_EQ(make_parallel_strategy("RING", comms[0])->name(), "ring");
  EXPECT_EQ(make_parallel_strategy("none", comms[0])->name(), "none");
  EXPECT_THROW(make_parallel_strategy("spiral", comms[0]), InvalidArgument);
  EXPECT_THROW(make_parallel_strategy("hybrid:2x", comms[0]), InvalidArgument);
  EXPECT_THROW(make_parallel_strategy("hybrid:2x2", comms[0]), InvalidArgument);  // 4 != 1
  EXPECT_EQ(shard_rows(10, 3, 0), (std::pair<i64, i64>{0, 4}));
  EXPECT_EQ(shard_rows(10, 3, 2), (std::pair<i64, i64>{7, 3}));
}

// ---- the pieces ----

TEST(ParallelPieces, LseMergeAgainstF64) {
  const float inf = std::numeric_limits<float>::infinity();
  // Pairs of (accumulated, partial) LSE, including +-1000 and -inf on either side.
  const std::vector<std::pair<float, float>> cases{
      {0.5f, -0.25f}, {1000.f, -1000.f}, {-1000.f, 1000.f}, {1000.f, 999.f},
      {-inf, 3.f},    {3.f, -inf},       {-inf, -inf},      {-1000.f, -1000.f}};
  const i64 n = i64(cases.size()), width = 3;
  Tensor o = Tensor::empty({1, n, 1, width}, DType::F32), l = Tensor::empty({1, 1, n}, DType::F32);
  Tensor po = Tensor::empty({1, n, 1, width}, DType::F32),
         pl = Tensor::empty({1, 1, n}, DType::F32);
  for (i64 i = 0; i < n; ++i) {
    l.data_as<float>()[i] = cases[std::size_t(i)].first;
    pl.data_as<float>()[i] = cases[std::size_t(i)].second;
    for (i64 e = 0; e < width; ++e) {
      o.data_as<float>()[i * width + e] = std::isinf(l.data_as<float>()[i]) ? 0.f : float(e + 1);
      po.data_as<float>()[i * width + e] = std::isinf(pl.data_as<float>()[i]) ? 0.f : float(-2 * e);
    }
  }
  const Tensor o0 = Tensor::copy_of(o.view());
  parallel::merge_partial(o.view(), l.view(), po.view(), pl.view());
  for (i64 i = 0; i < n; ++i) {
    const double a = cases[std::size_t(i)].first, b = cases[std::size_t(i)].second;
    if (std::isinf(a) && std::isinf(b)) {
      EXPECT_EQ(l.data_as<float>()[i], -inf);
      for (i64 e = 0; e < width; ++e) EXPECT_EQ(o.data_as<float>()[i * width + e], 0.f);
      continue;
    }
    const double m = std::max(a, b);
    const double wa = std::isinf(a) ? 0 : std::exp(a - m), wb = std::isinf(b) ? 0 : std::exp(b - m);
    EXPECT_NEAR(l.data_as<float>()[i], m + std::log(wa + wb), 1e-4 * std::max(1.0, std::fabs(m)));
    for (i64 e = 0; e < width; ++e) {
      const double want =
          (wa * o0.data_as<float>()[i * width + e] + wb * po.data_as<float>()[i * width + e]) /
          (wa + wb);
      EXPECT_NEAR(o.data_as<float>()[i * width + e], want, 1e-6);
      EXPECT_TRUE(std::isfinite(o.data_as<float>()[i * width + e]));
    }
  }
}

// Each element encodes its coordinates (batch, global row, head, e); after the uneven
// rows -> heads all-to-all every received element must hold the coordinates of where it is.
TEST(ParallelPieces, UnevenAllToAllAgainstCoordinateOracle) {
  for (int P : {2, 3, 4}) {
    const i64 B = 2, H = 7, E = 3;
    std::vector<i64> lengths{5, 0, 3, 8};
    lengths.resize(std::size_t(P));
    const std::vector<i64> off = parallel::exclusive_offsets(lengths);
    const parallel::HeadSplit hs = parallel::split_heads(H, H, P);
    auto code = [](i64 b, i64 row, i64 h, i64 e) {
      return float(((b * 100 + row) * 10 + h) * 10 + e);
    };
    auto errors = on_ranks(P, [&](const std::shared_ptr<Communicator>& comm) {
      const int r = comm->rank();
      const i64 len = lengths[std::size_t(r)], rows = off.back();
      Tensor x = Tensor::empty({B, len, H, E}, DType::F32);
      for (i64 b = 0; b < B; ++b)
        for (i64 i = 0; i < len; ++i)
          for (i64 h = 0; h < H; ++h)
            for (i64 e = 0; e < E; ++e)
              x.data_as<float>()[((b * len + i) * H + h) * E + e] =
                  code(b, off[std::size_t(r)] + i, h, e);
      const i64 h0 = hs.q_start[std::size_t(r)], hn = hs.q_count[std::size_t(r)];
      Tensor y = Tensor::zeros({B, rows, hn, E}, DType::F32);
      std::vector<TensorView> send, recv;
      for (int p = 0; p < P; ++p) {
        send.push_back(x.view().sliced(2, hs.q_start[std::size_t(p)], hs.q_count[std::size_t(p)]));
        recv.push_back(y.view().sliced(1, off[std::size_t(p)], lengths[std::size_t(p)]));
      }
      parallel::exchange_views(*comm, send, recv);
      for (i64 b = 0; b < B; ++b)
        for (i64 row = 0; row < rows; ++row)
          for (i64 h = 0; h < hn; ++h)
            for (i64 e = 0; e < E; ++e)
              if (y.data_as<float>()[((b * rows + row) * hn + h) * E + e] !=
                  code(b, row, h0 + h, e))
                throw std::runtime_error("rank " + std::to_string(r) + ": element (" +
                                         std::to_string(b) + ", " + std::to_string(row) + ", " +
                                         std::to_string(h) + ", " + std::to_string(e) +
                                         ") is wrong");
    });
    for (auto& e : errors) EXPECT_FALSE(e) << what(e);
  }
}

// Counts the bytes a rank sends to other ranks (the verdicts' all_gather is not counted).
class CountingCommunicator final : public Communicator {
 public:
  CountingCommunicator(std::shared_ptr<Communicator> inner, std::shared_ptr<std::atomic<i64>> sent)
      : inner_(std::move(inner)), sent_(std::move(sent)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void all_to_all_v(const void* send, const std::vector<std::size_t>& sc,
                    const std::vector<std::size_t>& sd, void* recv,
                    const std::vector<std::size_t>& rc,
                    const std::vector<std::size_t>& rd) override {
    for (std::size_t p = 0; p < sc.size(); ++p)
      if (int(p) != rank()) *sent_ += i64(sc[p]);
    inner_->all_to_all_v(send, sc, sd, recv, rc, rd);
  }
  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    inner_->all_gather(send, bytes, recv);
  }
  std::unique_ptr<PendingTransfer> start_send_recv(const void* send, std::size_t sb, int dest,
                                                   void* recv, std::size_t rb,
                                                   int source) override {
    if (dest != rank()) *sent_ += i64(sb);
    return inner_->start_send_recv(send, sb, dest, recv, rb, source);
  }
  std::shared_ptr<Communicator> split(int colour) override {
    return std::make_shared<CountingCommunicator>(inner_->split(colour), sent_);
  }

 private:
  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<std::atomic<i64>> sent_;
};

TEST(ParallelPieces, BytesSentMatchParallelBytesSent) {
  for (int P : {2, 3, 4}) {
    std::vector<std::string> specs = strategies_for(P);
    for (const std::string& spec : specs)
      for (i64 joint : {0, 5}) {
        ParallelCase c;
        c.strategy = spec;
        c.heads = 28, c.kv_heads = 7, c.d = 16, c.dv = 8, c.rows = 29, c.joint = joint;
        c.dtype = DType::BF16;
        std::vector<i64> sent(std::size_t(P), -1);
        auto errors = on_ranks(P, [&](const std::shared_ptr<Communicator>& comm) {
          auto counter = std::make_shared<std::atomic<i64>>(0);
          run_parallel_case(std::make_shared<CountingCommunicator>(comm, counter), c);
          sent[std::size_t(comm->rank())] = counter->load();
        });
        ParallelTraffic t;
        t.batch = c.batch, t.rows = c.rows, t.joint = joint, t.heads = c.heads;
        t.kv_heads = c.kv_heads, t.head_size = c.d, t.value_head_size = c.dv;
        t.q_bytes = t.kv_bytes = t.out_bytes = 2;
        t.lse = true;  // the cases ask for the LSE
        for (int r = 0; r < P; ++r) {
          ASSERT_FALSE(errors[std::size_t(r)]) << what(errors[std::size_t(r)]);
          EXPECT_EQ(sent[std::size_t(r)], parallel_bytes_sent(spec, t, P, r))
              << spec << " P=" << P << " rank " << r << " J=" << joint;
        }
      }
  }
}

TEST(ParallelPieces, HeadSplitPadsKvHeads) {
  const parallel::HeadSplit s = parallel::split_heads(28, 7, 4);  // Hkv 7 -> 8, 2 per rank
  EXPECT_EQ(s.kv_count, (std::vector<i64>{2, 2, 2, 1}));
  EXPECT_EQ(s.q_start, (std::vector<i64>{0, 8, 16, 24}));
  EXPECT_EQ(s.q_count, (std::vector<i64>{8, 8, 8, 4}));
  const parallel::HeadSplit t = parallel::split_heads(8, 2, 3);  // Hkv 2 -> 3, 1 per rank
  EXPECT_EQ(t.kv_count, (std::vector<i64>{1, 1, 0}));
  EXPECT_EQ(t.q_count, (std::vector<i64>{4, 4, 0}));
}

TEST(ParallelPieces, CommunicatorCollectivesAndSplit) {
  auto errors = on_ranks(4, [](const std::shared_ptr<Communicator>& comm) {
    const int r = comm->rank();
    std::vector<int> mine{r * 10, r * 10 + 1}, all(8);
    comm->all_gather(mine.data(), sizeof(int) * 2, all.data());
    for (int p = 0; p < 4; ++p)
      if (all[std::size_t(2 * p)] != p * 10 || all[std::size_t(2 * p + 1)] != p * 10 + 1)
        throw std::runtime_error("all_gather");
    int token = r, got = -1;
    auto t =
        comm->start_send_recv(&token, sizeof(int), (r + 1) % 4, &got, sizeof(int), (r + 3) % 4);
    t->wait();
    if (got != (r + 3) % 4) throw std::runtime_error("send/recv");
    auto sub = comm->split(r % 2);  // {0, 2} and {1, 3}, in the parent's order
    if (sub->size() != 2 || sub->rank() != r / 2) throw std::runtime_error("split");
    int a = r, b[2] = {-1, -1};
    sub->all_gather(&a, sizeof(int), b);
    if (b[0] != r % 2 || b[1] != r % 2 + 2) throw std::runtime_error("split order");
  });
  for (auto& e : errors) EXPECT_FALSE(e) << what(e);
}

}  // namespace
}  // namespace dattn::testing
