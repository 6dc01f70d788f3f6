// Checks of the memory a view describes, made where a tensor enters the library (the field names
// it): a view must point at memory it can address, and an output must not alias itself or an
// input (docs/semantics.md, "Tensors").
#pragma once

#include <cstdint>
#include <string_view>

#include "dattn/tensor.hpp"

namespace dattn::detail {

// InvalidArgument naming `field` when the view cannot describe real memory: a null data pointer
// with elements, a data pointer not aligned to its element size, or shape and strides whose
// element count or byte extent overflows int64 or wraps the address space.
void check_view_memory(const TensorView& t, std::string_view field);

// Bytes [begin, end) that the view's elements lie in; begin == end when it has none.
struct ByteSpan {
  std::uintptr_t begin = 0, end = 0;
};
ByteSpan byte_span(const TensorView& t);

// As PyTorch decides internal overlap: a stride 0 on a dim longer than 1 (two indices, one
// element).
bool has_internal_overlap(const TensorView& t);

// Whether the elements fill their byte span exactly (some order of the dims is contiguous).
bool is_non_overlapping_and_dense(const TensorView& t);

// InvalidArgument naming `out_field` when the output `out` overlaps itself, or overlaps `input`
// (named `input_field`): the same view is allowed only when `same_view_ok` (an output row that
// depends on that input's row alone); otherwise, as PyTorch decides partial overlap, two dense
// views whose byte spans intersect. Views that are not dense are accepted (not decidable
// cheaply).
void check_output_internal_overlap(const TensorView& out, std::string_view out_field);
void check_output_overlap(const TensorView& out, std::string_view out_field,
                          const TensorView& input, std::string_view input_field,
                          bool same_view_ok = false);

}  // namespace dattn::detail
