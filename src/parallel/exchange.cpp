#include "parallel/exchange.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "dattn/errors.hpp"

namespace dattn::parallel {

namespace {

constexpr std::size_t kFieldBytes = 128;
constexpr std::size_t kMessageBytes = 1024;

enum class ErrorKind : i64 { none, invalid_argument, unsupported, not_available, other };

std::size_t bytes_of(const TensorView& v) {
  return static_cast<std::size_t>(v.numel()) * dtype_size(v.dtype());
}

// A contiguous view of `like`'s shape and dtype over `data`.
TensorView contiguous_over(void* data, const TensorView& like) {
  return TensorView(data, like.dtype(), like.shape(), like.platform());
}

}  // namespace

std::vector<i64> agree(Communicator& comm, std::exception_ptr error, std::span<const i64> header) {
  const std::size_t words = 2 + header.size();
  const std::size_t record = words * sizeof(i64) + kFieldBytes + kMessageBytes;
  std::vector<char> mine(record, 0);
  ErrorKind kind = ErrorKind::none;
  std::string field, message;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const InvalidArgument& e) {
      kind = ErrorKind::invalid_argument, field = e.field(), message = e.what();
    } catch (const Unsupported& e) {
      kind = ErrorKind::unsupported, field = e.field(), message = e.what();
    } catch (const NotAvailable& e) {
      kind = ErrorKind::not_available, field = e.field(), message = e.what();
    } catch (const Error& e) {
      kind = ErrorKind::other, field = e.field(), message = e.what();
    } catch (const std::exception& e) {
      kind = ErrorKind::other, field = "parallel", message = e.what();
    } catch (...) {
      kind = ErrorKind::other, field = "parallel", message = "unknown error";
    }
  }
  std::array<i64, 2> head{kind == ErrorKind::none ? 0 : 1, static_cast<i64>(kind)};
  std::memcpy(mine.data(), head.data(), sizeof(head));
  if (!header.empty())
    std::memcpy(mine.data() + sizeof(head), header.data(), header.size() * sizeof(i64));
  char* text = mine.data() + words * sizeof(i64);
  std::memcpy(text, field.data(), std::min(field.size(), kFieldBytes - 1));
  std::memcpy(text + kFieldBytes, message.data(), std::min(message.size(), kMessageBytes - 1));

  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<char> all(record * n);
  comm.all_gather(mine.data(), record, all.data());

  std::vector<i64> headers;
  headers.reserve(header.size() * n);
  for (std::size_t p = 0; p < n; ++p) {
    const char* rec = all.data() + p * record;
    std::array<i64, 2> h{};
    std::memcpy(h.data(), rec, sizeof(h));
    if (h[0] != 0) {
      const char* t = rec + words * sizeof(i64);
      const std::string f(t, strnlen(t, kFieldBytes));
      const std::string m = "rank " + std::to_string(p) + ": " +
                            std::string(t + kFieldBytes, strnlen(t + kFieldBytes, kMessageBytes));
      switch (static_cast<ErrorKind>(h[1])) {
        case ErrorKind::invalid_argument:
          throw InvalidArgument(f, m);
        case ErrorKind::unsupported:
          throw Unsupported(f, m);
        case ErrorKind::not_available:
          throw NotAvailable(f, m);
        default:
          throw Error(f, m);
      }
    }
    const std::size_t at = headers.size();
    headers.resize(at + header.size());
    if (!header.empty())
      std::memcpy(headers.data() + at, rec + sizeof(h), header.size() * sizeof(i64));
  }
  return headers;
}

void exchange_views(Communicator& comm, std::span<const TensorView> send,
                    std::span<const TensorView> recv) {
  const auto n = static_cast<std::size_t>(comm.size());
  const auto me = static_cast<std::size_t>(comm.rank());
  if (send.size() != recv.size() || send.size() % n != 0)
    throw std::logic_error("exchange_views: the same number of views per rank is needed");
  const std::size_t per = send.size() / n;  // views per rank
  std::vector<std::size_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
  std::size_t send_total = 0, recv_total = 0;
  for (std::size_t p = 0; p < n; ++p) {
    if (p == me) continue;  // this rank's own blocks are copied directly
    sd[p] = send_total, rd[p] = recv_total;
    for (std::size_t i = 0; i < per; ++i) {
      sc[p] += bytes_of(send[p * per + i]);
      rc[p] += bytes_of(recv[p * per + i]);
    }
    send_total += sc[p], recv_total += rc[p];
  }
  std::unique_ptr<std::byte[]> out_buf(new std::byte[std::max<std::size_t>(send_total, 1)]);
  std::unique_ptr<std::byte[]> in_buf(new std::byte[std::max<std::size_t>(recv_total, 1)]);
  for (std::size_t p = 0; p < n; ++p) {
    if (p == me) continue;
    std::size_t at = sd[p];
    for (std::size_t i = 0; i < per; ++i) {
      const TensorView& v = send[p * per + i];
      copy_into(v, contiguous_over(out_buf.get() + at, v));
      at += bytes_of(v);
    }
  }
  for (std::size_t i = 0; i < per; ++i) copy_into(send[me * per + i], recv[me * per + i]);
  comm.all_to_all_v(out_buf.get(), sc, sd, in_buf.get(), rc, rd);
  for (std::size_t p = 0; p < n; ++p) {
    if (p == me) continue;
    std::size_t at = rd[p];
    for (std::size_t i = 0; i < per; ++i) {
      const TensorView& v = recv[p * per + i];
      copy_into(contiguous_over(in_buf.get() + at, v), v);
      at += bytes_of(v);
    }
  }
}

HeadSplit split_heads(i64 hq, i64 hkv, int ranks) {
  HeadSplit s;
  const i64 group = hkv > 0 ? hq / hkv : 0;
  const i64 per_rank = (hkv + ranks - 1) / ranks;  // Hkv padded to a multiple of P, over P
  for (int p = 0; p < ranks; ++p) {
    const i64 start = std::min(hkv, p * per_rank);
    const i64 count = std::min(hkv, (p + 1) * per_rank) - start;
    s.kv_start.push_back(start);
    s.kv_count.push_back(count);
    s.q_start.push_back(start * group);
    s.q_count.push_back(count * group);
  }
  return s;
}

std::vector<i64> exclusive_offsets(std::span<const i64> lengths) {
  std::vector<i64> off(lengths.size() + 1, 0);
  for (std::size_t i = 0; i < lengths.size(); ++i) off[i + 1] = off[i] + lengths[i];
  return off;
}

void merge_partial(const TensorView& o, const TensorView& lse, const TensorView& part_o,
                   const TensorView& part_lse) {
  const i64 batch = o.size(0), rows = o.size(1), heads = o.size(2), width = o.size(3);
  auto* acc = static_cast<float*>(o.data());
  auto* acc_l = static_cast<float*>(lse.data());
  const auto* po = static_cast<const float*>(part_o.data());
  const auto* pl = static_cast<const float*>(part_lse.data());
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (i64 b = 0; b < batch; ++b)
    for (i64 h = 0; h < heads; ++h)
      for (i64 s = 0; s < rows; ++s) {
        const i64 li = (b * heads + h) * rows + s;
        const float lb = pl[li];
        const float la = acc_l[li];
        // A NaN side (a poisoned row: docs/semantics.md) makes the merged row NaN for good.
        if (lb == kNegInf || std::isnan(la)) continue;
        float* dst = acc + ((b * rows + s) * heads + h) * width;
        const float* src = po + ((b * rows + s) * heads + h) * width;
        if (std::isnan(lb)) {
          std::fill(dst, dst + width, std::numeric_limits<float>::quiet_NaN());
          acc_l[li] = lb;
          continue;
        }
        if (la == kNegInf) {
          std::copy(src, src + width, dst);
          acc_l[li] = lb;
          continue;
        }
        const double m = std::max(la, lb);
        const double wa = std::exp(double(la) - m), wb = std::exp(double(lb) - m);
        const double sum = wa + wb;
        const auto fa = static_cast<float>(wa / sum), fb = static_cast<float>(wb / sum);
        for (i64 e = 0; e < width; ++e) dst[e] = fa * dst[e] + fb * src[e];
        acc_l[li] = static_cast<float>(m + std::log(sum));
      }
}

}  // namespace dattn::parallel
