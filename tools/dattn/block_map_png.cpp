#include "block_map_png.hpp"

#include <png.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

namespace dattn::cli {

void write_block_map_png(const std::string& path, const BlockMap& map, const CallTiling& tiling,
                         std::int64_t batch, std::int64_t head) {
  using i64 = std::int64_t;
  const i64 rows = std::max<i64>(map.query_blocks, 1), cols = std::max<i64>(map.key_blocks, 1);
  const i64 scale = std::clamp<i64>(512 / std::max(rows, cols), 1, 16);
  const i64 width = cols * scale, height = rows * scale;
  std::vector<png_byte> pixels(std::size_t(width * height * 3), 255);
  const auto& qblocks = tiling.queries.blocks();
  const auto& kblocks = tiling.keys.blocks();
  for (i64 qb = 0; qb < map.query_blocks; ++qb)
    for (const std::int32_t kb : map.selected(batch, head, qb)) {
      const bool dense = qblocks[std::size_t(qb)].dense || kblocks[std::size_t(kb)].dense;
      const png_byte r = dense ? 40 : 25, g = dense ? 90 : 25, b = dense ? 200 : 25;
      for (i64 y = qb * scale; y < (qb + 1) * scale; ++y)
        for (i64 x = i64(kb) * scale; x < (i64(kb) + 1) * scale; ++x) {
          png_byte* px = pixels.data() + (y * width + x) * 3;
          px[0] = r, px[1] = g, px[2] = b;
        }
    }
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(width);
  image.height = static_cast<png_uint_32>(height);
  image.format = PNG_FORMAT_RGB;
  if (!png_image_write_to_file(&image, path.c_str(), 0, pixels.data(),
                               static_cast<png_int_32>(width * 3), nullptr))
    throw std::runtime_error("cannot write " + path + ": " + image.message);
}

}  // namespace dattn::cli
