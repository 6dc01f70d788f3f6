// Internal measurements of the CPU's arithmetic rates (the public ones: dattn/cpu_info.hpp).
#pragma once

namespace dattn::detail {

// One thread's vdpbf16ps rate over its f32 FMA rate, both in flops, measured once per process on
// first use (about 30-60 ms, trials of the two loops interleaved so that a noisy neighbour slows
// both alike); 0 without AVX-512 BF16. Thread-safe.
double bf16_dot_to_fma_ratio();

// One thread's rate on the 16-bit integer lanes the int16 engines run on (vpdpwssd on 512- or
// 256-bit registers, else vpmaddwd + vpaddd) over its f32 FMA rate on the f32 engine's registers
// (AVX-512 or AVX2), both in multiply-adds, measured once per process on first use as the one
// above; 0 without AVX2 and FMA. Thread-safe.
double int16_dot_to_fma_ratio();

}  // namespace dattn::detail
