#include "core/builtin_backends.hpp"

#include "backends/flash/flash.hpp"
#include "backends/reference/reference.hpp"
#include "backends/sparse/video_sparse.hpp"
#include "dattn/registry.hpp"

namespace dattn {

void register_builtin_backends(Registry& registry) {
  registry.add(make_flash_backend());
  registry.add(make_reference_backend());
  registry.add(make_video_sparse_backend());
  registry.add(make_sage_backend());
}

}  // namespace dattn
