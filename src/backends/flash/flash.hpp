// FLASH: the CPU platform default. Tiled online-softmax attention (FlashAttention-2) with
// register-blocked SIMD micro-kernels chosen per ISA (avx512, avx2, portable), every dense
// feature of docs/semantics.md without an O(S^2) buffer.
//
// Backend options: "isa" = an engine name (engines.hpp: portable, avx2, avx512, avx512_bf16,
// avx512_bf16_emulated) caps the engines at that level; "compute_dtype" = "f32" (default,
// exact) | "bf16" lets f32/f16 inputs use the bf16 engines.
#pragma once

#include <memory>

#include "dattn/backend.hpp"

namespace dattn {

std::shared_ptr<const Backend> make_flash_backend();
// SAGE: FLASH's driver on the 8-bit Q.K^T engines (approximate, chosen only explicitly).
std::shared_ptr<const Backend> make_sage_backend();

}  // namespace dattn
