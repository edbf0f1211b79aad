// Reports end to end: a profiled run, `memfl report`, `memfl compare`, and
// the pages opened in headless Chromium (Debian's chromium) with no console
// errors and non-empty charts and flamegraphs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_util.h"

namespace memfl {
namespace {

// The DOM of `html` once headless Chromium has rendered it.
std::string rendered_dom(const std::string& html, const std::string& profile_dir) {
  const std::string cmd =
      "timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
      "--disable-background-networking --disable-component-update --disable-sync --user-data-dir=" +
      profile_dir + " --virtual-time-budget=10000 --dump-dom file://" + html + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string dom;
  char buf[65536];
  while (size_t n = fread(buf, 1, sizeof buf, p)) dom.append(buf, n);
  pclose(p);
  return dom;
}

// The page writes "ok charts=N flames=M" (or "error: ...", with every
// console error and uncaught exception) into #memfl-status once rendered.
std::string status_in(const std::string& dom) {
  std::smatch m;
  if (std::regex_search(dom, m, std::regex("<div id=\"memfl-status\">([^<]*)</div>"))) return m[1];
  return "no status in the DOM (" + std::to_string(dom.size()) + " bytes; is Debian's chromium installed?)";
}

std::string page_status(const std::string& html, const std::string& profile_dir) {
  return status_in(rendered_dom(html, profile_dir));
}

int count_of(const std::string& status, const std::string& key) {
  std::smatch m;
  if (std::regex_search(status, m, std::regex(key + "=(\\d+)"))) return std::stoi(m[1]);
  return -1;
}

constexpr const char* kRun =
    "run -q --set server_configs.num_clients=2 --set server_configs.num_global_epochs=1"
    " --set client_configs.data_configs.dataset_kwargs.max_train_samples=1000"
    " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200"
    " --set client_configs.train_configs.num_threads=1";

TEST(Report, ProfiledRunGivesAPageThatRendersInChromium) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  Result r = memfl_cli(std::string(kRun) + " --profile --out " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(std::filesystem::exists(run + "/profile.bin"));
  Result rep = memfl_cli("report " + run);
  ASSERT_EQ(rep.exit_code, 0) << rep.output;
  for (const char* f : {"index.html", "summary.txt", "peaks.csv", "sites.csv", "process.folded", "data.json"}) {
    EXPECT_TRUE(std::filesystem::exists(run + "/report/" + f)) << f;
  }
  // Folded stacks are "frame;frame;... bytes" lines, as flamegraph.pl reads them.
  std::ifstream folded(run + "/report/process.folded");
  std::string line;
  ASSERT_TRUE(std::getline(folded, line));
  EXPECT_TRUE(std::regex_search(line, std::regex("^[^ ]+(;[^ ]+)+ [0-9]+$"))) << line;
  const std::string status = page_status(run + "/report/index.html", tmp.file("chrome1"));
  EXPECT_EQ(status.rfind("ok", 0), 0u) << status;
  EXPECT_GE(count_of(status, "charts"), 1) << status;
  EXPECT_GE(count_of(status, "flames"), 1) << status;
  // Self-contained: no network at view time.
  std::ifstream in(run + "/report/index.html");
  const std::string html((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(html.find("<script src="), std::string::npos);
  EXPECT_EQ(html.find("<link "), std::string::npos);
}

int64_t peak_rss_of(const std::string& run) {
  std::ifstream in(run + "/memory.json");
  return nlohmann::json::parse(in)["peak_rss_bytes"].get<int64_t>();
}

std::string printed(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

TEST(Report, ComparisonPageShowsChangeAndRenders) {
  testing::TempDir tmp;
  const std::string a = tmp.file("a"), b = tmp.file("b");
  ASSERT_EQ(memfl_cli(std::string(kRun) + " --profile --out " + a).exit_code, 0);
  ASSERT_EQ(memfl_cli(std::string(kRun) + " --profile --set client_configs.model_configs.model_name=MLP --out " + b)
                .exit_code,
            0);
  // The change, from the two runs' own numbers.
  const int64_t peak_a = peak_rss_of(a), peak_b = peak_rss_of(b);
  ASSERT_GT(peak_a, 0);
  ASSERT_NE(peak_a, peak_b) << "a CNN and an MLP run should not peak at the same byte";
  const double pct = 100.0 * static_cast<double>(peak_b - peak_a) / static_cast<double>(peak_a);

  Result c = memfl_cli("compare " + a + " " + b + " --out " + tmp.file("cmp"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  auto rows = read_csv(tmp.file("cmp/comparison.csv"));
  ASSERT_EQ(rows.size(), 3u);
  ASSERT_EQ(rows[0].size(), 7u);
  EXPECT_EQ(rows[0][2], "peak_rss_bytes");
  EXPECT_EQ(rows[0][3], "change_bytes");
  EXPECT_EQ(rows[0][4], "change_percent");
  ASSERT_EQ(rows[1].size(), 7u);
  EXPECT_EQ(rows[1][1], "0");
  EXPECT_EQ(rows[1][2], std::to_string(peak_a));
  EXPECT_EQ(rows[1][4], "0.00");  // the baseline against itself
  ASSERT_EQ(rows[2].size(), 7u);
  EXPECT_EQ(rows[2][1], "1");
  EXPECT_EQ(rows[2][2], std::to_string(peak_b));
  EXPECT_EQ(rows[2][3], std::to_string(peak_b - peak_a));
  EXPECT_EQ(rows[2][4], printed("%.2f", pct));

  std::ifstream txt_in(tmp.file("cmp/comparison.txt"));
  const std::string txt((std::istreambuf_iterator<char>(txt_in)), {});
  EXPECT_NE(txt.find("run 1: peak RSS"), std::string::npos) << txt;
  EXPECT_NE(txt.find("(" + printed("%+.1f", pct) + " %)"), std::string::npos) << pct << "\n" << txt;

  // The page computes its change from data.json's peaks: those are the runs'.
  std::ifstream data_in(tmp.file("cmp/data.json"));
  const auto data = nlohmann::json::parse(data_in);
  ASSERT_EQ(data["runs"].size(), 2u);
  EXPECT_EQ(data["runs"][0]["processes"][0]["peak_rss_bytes"].get<int64_t>(), peak_a);
  EXPECT_EQ(data["runs"][1]["processes"][0]["peak_rss_bytes"].get<int64_t>(), peak_b);

  const std::string dom = rendered_dom(tmp.file("cmp/index.html"), tmp.file("chrome2"));
  const std::string status = status_in(dom);
  EXPECT_EQ(status.rfind("ok", 0), 0u) << status;
  EXPECT_GE(count_of(status, "charts"), 1) << status;
  EXPECT_GE(count_of(status, "flames"), 1) << status << " (differential flamegraph)";
  // The peak table's change cell for run 1 as the page prints it ("+12.3 %";
  // the baseline's is "-"). toFixed rounds a tie away from zero where
  // printf rounds it to even: either is the change.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, std::regex(">([+-]?[0-9]+\\.[0-9]) %</td>"))) << "no change cell in the page";
  const double away = std::nextafter(pct, pct > 0 ? HUGE_VAL : -HUGE_VAL);
  EXPECT_TRUE(m[1] == printed("%+.1f", pct) || m[1] == printed("%+.1f", away))
      << m[1] << " where the runs give " << pct;
  EXPECT_TRUE(std::filesystem::exists(tmp.file("cmp/process.run1.diff.folded")));
}

TEST(Report, NamesWhatIsMissing) {
  Result r = memfl_cli("report /nonexistent/run");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.output.find("/nonexistent/run"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memfl
