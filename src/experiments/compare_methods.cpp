#include "experiments/compare_methods.h"

#include <chrono>
#include <cmath>
#include <numeric>
#include <sstream>
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

// Accuracy against any x (virtual seconds, rounds): one polyline per run.
std::string svg_xy_plot(const std::vector<std::string>& names, const std::vector<std::vector<double>>& xs,
                        const std::vector<std::vector<double>>& ys, const std::string& xlabel, double target) {
  const double w = 720, h = 400, l = 60, r = 160, t = 20, b = 50;
  double xmax = 0;
  for (const auto& x : xs)
    for (double v : x) xmax = std::max(xmax, v);
  if (xmax <= 0) xmax = 1;
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"};
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\"><rect width=\"100%\" height=\"100%\" fill=\"white\"/>",
      w, h);
  auto X = [&](double v) { return l + (w - l - r) * v / xmax; };
  auto Y = [&](double a) { return t + (h - t - b) * (1.0 - a); };
  for (int g = 0; g <= 10; g += 2) {
    out += fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>", l, w - r, Y(g / 10.0),
                       Y(g / 10.0));
    out +=
        fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.1f}</text>", l - 6, Y(g / 10.0) + 4, g / 10.0);
  }
  for (int g = 0; g <= 4; ++g) {
    out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.4g}</text>", X(xmax * g / 4), h - 30,
                       xmax * g / 4);
  }
  if (target > 0)
    out +=
        fmt::format("<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#999\" stroke-dasharray=\"4 4\"/>",
                    l, w - r, Y(target), Y(target));
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>", (l + w - r) / 2, h - 10, xlabel);
  out +=
      fmt::format("<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">test accuracy</text>",
                  (t + h - b) / 2, (t + h - b) / 2);
  for (size_t m = 0; m < ys.size(); ++m) {
    std::string pts;
    for (size_t i = 0; i < ys[m].size(); ++i) pts += fmt::format("{:.1f},{:.1f} ", X(xs[m][i]), Y(ys[m][i]));
    out += fmt::format("<polyline fill=\"none\" stroke-width=\"2\" stroke=\"{}\" points=\"{}\"/>", colors[m % 8], pts);
    out += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"{}\">{}</text>", w - r + 10, t + 16 * (m + 1), colors[m % 8],
                       names[m]);
  }
  return out + "</svg>\n";
}

}  // namespace

StatusOr<std::pair<std::string, std::string>> algorithm_components(const std::string& algorithm) {
  static const std::vector<std::pair<std::string, std::pair<std::string, std::string>>> known = {
      {"FedAvg", {"SyncScheduler", "FedAvgAggregator"}},
      {"FedAvgM", {"SyncScheduler", "FedAvgMAggregator"}},
      {"FedAdagrad", {"SyncScheduler", "FedAdagradAggregator"}},
      {"FedAdam", {"SyncScheduler", "FedAdamAggregator"}},
      {"FedYogi", {"SyncScheduler", "FedYogiAggregator"}},
      {"FedAsync", {"AsyncScheduler", "FedAsyncAggregator"}},
      {"FedBuff", {"AsyncScheduler", "FedBuffAggregator"}},
      {"FedCompass", {"CompassScheduler", "FedCompassAggregator"}},
  };
  std::string names;
  for (const auto& [name, parts] : known) {
    if (name == algorithm) return parts;
    names += (names.empty() ? "" : ", ") + name;
  }
  return invalid_argument("--algorithms: unknown algorithm '{}'; known: {}", algorithm, names);
}

StatusOr<std::string> run_compare_algorithms(const ExperimentConfig& cfg, const CompareAlgorithmsOptions& o) {
  if (o.algorithms.empty()) return invalid_argument("--algorithms: name at least one (e.g. FedAvg,FedAsync)");
  if (o.targets.empty()) return invalid_argument("--target: name at least one accuracy (e.g. 0.7,0.8)");
  for (const auto& a : o.algorithms) MEMFL_RETURN_IF_ERROR(algorithm_components(a).status());
  fs::create_directories(o.out_dir);
  const int per_round = cfg.server.clients_per_round > 0 && cfg.server.clients_per_round < cfg.server.num_clients
                            ? cfg.server.clients_per_round
                            : cfg.server.num_clients;
  std::string csv = "algorithm,final_accuracy,best_accuracy,rounds,virtual_seconds";
  std::string table = "| algorithm | final accuracy | best";
  for (double t : o.targets) {
    csv += fmt::format(",virtual_seconds_to_{:.2f},rounds_to_{:.2f}", t, t);
    table += fmt::format(" | virtual time to {:.2f} | rounds to {:.2f}", t, t);
  }
  csv += ",wall_seconds,peak_rss_bytes\n";
  table += " | virtual time, all | wall seconds | peak RSS MiB |\n|---|---|---";
  for (size_t i = 0; i < o.targets.size(); ++i) table += "|---|---";
  table += "|---|---|---|\n";
  std::string curves_csv = "algorithm,round,updates,virtual_seconds,test_accuracy,test_loss\n";
  std::vector<std::vector<double>> xs_time, xs_round, ys;
  // Synchronous algorithms first: with equal_time their virtual time is the
  // asynchronous ones' budget.
  std::vector<std::string> order = o.algorithms;
  std::stable_sort(order.begin(), order.end(), [](const std::string& a, const std::string& b) {
    return (*algorithm_components(a)).first == "SyncScheduler" && (*algorithm_components(b)).first != "SyncScheduler";
  });
  double sync_virtual = 0;
  std::vector<std::string> names;
  for (const auto& algorithm : order) {
    MEMFL_ASSIGN_OR_RETURN(auto parts, algorithm_components(algorithm));
    ExperimentConfig c = cfg;
    c.server.scheduler = parts.first;
    c.server.aggregator = parts.second;
    if (c.server.is_async()) {
      c.server.num_global_epochs = cfg.server.num_global_epochs * per_round;
      c.server.async_eval_every = per_round;
      if (o.equal_time) {
        if (sync_virtual <= 0)
          return invalid_argument("--equal-time needs a synchronous algorithm (FedAvg, ...) among --algorithms");
        c.server.async_virtual_seconds = sync_virtual;
        c.server.num_global_epochs *= o.max_update_factor;
      }
    }
    const std::string dir = (fs::path(o.out_dir) / algorithm).string();
    fs::create_directories(dir);
    MEMFL_ASSIGN_OR_RETURN(SimulationResult res, run_simulation(c, {dir, false}));
    malloc_trim(0);  // as compare-methods: the next run starts where this one did
    std::vector<double> xt, xr, y;
    double best = 0;
    std::vector<double> time_to(o.targets.size(), -1.0);
    std::vector<int> rounds_to(o.targets.size(), -1);
    for (const auto& m : res.rounds) {
      xt.push_back(m.virtual_seconds);
      xr.push_back(m.round);
      y.push_back(m.test_accuracy);
      best = std::max(best, m.test_accuracy);
      for (size_t t = 0; t < o.targets.size(); ++t) {
        if (rounds_to[t] < 0 && m.test_accuracy >= o.targets[t]) {
          rounds_to[t] = m.round;
          time_to[t] = m.virtual_seconds;
        }
      }
      curves_csv +=
          fmt::format("{},{},{},{:.3f},{:.4f},{:.4f}\n", algorithm, m.round, static_cast<int64_t>(m.round) * per_round,
                      m.virtual_seconds, m.test_accuracy, m.test_loss);
    }
    const double final_acc = res.rounds.empty() ? 0.0 : res.rounds.back().test_accuracy;
    const double vt = res.rounds.empty() ? 0.0 : res.rounds.back().virtual_seconds;
    if (!c.server.is_async()) sync_virtual = std::max(sync_virtual, vt);
    names.push_back(algorithm);
    csv += fmt::format("{},{:.4f},{:.4f},{},{:.3f}", algorithm, final_acc, best, res.rounds.size(), vt);
    table += fmt::format("| {} | {:.4f} | {:.4f}", algorithm, final_acc, best);
    for (size_t t = 0; t < o.targets.size(); ++t) {
      csv += fmt::format(",{:.3f},{}", time_to[t], rounds_to[t]);
      table +=
          fmt::format(" | {} | {}", time_to[t] < 0 ? std::string("not reached") : fmt::format("{:.1f} s", time_to[t]),
                      rounds_to[t] < 0 ? std::string("not reached") : std::to_string(rounds_to[t]));
    }
    csv += fmt::format(",{:.2f},{}\n", res.wall_seconds, res.peak_rss_bytes);
    table += fmt::format(" | {:.1f} s | {:.1f} | {:.1f} |\n", vt, res.wall_seconds,
                         static_cast<double>(res.peak_rss_bytes) / (1 << 20));
    fmt::print("compare-algorithms: {}: accuracy {:.4f}, virtual {:.1f} s, wall {:.1f} s\n", algorithm, final_acc, vt,
               res.wall_seconds);
    std::fflush(stdout);
    xs_time.push_back(std::move(xt));
    xs_round.push_back(std::move(xr));
    ys.push_back(std::move(y));
  }
  const std::string by_time = svg_xy_plot(names, xs_time, ys, "virtual time (s)", o.targets.back());
  const std::string by_round =
      svg_xy_plot(names, xs_round, ys, fmt::format("round (= {} client updates)", per_round), o.targets.back());
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "results.csv").string(), csv));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "curves.csv").string(), curves_csv));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "results.md").string(), table));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "accuracy_vs_time.svg").string(), by_time));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(o.out_dir) / "accuracy_vs_rounds.svg").string(), by_round));
  // The page: the table and both plots, nothing fetched.
  std::string rows;
  {
    std::stringstream ss(table);
    std::string line;
    int n = 0;
    while (std::getline(ss, line)) {
      if (n++ == 1 || line.empty()) continue;
      std::string cells;
      std::stringstream ls(line);
      std::string cell;
      std::getline(ls, cell, '|');
      while (std::getline(ls, cell, '|')) cells += (n == 1 ? "<th>" : "<td>") + cell + (n == 1 ? "</th>" : "</td>");
      rows += "<tr>" + cells + "</tr>\n";
    }
  }
  MEMFL_RETURN_IF_ERROR(write_text_file(
      (fs::path(o.out_dir) / "compare.html").string(),
      fmt::format("<!doctype html><meta charset=\"utf-8\"><title>memfl compare-algorithms</title>"
                  "<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ccc;padding:4px 8px}}"
                  "table{{border-collapse:collapse}}</style><h1>FL algorithms on the same clients</h1>"
                  "<p>{} clients, {} rounds of {} updates, client speeds: {} (step time {} s), seed {}.</p>"
                  "<table>{}</table><h2>Test accuracy against virtual time</h2>{}"
                  "<h2>Test accuracy against rounds</h2>{}",
                  cfg.server.num_clients, cfg.server.num_global_epochs, per_round, cfg.server.client_speed_distribution,
                  cfg.server.client_step_time_s, cfg.server.seed, rows, by_time, by_round)));
  return table;
}

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
