// VIDEO_SPARSE: block-sparse video attention over the VideoTokenLayout (docs/semantics.md, "Video
// token layout and VIDEO_SPARSE"), on FLASH's micro-kernels. Approximate, so only an explicit
// choice picks it. Options: see VideoSparseOptions in dattn/video_sparse.hpp.
#pragma once

#include <memory>

#include "dattn/backend.hpp"

namespace dattn {

std::shared_ptr<const Backend> make_video_sparse_backend();

}  // namespace dattn
