// The bench chart's layout: round y ticks, the title and every label inside the canvas, no two
// text boxes overlapping, whatever the workload names and bar counts.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "bar_chart.hpp"

namespace dattn::cli {
namespace {

TEST(BarChart, NiceStepsAreOneTwoOrFiveTimesAPowerOfTen) {
  EXPECT_DOUBLE_EQ(nice_step(152.0, 5), 50.0);
  EXPECT_DOUBLE_EQ(nice_step(101.3, 6), 20.0);
  EXPECT_DOUBLE_EQ(nice_step(0.9, 5), 0.2);
  EXPECT_DOUBLE_EQ(nice_step(1000, 5), 200.0);
  for (double top : {3.7, 47.0, 152.0, 999.0, 12345.0}) {
    const double s = nice_step(top, 6);
    const double mant = s / std::pow(10.0, std::floor(std::log10(s)));
    EXPECT_TRUE(std::fabs(mant - 1) < 1e-9 || std::fabs(mant - 2) < 1e-9 ||
                std::fabs(mant - 5) < 1e-9)
        << s;
    EXPECT_LE(top / s, 6.0 + 1e-9);
  }
}

bool overlap(const ChartText& a, const ChartText& b) {
  return a.x0 < b.x1 && b.x0 < a.x1 && a.y0 < b.y1 && b.y0 < a.y1;
}

TEST(BarChart, TextFitsTheCanvasAndNeverOverlaps) {
  std::vector<ChartBar> bars;
  const std::vector<std::string> workloads{"flux-1024", "sd35-1024", "qwen-image-1024",
                                           "wan-480p-cross", "hunyuan-720p"};
  double v = 40;
  for (const std::string& w : workloads)
    for (const char* dtype : {"f32", "bf16", "f16"})
      for (const char* backend : {"FLASH", "REFERENCE"}) {
        v = v * 1.37;
        if (v > 400) v -= 350;
        // Series name the engine; REFERENCE has none, and no peak ("n/a").
        const bool flash = std::string(backend) == "FLASH";
        const std::string engine = std::string(dtype) == "bf16" ? "avx512_bf16_emulated" : "avx2";
        bars.push_back({w, std::string(backend) + " " + dtype + (flash ? " (" + engine + ")" : ""),
                        v, flash ? 204.5 : 0.0,
                        flash ? std::to_string(int(v / 2.045)) + "%" : std::string("n/a"), ""});
      }
  const Chart c =
      bar_chart("dattn bench: GFLOP/s on 2 thread(s); labels: % of the peak", "GFLOP/s", bars);
  ASSERT_GT(c.texts.size(), workloads.size());
  for (const ChartText& t : c.texts) {
    EXPECT_GE(t.x0, 0) << t.text;
    EXPECT_GE(t.y0, 0) << t.text;
    EXPECT_LE(t.x1, c.width) << t.text;
    EXPECT_LE(t.y1, c.height) << t.text;
  }
  for (std::size_t i = 0; i < c.texts.size(); ++i)
    for (std::size_t j = i + 1; j < c.texts.size(); ++j)
      EXPECT_FALSE(overlap(c.texts[i], c.texts[j]))
          << "'" << c.texts[i].text << "' overlaps '" << c.texts[j].text << "'";
  for (double t : c.ticks) EXPECT_DOUBLE_EQ(t, std::round(t / 50) * 50);  // 50, 100, ...
  EXPECT_NE(c.svg.find("viewBox"), std::string::npos);
  EXPECT_NE(c.svg.find("flux-1024"), std::string::npos);
}

}  // namespace
}  // namespace dattn::cli
