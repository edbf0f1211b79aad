#include "report/report.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "memory/profile.h"
#include "report/report_assets.h"
#include "io/run_dir.h"
#include "tensor/layout.h"

namespace memfl {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::vector<std::vector<std::string>> read_csv(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> row;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) row.push_back(cell);
    rows.push_back(row);
  }
  return rows;
}

// Processes of a run: the run dir itself, or its subdirectories with memory.json.
std::vector<fs::path> processes_of(const fs::path& run) {
  std::vector<fs::path> out;
  if (fs::exists(run / "memory.json")) out.push_back(run);
  if (fs::is_directory(run)) {
    std::vector<fs::path> subs;
    for (const auto& e : fs::directory_iterator(run)) {
      if (e.is_directory() && fs::exists(e.path() / "memory.json")) subs.push_back(e.path());
    }
    std::sort(subs.begin(), subs.end(), [](const fs::path& a, const fs::path& b) {
      // server first, then clients/ranks in numeric order
      auto key = [](const fs::path& p) {
        const std::string n = p.filename().string();
        if (n == "server" || n == "rank_0") return std::make_pair(0, 0);
        const auto us = n.rfind('_');
        int idx = 0;
        try {
          idx = us == std::string::npos ? 0 : std::stoi(n.substr(us + 1));
        } catch (...) {
        }
        return std::make_pair(1, idx);
      };
      return key(a) < key(b);
    });
    out.insert(out.end(), subs.begin(), subs.end());
  }
  return out;
}

// d3-flamegraph's hierarchy from (frames outermost first, bytes) pairs.
json flame_tree(const Profile& p, const std::vector<SiteBytes>& sites, const std::string& root_name) {
  json root = {{"name", root_name}, {"value", 0}, {"children", json::array()}};
  for (const auto& s : sites) {
    if (s.bytes <= 0) continue;
    json* node = &root;
    node->at("value") = node->at("value").get<int64_t>() + s.bytes;
    for (const auto& f : p.frames_of(s.stack)) {
      json& children = node->at("children");
      json* next = nullptr;
      for (auto& c : children) {
        if (c["name"] == f) {
          next = &c;
          break;
        }
      }
      if (next == nullptr) {
        children.push_back({{"name", f}, {"value", 0}, {"children", json::array()}});
        next = &children.back();
      }
      next->at("value") = next->at("value").get<int64_t>() + s.bytes;
      node = next;
    }
  }
  return root;
}

struct ProcessData {
  json j;
  std::optional<Profile> profile;
  std::optional<ProfileAnalysis> analysis;
};

StatusOr<ProcessData> load_process(const fs::path& dir, const std::string& name) {
  ProcessData d;
  json mem;
  try {
    std::ifstream in(dir / "memory.json");
    mem = json::parse(in);
  } catch (const std::exception& e) {
    return data_loss("{}: memory.json does not parse: {}", dir.string(), e.what());
  }
  json& j = d.j;
  j["name"] = name;
  j["role"] = mem.value("role", name);
  j["pid"] = mem.value("pid", 0);
  j["peak_rss_bytes"] = mem.value("peak_rss_bytes", int64_t{0});
  j["peak_t_ms"] = mem.value("peak_t_ms", 0.0);
  j["peak_phase"] = mem.value("peak_phase", json::object());
  j["peak_rss_anon_bytes"] = mem.value("peak_rss_anon_bytes", int64_t{0});
  j["peak_rss_file_bytes"] = mem.value("peak_rss_file_bytes", int64_t{0});
  j["start_rss_anon_bytes"] = mem.value("start_rss_anon_bytes", int64_t{0});
  j["ledger"] = mem.value("ledger", json::object());
  j["phases"] = mem.value("phases", json::array());
  // At most ~4000 points per timeline: the max of each bucket, so peaks survive.
  const auto& ts = mem["samples"]["t_ms"];
  const auto& rs = mem["samples"]["rss_bytes"];
  const size_t n = ts.size(), bucket = std::max<size_t>(1, n / 4000);
  json t = json::array(), r = json::array();
  for (size_t i = 0; i < n; i += bucket) {
    int64_t mx = 0;
    size_t at = i;
    for (size_t k = i; k < std::min(n, i + bucket); ++k) {
      if (rs[k].get<int64_t>() >= mx) {
        mx = rs[k].get<int64_t>();
        at = k;
      }
    }
    t.push_back(ts[at]);
    r.push_back(mx);
  }
  j["samples"] = {{"t_ms", t}, {"rss_bytes", r}};
  j["gpu"] = nullptr;
  if (mem.contains("gpu")) {
    const auto& ga = mem["gpu"]["allocated_bytes"];
    const auto& gr = mem["gpu"]["reserved_bytes"];
    json gt = json::array(), gav = json::array(), grv = json::array();
    for (size_t i = 0; i < std::min(ga.size(), n); i += bucket) {
      gt.push_back(ts[i]);
      gav.push_back(ga[i]);
      grv.push_back(gr[i]);
    }
    j["gpu"] = {{"peak_allocated_bytes", mem["gpu"]["peak_allocated_bytes"]},
                {"peak_reserved_bytes", mem["gpu"]["peak_reserved_bytes"]},
                {"t_ms", gt},
                {"allocated_bytes", gav},
                {"reserved_bytes", grv}};
  }
  json summary = json::object();
  if (fs::exists(dir / "summary.json")) {
    try {
      std::ifstream in(dir / "summary.json");
      summary = json::parse(in);
    } catch (...) {
    }
  }
  j["baseline_rss_bytes"] = summary.value("baseline_rss_bytes", int64_t{0});
  j["model_bytes"] = summary.value("model_bytes", int64_t{0});
  j["metrics"] = json::array();
  if (fs::exists(dir / "metrics.csv")) {
    auto rows = read_csv(dir / "metrics.csv");
    for (size_t i = 1; i < rows.size(); ++i) {
      json row = json::object();
      for (size_t c = 0; c < rows[0].size() && c < rows[i].size(); ++c) {
        try {
          row[rows[0][c]] = std::stod(rows[i][c]);
        } catch (...) {
          row[rows[0][c]] = rows[i][c];
        }
      }
      j["metrics"].push_back(row);
    }
  }
  j["config"] = fs::exists(dir / "config.yaml") ? read_text(dir / "config.yaml") : "";
  j["profile"] = nullptr;
  if (fs::exists(dir / "profile.bin")) {
    MEMFL_ASSIGN_OR_RETURN(Profile p, read_profile((dir / "profile.bin").string()));
    ProfileAnalysis a = analyse_profile(p);
    json prof;
    prof["truncated"] = p.truncated;
    prof["threshold"] = p.threshold;
    prof["peak_tracked_bytes"] = a.peak_tracked_bytes;
    prof["peak_t_ms"] = static_cast<double>(a.peak_t_us) / 1000.0;
    prof["peak_phase"] = a.peak_phase;
    prof["peak_round"] = a.peak_round;
    prof["small_at_peak_bytes"] = a.small_at_peak;
    prof["malloc_free_retained_at_peak_bytes"] = a.malloc_free_retained_at_peak;
    // The profile's clock and the sampler's start a few ms apart: align them
    // on the first phase mark both recorded.
    double offset_ms = 0;
    const auto& phases = mem["phases"];
    if (!p.marks.empty() && phases.size() > 1) {
      offset_ms = phases[1]["start_ms"].get<double>() - static_cast<double>(p.marks[0].t_us) / 1000.0;
    }
    const double rss_peak_ms = mem.value("peak_t_ms", 0.0) - offset_ms;
    const Accounting acc = accounting_at(p, a, static_cast<uint64_t>(std::max(0.0, rss_peak_ms) * 1000.0));
    const int64_t anon = mem.value("peak_rss_anon_bytes", int64_t{0}) - mem.value("start_rss_anon_bytes", int64_t{0});
    prof["at_rss_peak"] = {{"tracked_bytes", acc.tracked},
                           {"small_bytes", acc.small},
                           {"malloc_kept_bytes", acc.malloc_kept},
                           {"profiler_own_bytes", acc.profiler_own},
                           {"accounted_bytes", acc.total()},
                           {"anon_growth_bytes", anon},
                           {"accounted_over_anon", anon > 0 ? static_cast<double>(acc.total()) / anon : 0.0}};
    prof["flame"] = flame_tree(p, a.live_at_peak, name + " at its tracked peak");
    // Sites: the innermost frame that is not allocator plumbing (operator
    // new, malloc, libc10's CPU allocator), with the innermost memfl frame
    // that led there, so "which tensor op, for which phase of memfl" reads
    // at a glance. Stacks that share a site are summed.
    auto site_of = [&](uint32_t stack) {
      auto frames = p.frames_of(stack);
      std::string inner, ours;
      for (auto f = frames.rbegin(); f != frames.rend(); ++f) {
        const bool plumbing = f->find("operator new") != std::string::npos || f->find("malloc") != std::string::npos ||
                              f->find("memalign") != std::string::npos || f->find("libc10.so") != std::string::npos ||
                              f->find("libstdc++") != std::string::npos || f->find("[memfl]") != std::string::npos;
        if (inner.empty() && !plumbing) inner = *f;
        if (ours.empty() && f->rfind("memfl::", 0) == 0 && f->find("Arena::Arena") == std::string::npos) ours = *f;
      }
      if (inner.empty()) inner = frames.empty() ? "?" : frames.back();
      auto short_name = [](std::string label) {
        const auto paren = label.find('(');
        const auto module = label.rfind(" [");
        if (paren != std::string::npos && module != std::string::npos && module > paren) {
          label = label.substr(0, paren) + label.substr(module);
        }
        return label;
      };
      return ours.empty() || ours == inner ? short_name(inner) : short_name(inner) + "  ←  " + short_name(ours);
    };
    std::map<std::string, std::array<int64_t, 3>> by_site;  // total, count, at peak
    for (const auto& s : a.total_allocated) {
      auto& v = by_site[site_of(s.stack)];
      v[0] += s.bytes;
      v[1] += s.count;
    }
    for (const auto& l : a.live_at_peak) by_site[site_of(l.stack)][2] += l.bytes;
    std::vector<std::pair<std::string, std::array<int64_t, 3>>> ordered(by_site.begin(), by_site.end());
    std::sort(ordered.begin(), ordered.end(), [](const auto& x, const auto& y) {
      return x.second[2] != y.second[2] ? x.second[2] > y.second[2] : x.second[0] > y.second[0];
    });
    json sites = json::array();
    for (size_t i = 0; i < std::min<size_t>(ordered.size(), 25); ++i) {
      sites.push_back({{"site", ordered[i].first},
                       {"total_bytes", ordered[i].second[0]},
                       {"count", ordered[i].second[1]},
                       {"at_peak_bytes", ordered[i].second[2]}});
    }
    prof["top_sites"] = sites;
    json tl = json::array();
    const size_t m = a.timeline.size(), b = std::max<size_t>(1, m / 2000);
    for (size_t i = 0; i < m; i += b)
      tl.push_back({static_cast<double>(a.timeline[i].first) / 1000.0, a.timeline[i].second});
    prof["tracked_timeline"] = tl;
    j["profile"] = prof;
    d.profile = std::move(p);
    d.analysis = std::move(a);
  }
  return d;
}

std::string html_page(const std::string& title, const json& data, const char* mode) {
  std::string js = data.dump();
  // Inside <script>, "</" would end the element early.
  std::string safe;
  safe.reserve(js.size());
  for (size_t i = 0; i < js.size(); ++i) {
    if (js[i] == '<' && i + 1 < js.size() && js[i + 1] == '/') {
      safe += "<\\/";
      ++i;
    } else {
      safe += js[i];
    }
  }
  std::string out;
  out += "<!doctype html><html><head><meta charset=\"utf-8\"><title>" + title + "</title><style>";
  out += report_asset(ReportAsset::kUplotCss);
  out += report_asset(ReportAsset::kFlamegraphCss);
  out += report_asset(ReportAsset::kPageCss);
  out += "</style></head><body><h1>" + title + "</h1><div id=\"memfl-status\">loading</div><div id=\"app\"></div>";
  out +=
      "<script>window.MEMFL_ERRORS=[];window.addEventListener('error',function(e){window.MEMFL_ERRORS.push("
      "String(e.message))});(function(){var ce=console.error;console.error=function(){window.MEMFL_ERRORS.push("
      "Array.prototype.join.call(arguments,' '));ce.apply(console,arguments)}})();";
  out += "window.MEMFL_MODE='" + std::string(mode) + "';window.MEMFL_DATA=" + safe + ";</script>";
  for (auto a : {ReportAsset::kUplotJs, ReportAsset::kD3Js, ReportAsset::kFlamegraphJs, ReportAsset::kColorMapperJs,
                 ReportAsset::kPageJs}) {
    out += "<script>";
    out += report_asset(a);
    out += "</script>";
  }
  out += "</body></html>\n";
  return out;
}

}  // namespace

std::string live_page_html(const std::string& title) { return html_page(title, json::object(), "live"); }

std::string frozen_live_page_html(const std::string& title, const std::string& state_json) {
  return html_page(title, json::parse(state_json), "frozen");
}

namespace {

std::string fmt_mib(int64_t b) { return fmt::format("{:.1f}", static_cast<double>(b) / (1 << 20)); }

}  // namespace

StatusOr<std::string> write_report(const std::string& run_dir) {
  const fs::path run(run_dir);
  auto procs = processes_of(run);
  if (procs.empty()) return not_found("{}: no memory.json here or in its subdirectories — is it a memfl run?", run_dir);
  const fs::path out = run / "report";
  fs::create_directories(out);
  json data;
  data["title"] = "memfl report — " + fs::weakly_canonical(run).filename().string();
  json run_j;
  run_j["name"] = fs::weakly_canonical(run).filename().string();
  run_j["processes"] = json::array();
  std::string summary = fmt::format("memfl report for {}\n\n", run_dir);
  std::string peaks =
      "process,role,peak_rss_bytes,peak_round,peak_phase,baseline_rss_bytes,model_bytes,tracked_peak_bytes";
  for (const char* c : {"model", "gradients", "optimizer", "comm_buffers", "aggregation", "data", "other"}) {
    peaks += fmt::format(",ledger_{}_at_peak", c);
  }
  peaks += "\n";
  std::string sites_csv = "process,site,total_bytes,count,at_peak_bytes\n";
  for (const auto& dir : procs) {
    const std::string name = dir == run ? "process" : dir.filename().string();
    MEMFL_ASSIGN_OR_RETURN(ProcessData d, load_process(dir, name));
    const json& j = d.j;
    const int64_t tracked = j["profile"].is_null() ? 0 : j["profile"]["peak_tracked_bytes"].get<int64_t>();
    peaks +=
        fmt::format("{},{},{},{},{},{},{},{}", name, j["role"].get<std::string>(), j["peak_rss_bytes"].get<int64_t>(),
                    j["peak_phase"].value("round", 0), j["peak_phase"].value("phase", ""),
                    j["baseline_rss_bytes"].get<int64_t>(), j["model_bytes"].get<int64_t>(), tracked);
    for (const char* c : {"model", "gradients", "optimizer", "comm_buffers", "aggregation", "data", "other"}) {
      peaks += fmt::format(",{}", j["ledger"].contains(c) ? j["ledger"][c].value("at_rss_peak_bytes", int64_t{0}) : 0);
    }
    peaks += "\n";
    summary +=
        fmt::format("{:<10} peak RSS {:>9} MiB in round {} {}", name, fmt_mib(j["peak_rss_bytes"].get<int64_t>()),
                    j["peak_phase"].value("round", 0), j["peak_phase"].value("phase", ""));
    if (j["model_bytes"].get<int64_t>() > 0) {
      summary +=
          fmt::format(" ({:.2f}× the model)", j["peak_rss_bytes"].get<double>() / j["model_bytes"].get<double>());
    }
    summary += "\n";
    summary +=
        fmt::format("           at the peak: {} MiB anonymous + {} MiB file-backed (mapped code, files)\n",
                    fmt_mib(j["peak_rss_anon_bytes"].get<int64_t>()), fmt_mib(j["peak_rss_file_bytes"].get<int64_t>()));
    if (!j["gpu"].is_null()) {
      summary += fmt::format("           GPU (CUDA caching allocator): peak {} MiB allocated, {} MiB reserved\n",
                             fmt_mib(j["gpu"]["peak_allocated_bytes"].get<int64_t>()),
                             fmt_mib(j["gpu"]["peak_reserved_bytes"].get<int64_t>()));
    }
    if (d.profile) {
      summary += fmt::format(
          "           tracked peak {} MiB (allocations ≥ {} KiB) + {} MiB in smaller ones + {} MiB freed but "
          "kept by malloc, in round {} {}{}\n",
          fmt_mib(tracked), d.profile->threshold >> 10, fmt_mib(d.analysis->small_at_peak),
          fmt_mib(d.analysis->malloc_free_retained_at_peak), d.analysis->peak_round, d.analysis->peak_phase,
          d.profile->truncated ? " — profile truncated (process died?)" : "");
      const auto& at = j["profile"]["at_rss_peak"];
      summary += fmt::format(
          "           at the RSS peak the profile accounts for {} MiB (tracked {} + small {} + kept by "
          "malloc {} + the profiler's own {}) of {} MiB anonymous growth since start: {:.0f} %\n",
          fmt_mib(at["accounted_bytes"].get<int64_t>()), fmt_mib(at["tracked_bytes"].get<int64_t>()),
          fmt_mib(at["small_bytes"].get<int64_t>()), fmt_mib(at["malloc_kept_bytes"].get<int64_t>()),
          fmt_mib(at["profiler_own_bytes"].get<int64_t>()), fmt_mib(at["anon_growth_bytes"].get<int64_t>()),
          100.0 * at["accounted_over_anon"].get<double>());
      for (const auto& s : j["profile"]["top_sites"]) {
        sites_csv +=
            fmt::format("{},\"{}\",{},{},{}\n", name, s["site"].get<std::string>(), s["total_bytes"].get<int64_t>(),
                        s["count"].get<int64_t>(), s["at_peak_bytes"].get<int64_t>());
      }
      int shown = 0;
      for (const auto& s : j["profile"]["top_sites"]) {
        if (shown++ == 5) break;
        summary += fmt::format("             {:>9} MiB at peak, {:>9} MiB total  {}\n",
                               fmt_mib(s["at_peak_bytes"].get<int64_t>()), fmt_mib(s["total_bytes"].get<int64_t>()),
                               s["site"].get<std::string>());
      }
      MEMFL_RETURN_IF_ERROR(
          write_text_file((out / (name + ".folded")).string(), folded_stacks(*d.profile, d.analysis->live_at_peak)));
    }
    // A role run with --http left its live page's last state: the report
    // shows its clients table and links the frozen page.
    if (fs::exists(dir / "live_state.json")) {
      try {
        d.j["live"] = json::parse(read_text(dir / "live_state.json"));
        d.j["live_page"] = fs::relative(dir / "live.html", out).string();
      } catch (const json::exception& e) {
        return invalid_argument("{}: not the live page's state ({})", (dir / "live_state.json").string(), e.what());
      }
    }
    run_j["processes"].push_back(j);
  }
  data["runs"] = json::array({run_j});
  MEMFL_RETURN_IF_ERROR(write_text_file((out / "summary.txt").string(), summary));
  MEMFL_RETURN_IF_ERROR(write_text_file((out / "peaks.csv").string(), peaks));
  MEMFL_RETURN_IF_ERROR(write_text_file((out / "sites.csv").string(), sites_csv));
  MEMFL_RETURN_IF_ERROR(write_text_file((out / "data.json").string(), data.dump(1) + "\n"));
  MEMFL_RETURN_IF_ERROR(write_text_file((out / "index.html").string(), html_page(data["title"], data, "report")));
  return out.string();
}

StatusOr<std::string> write_comparison(const std::vector<std::string>& run_dirs, const std::string& out_dir) {
  if (run_dirs.size() < 2) return invalid_argument("compare needs at least two run directories");
  fs::create_directories(out_dir);
  json data;
  data["title"] = "memfl comparison";
  data["runs"] = json::array();
  std::vector<std::map<std::string, ProcessData>> runs;
  for (const auto& r : run_dirs) {
    auto procs = processes_of(r);
    if (procs.empty()) return not_found("{}: no memory.json here or in its subdirectories", r);
    json run_j;
    run_j["name"] = fs::weakly_canonical(r).filename().string() + " (" + r + ")";
    run_j["processes"] = json::array();
    std::map<std::string, ProcessData> by_name;
    for (const auto& dir : procs) {
      const std::string name = dir == fs::path(r) ? "process" : dir.filename().string();
      MEMFL_ASSIGN_OR_RETURN(ProcessData d, load_process(dir, name));
      run_j["processes"].push_back(d.j);
      by_name.emplace(name, std::move(d));
    }
    data["runs"].push_back(run_j);
    runs.push_back(std::move(by_name));
  }
  // Peaks per role against the first run, and differential flamegraphs.
  std::string text = fmt::format("memfl comparison (baseline: {})\n\n", run_dirs[0]);
  std::string csv = "role,run,peak_rss_bytes,change_bytes,change_percent,mean_round_seconds,final_test_accuracy\n";
  json diffs = json::object();
  for (const auto& [role, base] : runs[0]) {
    const int64_t b = base.j["peak_rss_bytes"].get<int64_t>();
    for (size_t k = 0; k < runs.size(); ++k) {
      auto it = runs[k].find(role);
      if (it == runs[k].end()) continue;
      const int64_t v = it->second.j["peak_rss_bytes"].get<int64_t>();
      double secs = 0, acc = 0;
      const auto& m = it->second.j["metrics"];
      for (const auto& row : m) secs += row.value("round_seconds", 0.0);
      if (!m.empty()) {
        secs /= static_cast<double>(m.size());
        acc = m.back().value("test_accuracy", 0.0);
      }
      const double pct = b > 0 ? 100.0 * static_cast<double>(v - b) / static_cast<double>(b) : 0.0;
      csv += fmt::format("{},{},{},{},{:.2f},{:.3f},{:.4f}\n", role, k, v, v - b, pct, secs, acc);
      text += fmt::format("{:<10} run {}: peak RSS {:>9} MiB ({:+.1f} %)  round {:.2f} s  accuracy {:.4f}\n", role, k,
                          fmt_mib(v), pct, secs, acc);
      // What grew and what shrank, by allocation site, at each run's peak.
      if (k > 0 && base.profile && it->second.profile) {
        std::map<std::string, std::pair<int64_t, int64_t>> sites;  // folded stack -> (base, this)
        auto add = [&](const Profile& p, const std::vector<SiteBytes>& live, bool second) {
          for (const auto& s : live) {
            std::string key;
            for (const auto& f : p.frames_of(s.stack)) key += (key.empty() ? "" : ";") + f;
            (second ? sites[key].second : sites[key].first) += s.bytes;
          }
        };
        add(*base.profile, base.analysis->live_at_peak, false);
        add(*it->second.profile, it->second.analysis->live_at_peak, true);
        json root = {{"name", role + ": run " + std::to_string(k) + " vs baseline"},
                     {"value", 0},
                     {"delta", 0},
                     {"children", json::array()}};
        std::string folded;
        for (const auto& [key, vals] : sites) {
          const int64_t value = std::max<int64_t>(vals.second, 0), delta = vals.second - vals.first;
          folded += fmt::format("{} {} {}\n", key, vals.first, vals.second);  // difffolded.pl's format
          json* node = &root;
          node->at("value") = node->at("value").get<int64_t>() + value;
          std::stringstream ss(key);
          std::string f;
          while (std::getline(ss, f, ';')) {
            json& ch = node->at("children");
            json* next = nullptr;
            for (auto& c : ch) {
              if (c["name"] == f) next = &c;
            }
            if (!next) {
              ch.push_back({{"name", f}, {"value", 0}, {"delta", 0}, {"children", json::array()}});
              next = &ch.back();
            }
            next->at("value") = next->at("value").get<int64_t>() + value;
            node = next;
          }
          // The change belongs to the allocating frame; the page sums it upwards.
          node->at("delta") = node->at("delta").get<int64_t>() + delta;
        }
        diffs[role + "_run" + std::to_string(k)] = root;
        MEMFL_RETURN_IF_ERROR(
            write_text_file((fs::path(out_dir) / fmt::format("{}.run{}.diff.folded", role, k)).string(), folded));
      }
    }
  }
  data["diff_flames"] = diffs;
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(out_dir) / "comparison.txt").string(), text));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(out_dir) / "comparison.csv").string(), csv));
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(out_dir) / "data.json").string(), data.dump(1) + "\n"));
  MEMFL_RETURN_IF_ERROR(
      write_text_file((fs::path(out_dir) / "index.html").string(), html_page("memfl comparison", data, "compare")));
  return out_dir;
}

}  // namespace memfl
