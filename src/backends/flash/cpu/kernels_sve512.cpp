// The sve engine at 512-bit vectors (Fujitsu A64FX): kernels_sve_impl.hpp.
#define DATTN_SVE_BITS 512
#include "backends/flash/cpu/kernels_sve_impl.hpp"
