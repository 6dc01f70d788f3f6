// What the sequence-parallel strategies share: the ranks' verdict before any exchange, moving
// strided views between ranks, the GQA-aware head split, row shards and the (O, LSE) merge.
#pragma once

#include <cstdint>
#include <exception>
#include <span>
#include <vector>

#include "dattn/communicator.hpp"
#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn::parallel {

using i64 = std::int64_t;

// Every rank passes the error it caught (or null) and its header (the same count of integers on
// every rank). If any rank failed, every rank throws the error of the lowest failing rank: the
// same type (InvalidArgument, Unsupported, NotAvailable, else Error) and field, the message
// prefixed with that rank. Otherwise returns every rank's header, rank-major.
std::vector<i64> agree(Communicator& comm, std::exception_ptr error,
                       std::span<const i64> header = {});

// With m = send.size() / P views per rank: sends send[p*m .. p*m+m) to rank p; what rank p sent
// to this rank lands in recv[p*m .. p*m+m). Views of any strides; send[p*m+i] on rank r and
// recv[r*m+i] on rank p must have the same element count and dtype.
void exchange_views(Communicator& comm, std::span<const TensorView> send,
                    std::span<const TensorView> recv);

// Which heads each rank computes (docs/semantics.md, "Sequence parallelism"): KV heads padded to a
// multiple of P, each rank a contiguous block of Hkv_pad / P KV heads (trimmed to the real ones)
// and their query heads.
struct HeadSplit {
  std::vector<i64> kv_start, kv_count, q_start, q_count;
};
HeadSplit split_heads(i64 hq, i64 hkv, int ranks);

// Start of each shard when the shards of `lengths` lie one after the other.
std::vector<i64> exclusive_offsets(std::span<const i64> lengths);

// Merges a partial result into an accumulator (docs/semantics.md, "Sequence parallelism"): per (b,
// h, row)
//   m = max(l, lb), l' = m + log(e^(l-m) + e^(lb-m)), o' = (e^(l-m) o + e^(lb-m) ob) / (...)
// where a side with LSE -inf contributes nothing (both -inf stay (0, -inf)) and a side with
// LSE NaN (a poisoned row) makes the merged row NaN with LSE NaN.
// o, part_o: contiguous f32 [B, S, H, E]; lse, part_lse: contiguous f32 [B, H, S].
void merge_partial(const TensorView& o, const TensorView& lse, const TensorView& part_o,
                   const TensorView& part_lse);

}  // namespace dattn::parallel
