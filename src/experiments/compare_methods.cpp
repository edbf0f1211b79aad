#include "experiments/compare_methods.h"

#include <chrono>
#include <cmath>
#include <numeric>
#include <filesystem>

#include <malloc.h>

#include "memory/sampler.h"
#include "roles/simulation.h"
#include "schedule/client_selection.h"
#include "tensor/layout.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

std::string svg_plot(const std::vector<std::string>& names, const std::vector<std::vector<double>>& curves) {
  const double w = 720, h = 400, l = 60, r = 160, t = 20, b = 50;
  size_t rounds = 1;
  for (const auto& c : curves) rounds = std::max(rounds, c.size());
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\"><rect width=\"100%\" height=\"100%\" fill=\"white\"/>",
      w, h);
  auto x = [&](double i) { return l + (w - l - r) * (rounds > 1 ? (i - 1) / static_cast<double>(rounds - 1) : 0.5); };
  auto y = [&](double a) { return t + (h - t - b) * (1.0 - a); };
  for (int g = 0; g <= 10; g += 2) {
    out += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>", l, w - r, y(g / 10.0),
                       y(g / 10.0));
    out +=
        fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.1f}</text>", l - 6, y(g / 10.0) + 4, g / 10.0);
  }
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">round</text>", (l + w - r) / 2, h - 12);
  out +=
      fmt::format("<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">test accuracy</text>",
                  (t + h - b) / 2, (t + h - b) / 2);
  for (size_t m = 0; m < curves.size(); ++m) {
    std::string pts;
    for (size_t i = 0; i < curves[m].size(); ++i)
      pts += fmt::format("{:.1f},{:.1f} ", x(static_cast<double>(i + 1)), y(curves[m][i]));
    out += fmt::format("<polyline fill=\"none\" stroke-width=\"2\" stroke=\"{}\" points=\"{}\"/>", colors[m % 6], pts);
    out += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\">{}</text>", w - r + 10, t + 16 * (m + 1), colors[m % 6],
                       names[m]);
  }
  return out + "</svg>\n";
}

}  // namespace

StatusOr<std::string> run_compare_methods(const ExperimentConfig& cfg, const CompareMethodsOptions& o) {
  if (o.methods.empty()) return invalid_argument("--methods: name at least one method (memfl list-methods)");
  if (o.repeats < 1) return invalid_argument("--repeats must be at least 1");
  for (const auto& m : o.methods)
    MEMFL_RETURN_IF_ERROR(make_client_selection(m, {}).status().with_context("--methods"));
  fs::create_directories(o.out_dir);
  std::string csv = "method,repeat,seed,final_accuracy,rounds_to_target,seconds,peak_rss_bytes\n";
  std::string table = fmt::format(
      "| method | final accuracy (mean ± std over {}) | rounds to {:.2f} | seconds | peak RSS MiB |\n"
      "|---|---|---|---|---|\n",
      o.repeats, o.target_accuracy);
  std::vector<std::vector<double>> curves;
  for (const auto& method : o.methods) {
    std::vector<double> finals, seconds, to_target;
    std::vector<double> mean_curve;
    int64_t peak = 0;
    for (int r = 0; r < o.repeats; ++r) {
      ExperimentConfig c = cfg;
      c.server.client_selection = method;
      c.server.seed = cfg.server.seed + static_cast<uint64_t>(r);
      const std::string dir = (fs::path(o.out_dir) / method / fmt::format("seed_{}", c.server.seed)).string();
      fs::create_directories(dir);
      MEMFL_ASSIGN_OR_RETURN(SimulationResult res, run_simulation(c, {dir, false}));
      // The run is over and everything it held (replicas, data set, libtorch
      // scratch) is freed; give malloc's retained pages back so the next
      // method starts where this one did. Measured: without it the third
      // method's peak was 12.6 % above the first's in the same process.
      malloc_trim(0);
      const double final_acc = res.rounds.empty() ? 0.0 : res.rounds.back().test_accuracy;
      int reached = -1;
      for (const auto& m : res.rounds) {
        if (m.test_accuracy >= o.target_accuracy) {
          reached = m.round;
          break;
        }
      }
      finals.push_back(final_acc);
      seconds.push_back(res.wall_seconds);
      if (reached > 0) to_target.push_back(reached);
      peak = std::max(peak, res.peak_rss_bytes);
      mean_curve.resize(std::max(mean_curve.size(), res.rounds.size()), 0.0);
      for (size_t i = 0; i < res.rounds.size(); ++i) mean_curve[i] += res.rounds[i].test_accuracy / o.repeats;
      csv += fmt::format("{},{},{},{:.4f},{},{:.2f},{}\n", method, r, c.server.seed, final_acc, reached,
                         res.wall_seconds, res.peak_rss_bytes);
      fmt::print("compare-methods: {} seed {}: accuracy {:.4f}, {:.1f} s, peak RSS {}\n", method, c.server.seed,
                 final_acc, res.wall_seconds, format_bytes(static_cast<double>(res.peak_rss_bytes)));
      std::fflush(stdout);
    }
    auto mean = [](const std::vector<double>& v) {
      return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
    };
    double var = 0;
    for (double f : finals) var += (f - mean(finals)) * (f - mean(finals));
    const double sd = finals.size() > 1 ? std::sqrt(var / static_cast<double>(finals.size() - 1)) : 0.0;
    table += fmt::format("| {} | {:.4f} ± {:.4f} | {} | {:.1f} | {:.1f} |\n", method, mean(finals), sd,
                         to_target.empty()
                             ? std::string("not reached")
                             : fmt::format("{:.1f} ({} of {} runs)", mean(to_target), to_target.size(), o.repeats),
                         mean(seconds), static_cast<double>(peak) / (1 << 20));
    curves.push_back(mean_curve);
  }
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "results.csv").string(), csv));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "results.md").string(), table));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "accuracy.svg").string(), svg_plot(o.methods, curves)));
  return table;
}

}  // namespace memfl
