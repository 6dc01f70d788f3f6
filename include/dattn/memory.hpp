// The memory dattn holds between calls, and giving it back (docs/architecture.md, "Memory").
//
// Every large buffer dattn allocates (a call's K/V panels, per-thread scratch, split-KV partials,
// VIDEO_SPARSE's packed keys, REFERENCE's panels, the strategies' exchange buffers, and results:
// the outputs it allocates, C++ Tensors and Python outputs alike) is an anonymous mapping of the
// process, never a block of the C heap, so that the small objects layers keep (plans, caches)
// can never land among them and pin their memory. Buffers a call has finished with are kept
// for the next calls of any layer and shape, at most as many as the calls in flight have held
// at once; layers keep plans, never buffers.
#pragma once

#include <cstddef>

namespace dattn {

struct MemoryStats {
  std::size_t idle_bytes = 0;    // kept for the next calls; what empty_cache() returns
  std::size_t idle_buffers = 0;  // (at most idle_limit)
  std::size_t idle_limit = 0;    // the most leases held at once plus two per call in
                                 // flight at once (since the last empty_cache())
  std::size_t in_use_bytes = 0;  // leased to calls in flight, or results not yet freed
  std::size_t calls_in_flight = 0;
  std::size_t live_layers = 0;  // Attention objects alive in the process
};

// The process's figures now.
MemoryStats memory_stats();

// Returns the idle buffers to the operating system (munmap) and the number of bytes returned.
// Buffers in use are untouched. Also done when the last Attention of the process is destroyed.
// Safe from any thread at any time; concurrent calls go on (they map new buffers if they need).
std::size_t empty_cache();

// Memory for a result that outlives the call making it (an output dattn allocates for its
// caller: the C++ Tensor's storage, the Python package's outputs), 64-byte aligned: from 64 KiB
// on a mapping of its own (reused from the idle buffers where one fits), below that a heap block.
// release_result takes back exactly what allocate_result gave (nullptr is ignored). Throws
// std::bad_alloc when the memory is not there.
void* allocate_result(std::size_t bytes);
void release_result(void* p) noexcept;

}  // namespace dattn
