// REFERENCE: the oracle. Plain loops accumulating in f64, every feature of docs/semantics.md and
// §10 (quantized KV by dequantize-then-compute, paged KV by gathering through block tables).
// Slow on purpose; it defines correct.
//
// Opaque option (extra.backend): "reference_rows" = i32 [N] tensor of query rows to compute
// (every batch item and head); other output rows are left untouched. Tools use it to check a
// sample of rows of a large workload.
#pragma once

#include <memory>

#include "dattn/backend.hpp"

namespace dattn {

std::shared_ptr<const Backend> make_reference_backend();

}  // namespace dattn
