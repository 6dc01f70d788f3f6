// FLASH: the CPU platform default. Tiled online-softmax attention (FlashAttention-2) with
// register-blocked SIMD micro-kernels chosen per ISA (avx512, avx2, portable), every dense
// feature of docs/semantics.md without an O(S^2) buffer.
//
// Backend options: "isa" = "portable" | "avx2" | "avx512" forces a level the CPU has.
#pragma once

#include <memory>

#include "dattn/backend.hpp"

namespace dattn {

std::shared_ptr<const Backend> make_flash_backend();

}  // namespace dattn
