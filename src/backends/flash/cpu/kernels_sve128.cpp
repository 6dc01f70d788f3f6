// The sve engine at 128-bit vectors (Neoverse V2 and N2: Graviton 4, Grace, Axion; only by
// name, neon serving automatic calls at this length, with the same lanes): kernels_sve_impl.hpp.
#define DATTN_SVE_BITS 128
#include "backends/flash/cpu/kernels_sve_impl.hpp"
