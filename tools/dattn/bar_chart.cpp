#include "bar_chart.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace dattn::cli {

namespace {

const char* const kColours[] = {"#3465a4", "#f57900", "#4e9a06", "#75507b",
                                "#c4a000", "#cc0000", "#06989a", "#555753"};

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

double text_width(const std::string& s, double font) {
  return 0.6 * font * double(s.size());
}

std::string number(double v) {
  std::ostringstream os;
  if (v == std::floor(v))
    os << std::fixed << std::setprecision(0) << v;
  else
    os << v;
  return os.str();
}

// Emits SVG text and records its box. anchor: 's'tart, 'm'iddle or 'e'nd; y is the baseline.
class Writer {
 public:
  std::ostringstream os;
  std::vector<ChartText> texts;

  void text(double x, double y, const std::string& s, double font, char anchor,
            const std::string& extra = "") {
    const double w = text_width(s, font);
    const double x0 = anchor == 's' ? x : anchor == 'm' ? x - w / 2 : x - w;
    texts.push_back({x0, y - 0.8 * font, x0 + w, y + 0.2 * font, s});
    os << "<text x=\"" << x << "\" y=\"" << y << "\" font-size=\"" << font << "\""
       << (anchor == 'm'   ? " text-anchor=\"middle\""
           : anchor == 'e' ? " text-anchor=\"end\""
                           : "")
       << extra << ">" << escape_xml(s) << "</text>\n";
  }
};

}  // namespace

double nice_step(double top, int max_ticks) {
  if (!(top > 0) || max_ticks < 1) return 1;
  const double raw = top / max_ticks;
  double scale = std::pow(10.0, std::floor(std::log10(raw)));
  for (;;) {
    for (double m : {1.0, 2.0, 5.0})
      if (m * scale >= raw * (1 - 1e-12)) return m * scale;
    scale *= 10;
  }
}

Chart bar_chart(const std::string& title, const std::string& y_label,
                const std::vector<ChartBar>& bars) {
  std::vector<std::string> groups, series;
  double top = 0;
  for (const ChartBar& b : bars) {
    if (std::find(groups.begin(), groups.end(), b.group) == groups.end()) groups.push_back(b.group);
    if (std::find(series.begin(), series.end(), b.series) == series.end())
      series.push_back(b.series);
    top = std::max({top, b.value, b.peak});
  }
  const double step = nice_step(top * 1.08, 6);  // headroom for the labels above the bars
  const int intervals = std::max(1, int(std::ceil(top * 1.08 / step - 1e-9)));
  const double y_max = step * intervals;

  const double font = 12, small = 10, title_font = 15;
  const double bar = 34, bar_gap = 4, group_pad = 24;
  // The y tick labels' width decides the left margin.
  double tick_w = 0;
  for (int t = 0; t <= intervals; ++t)
    tick_w = std::max(tick_w, text_width(number(step * t), font));
  const double left = 20 + tick_w + 10, top_margin = 64, chart_h = 300;
  std::vector<double> group_w(groups.size());
  std::vector<std::vector<const ChartBar*>> members(groups.size());
  for (const ChartBar& b : bars)
    members[std::size_t(std::find(groups.begin(), groups.end(), b.group) - groups.begin())]
        .push_back(&b);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const double bars_w = double(members[g].size()) * (bar + bar_gap) - bar_gap;
    group_w[g] = std::max(bars_w, text_width(groups[g], font)) + group_pad;
  }
  double plot_w = 0;
  for (double w : group_w) plot_w += w;
  double legend_w = 0;
  for (const std::string& s : series) legend_w = std::max(legend_w, 18 + text_width(s, font));
  const double legend_x = left + plot_w + 20;
  double width = legend_x + legend_w + 20;
  width = std::max(width, 20 + text_width(title, title_font) + 20);
  const double legend_h = 20.0 * double(series.size());
  const double height = top_margin + std::max(chart_h, legend_h) + 50;
  const auto y_of = [&](double v) { return top_margin + chart_h - v / y_max * chart_h; };

  Writer w;
  w.os << std::fixed << std::setprecision(1);
  w.os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
       << "\" viewBox=\"0 0 " << width << " " << height << "\" font-family=\"sans-serif\">\n"
       << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  w.text(20, 24, title, title_font, 's', " font-weight=\"bold\"");
  w.text(20, 46, y_label, small, 's', " fill=\"#555\"");
  Chart chart;
  for (int t = 0; t <= intervals; ++t) {
    const double v = step * t, y = y_of(v);
    chart.ticks.push_back(v);
    w.os << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << y << "\" y2=\""
         << y << "\" stroke=\"" << (t == 0 ? "#888" : "#e0e0e0") << "\"/>\n";
    w.text(left - 8, y + 4, number(v), font, 'e');
  }
  double x = left;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const double bars_w = double(members[g].size()) * (bar + bar_gap) - bar_gap;
    double bx = x + (group_w[g] - bars_w) / 2;
    for (const ChartBar* b : members[g]) {
      const auto si = std::find(series.begin(), series.end(), b->series) - series.begin();
      const double y = y_of(b->value);
      w.os << "<rect x=\"" << bx << "\" y=\"" << y << "\" width=\"" << bar << "\" height=\""
           << y_of(0) - y << "\" fill=\"" << kColours[si % 8] << "\"><title>"
           << escape_xml(b->tooltip.empty() ? b->series : b->tooltip) << "</title></rect>\n";
      if (b->peak > 0)
        w.os << "<line x1=\"" << bx - 2 << "\" x2=\"" << bx + bar + 2 << "\" y1=\"" << y_of(b->peak)
             << "\" y2=\"" << y_of(b->peak) << "\" stroke=\"#333\" stroke-dasharray=\"3 2\"/>\n";
      if (!b->label.empty()) w.text(bx + bar / 2, y - 4, b->label, small * 0.9, 'm');
      bx += bar + bar_gap;
    }
    w.text(x + group_w[g] / 2, y_of(0) + 18, groups[g], font, 'm');
    x += group_w[g];
  }
  for (std::size_t s = 0; s < series.size(); ++s) {
    const double y = top_margin + 20.0 * double(s);
    w.os << "<rect x=\"" << legend_x << "\" y=\"" << y << "\" width=\"12\" height=\"12\" fill=\""
         << kColours[s % 8] << "\"/>\n";
    w.text(legend_x + 18, y + 11, series[s], font, 's');
  }
  w.text(legend_x, top_margin + legend_h + 14, "- - - peak of the bar's engine", small, 's',
         " fill=\"#555\"");
  w.os << "</svg>\n";
  chart.svg = w.os.str();
  chart.width = int(std::ceil(width));
  chart.height = int(std::ceil(height));
  chart.texts = std::move(w.texts);
  return chart;
}

}  // namespace dattn::cli
