// A grouped bar chart as SVG, laid out so that a person can read it: a title inside the canvas,
// y ticks at round values (1, 2 or 5 x 10^n steps), group labels that fit under their bars,
// one legend entry per series, and every text box inside the canvas without overlaps (the
// chart returns the boxes it estimated, so a test can check that).
#pragma once

#include <string>
#include <vector>

namespace dattn::cli {

struct ChartBar {
  std::string group;    // x-axis group (a workload)
  std::string series;   // colour and legend entry (backend, dtype, engine)
  double value = 0;     // bar height (GFLOP/s)
  double peak = 0;      // the peak of the engine that computed it (dashed tick); 0 = none
  std::string label;    // written above the bar (e.g. "67%")
  std::string tooltip;  // <title> of the bar
};

// A text element's box as laid out (font metrics estimated: 0.6 em per character).
struct ChartText {
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  std::string text;
};

struct Chart {
  std::string svg;
  int width = 0, height = 0;
  std::vector<ChartText> texts;
  std::vector<double> ticks;  // y tick values, bottom up
};

// The smallest step of the form {1, 2, 5} x 10^n that covers `top` in at most `max_ticks`
// intervals. Example: top 152.0, 5 ticks -> 50 (ticks 0, 50, 100, 150, 200).
double nice_step(double top, int max_ticks);

Chart bar_chart(const std::string& title, const std::string& y_label,
                const std::vector<ChartBar>& bars);

}  // namespace dattn::cli
