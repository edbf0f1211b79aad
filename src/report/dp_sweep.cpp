#include "report/dp_sweep.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "io/run_dir.h"

namespace memfl {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

const char* kColors[] = {"#7f7f7f", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"};

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // x, y
};

// A line (or scatter) chart as inline SVG; x labelled by the values given.
std::string svg_chart(const std::string& title, const std::string& xlabel, const std::string& ylabel,
                      const std::vector<Series>& series, bool lines) {
  const double w = 560, h = 340, l = 70, r = 110, t = 30, b = 46;
  double xmin = 1e300, xmax = -1e300, ymax = 0;
  for (const auto& s : series) {
    for (auto [x, y] : s.points) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
    }
  }
  if (xmin > xmax) xmin = xmax = 0;
  if (ymax <= 0) ymax = 1;
  ymax *= 1.1;
  auto X = [&](double x) { return xmax > xmin ? l + (w - l - r) * (x - xmin) / (xmax - xmin) : (l + w - r) / 2; };
  auto Y = [&](double y) { return t + (h - t - b) * (1 - y / ymax); };
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\"><rect width=\"100%\" height=\"100%\" fill=\"white\"/>"
      "<text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-weight=\"bold\">{}</text>",
      w, h, (l + w - r) / 2, title);
  for (int g = 0; g <= 4; ++g) {
    const double y = ymax * g / 4;
    o += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>", l, w - r, Y(y), Y(y));
    o += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>", l - 6, Y(y) + 4, y);
  }
  std::set<double> xs;
  for (const auto& s : series) {
    for (auto p : s.points) xs.insert(p.first);
  }
  if (xs.size() <= 8) {
    for (double x : xs) {
      o += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.4g}</text>", X(x), h - b + 16, x);
    }
  }
  o += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", (l + w - r) / 2, h - 8, xlabel);
  o += fmt::format("<text x=\"14\" y=\"{0}\" transform=\"rotate(-90 14 {0})\" text-anchor=\"middle\">{1}</text>",
                   (t + h - b) / 2, ylabel);
  for (size_t i = 0; i < series.size(); ++i) {
    const char* c = kColors[i % 6];
    std::string pts;
    for (auto [x, y] : series[i].points) {
      pts += fmt::format("{:.1f},{:.1f} ", X(x), Y(y));
      o += fmt::format("<circle class=\"pt\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\"/>", X(x), Y(y), c);
    }
    if (lines) o += fmt::format("<polyline fill=\"none\" stroke-width=\"2\" stroke=\"{}\" points=\"{}\"/>", c, pts);
    o += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\">{}</text>", w - r + 10, t + 16 * (i + 1), c, series[i].name);
  }
  return o + "</svg>";
}

std::vector<std::string> modes_of(const std::vector<json>& records) {
  std::vector<std::string> modes;
  for (const auto& r : records) {
    const std::string m = r.value("mode", "");
    if (std::find(modes.begin(), modes.end(), m) == modes.end()) modes.push_back(m);
  }
  return modes;
}

}  // namespace

double dp_overhead(const std::vector<json>& records, const std::string& mode, int seq_length, const std::string& key) {
  double base = 0, value = 0;
  for (const auto& r : records) {
    if (r.value("seq_length", 0) != seq_length || !r.contains(key)) continue;
    if (r.value("mode", "") == "no_dp") base = r[key].get<double>();
    if (r.value("mode", "") == mode) value = r[key].get<double>();
  }
  return base > 0 && value > 0 ? value / base : 0;
}

Status write_dp_sweep(const std::vector<json>& records, const std::string& json_path, const std::string& report_dir) {
  json all = json::array();
  for (const auto& r : records) all.push_back(r);
  std::error_code mk;
  if (const auto parent = fs::path(json_path).parent_path(); !parent.empty()) fs::create_directories(parent, mk);
  if (!json_path.empty()) MEMFL_RETURN_IF_ERROR(write_text_file(json_path, all.dump(2) + "\n"));
  if (report_dir.empty()) return Status::Ok();
  std::error_code ec;
  fs::create_directories(report_dir, ec);
  std::string csv = "mode,seq_length,batch_size,num_params,peak_memory_bytes,avg_iteration_ms,device\n";
  for (const auto& r : records) {
    csv +=
        fmt::format("{},{},{},{},{},{:.3f},{}\n", r.value("mode", ""), r.value("seq_length", 0),
                    r.value("batch_size", 0), r.value("num_params", int64_t{0}),
                    r.value("peak_memory_bytes", int64_t{0}), r.value("avg_iteration_ms", 0.0), r.value("device", ""));
  }
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(report_dir) / "dp_sweep.csv").string(), csv));

  // Runs that failed (out of memory) stay in the JSON and the table, not in the charts.
  std::vector<json> ok;
  for (const auto& r : records) {
    if (!r.contains("error")) ok.push_back(r);
  }
  const auto modes = modes_of(ok);
  std::vector<Series> mem, time, scatter, over_mem, over_time;
  for (const auto& m : modes) {
    Series a{m, {}}, b{m, {}}, c{m, {}}, d{m + " memory", {}}, e{m + " time", {}};
    for (const auto& r : ok) {
      if (r.value("mode", "") != m) continue;
      const double seq = r.value("seq_length", 0);
      const double gib = static_cast<double>(r.value("peak_memory_bytes", int64_t{0})) / (1 << 30);
      const double ms = r.value("avg_iteration_ms", 0.0);
      a.points.emplace_back(seq, gib);
      b.points.emplace_back(seq, ms);
      c.points.emplace_back(ms, gib);
      if (m != "no_dp") {
        const int s = static_cast<int>(seq);
        if (double o = dp_overhead(ok, m, s, "peak_memory_bytes"); o > 0) d.points.emplace_back(seq, 100 * (o - 1));
        if (double o = dp_overhead(ok, m, s, "avg_iteration_ms"); o > 0) e.points.emplace_back(seq, 100 * (o - 1));
      }
    }
    mem.push_back(a);
    time.push_back(b);
    scatter.push_back(c);
    if (m != "no_dp") {
      over_mem.push_back(d);
      over_time.push_back(e);
    }
  }
  std::string table =
      "<table><tr><th>mode</th><th>seq</th><th>peak memory</th><th>× no_dp</th><th>ms / iter</th><th>× no_dp</th></tr>";
  for (const auto& r : records) {
    const std::string m = r.value("mode", "");
    const int s = r.value("seq_length", 0);
    if (r.contains("error")) {
      table +=
          fmt::format("<tr><td>{}</td><td>{}</td><td colspan=\"4\">{}</td></tr>", m, s, r["error"].get<std::string>());
      continue;
    }
    table +=
        fmt::format("<tr><td>{}</td><td>{}</td><td>{:.2f} GiB</td><td>{:.3f}</td><td>{:.1f}</td><td>{:.3f}</td></tr>",
                    m, s, static_cast<double>(r.value("peak_memory_bytes", int64_t{0})) / (1 << 30),
                    dp_overhead(records, m, s, "peak_memory_bytes"), r.value("avg_iteration_ms", 0.0),
                    dp_overhead(records, m, s, "avg_iteration_ms"));
  }
  table += "</table>";
  const json& first = records.empty() ? json::object() : records.front();
  std::string html = fmt::format(
      "<!doctype html><html><head><meta charset=\"utf-8\"><title>memfl DP-SGD sweep</title><style>body{{font-family:"
      "sans-serif;margin:20px}} svg{{margin:6px;border:1px solid #eee}} table{{border-collapse:collapse}} "
      "td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}</style></head><body>"
      "<h1>DP-SGD clipping modes</h1><p>model {} ({} parameters), batch {}, device {}</p>{}<div>",
      first.value("model", std::string("?")), first.value("num_params", int64_t{0}), first.value("batch_size", 0),
      first.value("device", std::string("?")), table);
  html += svg_chart("Peak memory by sequence length", "sequence length", "GiB", mem, true);
  html += svg_chart("Time per iteration", "sequence length", "ms", time, true);
  html += svg_chart("Memory against time", "ms per iteration", "GiB", scatter, false);
  std::vector<Series> over = over_mem;
  over.insert(over.end(), over_time.begin(), over_time.end());
  html += svg_chart("Overhead over no_dp", "sequence length", "%", over, true);
  html += "</div><p id=\"memfl-status\">ok</p></body></html>\n";
  return write_text_file((fs::path(report_dir) / "dp_sweep.html").string(), html);
}

}  // namespace memfl
