// Reports end to end: a profiled run, `memfl report`, `memfl compare`, and
// the pages opened in headless Chromium (Debian's chromium) with no console
// errors and non-empty charts and flamegraphs.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "cli_util.h"
#include "test_util.h"

namespace memfl {
namespace {

// The page writes "ok charts=N flames=M" (or "error: ...", with every
// console error and uncaught exception) into #memfl-status once rendered.
std::string page_status(const std::string& html, const std::string& profile_dir) {
  const std::string cmd =
      "timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
      "--disable-background-networking --disable-component-update --disable-sync --user-data-dir=" +
      profile_dir + " --virtual-time-budget=10000 --dump-dom file://" + html + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string dom;
  char buf[65536];
  while (size_t n = fread(buf, 1, sizeof buf, p)) dom.append(buf, n);
  pclose(p);
  std::smatch m;
  if (std::regex_search(dom, m, std::regex("<div id=\"memfl-status\">([^<]*)</div>"))) return m[1];
  return "no status in the DOM (" + std::to_string(dom.size()) + " bytes; is Debian's chromium installed?)";
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

TEST(Report, ComparisonPageShowsChangeAndRenders) {
  testing::TempDir tmp;
  ASSERT_EQ(memfl_cli(std::string(kRun) + " --profile --out " + tmp.file("a")).exit_code, 0);
  ASSERT_EQ(memfl_cli(std::string(kRun) + " --profile --set client_configs.model_configs.model_name=MLP --out " +
                      tmp.file("b"))
                .exit_code,
            0);
  Result c = memfl_cli("compare " + tmp.file("a") + " " + tmp.file("b") + " --out " + tmp.file("cmp"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  auto rows = read_csv(tmp.file("cmp/comparison.csv"));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0][4], "change_percent");
  EXPECT_EQ(rows[1][4], "0.00");  // the baseline against itself
  const std::string status = page_status(tmp.file("cmp/index.html"), tmp.file("chrome2"));
  EXPECT_EQ(status.rfind("ok", 0), 0u) << status;
  EXPECT_GE(count_of(status, "charts"), 1) << status;
  EXPECT_GE(count_of(status, "flames"), 1) << status << " (differential flamegraph)";
  EXPECT_TRUE(std::filesystem::exists(tmp.file("cmp/process.run1.diff.folded")));
}

TEST(Report, NamesWhatIsMissing) {
  Result r = memfl_cli("report /nonexistent/run");
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_NE(r.output.find("/nonexistent/run"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memfl
