// The sve engine at 256-bit vectors (Graviton 3, Neoverse V1): kernels_sve_impl.hpp.
#define DATTN_SVE_BITS 256
#include "backends/flash/cpu/kernels_sve_impl.hpp"
