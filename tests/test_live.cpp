// The live endpoint (--http): the metrics registry's Prometheus text parsed
// by a small parser written here, its bounded timeline, and end to end a
// `memfl run --http 127.0.0.1:0` scraped while it runs — /metrics twice (the
// round counter moves), /healthz, bad requests (unknown path, huge headers,
// a crowd of idle connections, a missing token); in process, an endpoint
// under connections that trickle their heads, a head of many small headers,
// a many-ranged Range; an address off loopback without a token refused —
// and headless Chromium loading the live page with its curves and clients
// table filled in.
#include <gtest/gtest.h>

#include <algorithm>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "io/run_dir.h"
#include "live/http_endpoint.h"
#include "live/live_metrics.h"
#include "test_util.h"

namespace memfl {
namespace {

using namespace std::chrono_literals;

// ---- A Prometheus text-format (0.0.4) parser, strict enough to fail. ----
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};
struct Exposition {
  std::map<std::string, std::string> type, help;
  std::vector<Sample> samples;
  std::vector<std::string> errors;
  double value(const std::string& name, const std::map<std::string, std::string>& match = {}) const {
    for (const auto& s : samples) {
      if (s.name != name) continue;
      bool ok = true;
      for (const auto& [k, v] : match) ok = ok && s.labels.count(k) && s.labels.at(k) == v;
      if (ok) return s.value;
    }
    return std::nan("");
  }
};

// The family a sample belongs to: histograms' _bucket/_sum/_count share one.
std::string family_of(const std::string& name, const std::map<std::string, std::string>& type) {
  for (const char* suffix : {"_bucket", "_sum", "_count"}) {
    const std::string s(suffix);
    if (name.size() > s.size() && name.ends_with(s)) {
      const std::string base = name.substr(0, name.size() - s.size());
      if (type.count(base) && type.at(base) == "histogram") return base;
    }
  }
  return name;
}

Exposition parse_prometheus(const std::string& text) {
  Exposition e;
  static const std::regex name_re("[a-zA-Z_:][a-zA-Z0-9_:]*");
  static const std::regex sample_re(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)( -?[0-9]+)?$)");
  static const std::regex label_re(R"re(\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$))re");
  if (text.empty() || text.back() != '\n') e.errors.push_back("the text does not end with a newline");
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    const std::string at = "line " + std::to_string(n) + ": " + line;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::smatch m;
      if (std::regex_match(line, m, std::regex(R"(^# (HELP|TYPE) (\S+) (.*)$)"))) {
        if (!std::regex_match(m[2].str(), name_re)) e.errors.push_back("bad metric name: " + at);
        if (m[1] == "TYPE") {
          static const std::set<std::string> types = {"counter", "gauge", "histogram", "summary", "untyped"};
          if (!types.count(m[3])) e.errors.push_back("bad type: " + at);
          if (e.type.count(m[2])) e.errors.push_back("second TYPE: " + at);
          e.type[m[2]] = m[3];
        } else {
          e.help[m[2]] = m[3];
        }
      }
      continue;  // other comments are allowed
    }
    std::smatch m;
    if (!std::regex_match(line, m, sample_re)) {
      e.errors.push_back("not a sample: " + at);
      continue;
    }
    Sample s;
    s.name = m[1];
    std::string labels = m[3];
    while (!labels.empty()) {
      std::smatch lm;
      if (!std::regex_search(labels, lm, label_re, std::regex_constants::match_continuous)) {
        e.errors.push_back("bad labels: " + at);
        break;
      }
      s.labels[lm[1]] = lm[2];
      labels = lm.suffix();
    }
    const std::string v = m[4];
    try {
      size_t used = 0;
      s.value = v == "NaN" ? std::nan("") : v == "+Inf" ? INFINITY : v == "-Inf" ? -INFINITY : std::stod(v, &used);
      if (v != "NaN" && v != "+Inf" && v != "-Inf" && used != v.size()) throw std::invalid_argument(v);
    } catch (...) {
      e.errors.push_back("bad value: " + at);
    }
    const std::string family = family_of(s.name, e.type);
    if (!e.type.count(family)) e.errors.push_back("sample before its TYPE: " + at);
    if (e.type.count(family) && e.type.at(family) == "counter" && !s.name.ends_with("_total"))
      e.errors.push_back("counter without _total: " + at);
    if (!s.name.starts_with("memfl_")) e.errors.push_back("no memfl_ prefix: " + at);
    e.samples.push_back(std::move(s));
  }
  return e;
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += s + "\n";
  return out;
}

TEST(LiveMetrics, PrometheusTextParsesWithHelpTypeAndHistogram) {
  live::reset_for_test();
  live::enable("test \"role\"\nx");  // a label value that needs escaping
  live::set_planned(5, false);
  live::round_started(2, {0, 1, 2});
  live::client_updated(0, 2, 100, 50);
  live::client_dropped(2, 2);
  live::round_bytes(300, 50);
  RoundMetrics m;
  m.round = 2;
  m.test_accuracy = 0.75;
  m.test_loss = 0.5;
  m.round_seconds = 1.25;
  live::round_row(m);
  live::async_applied(1, 7, 0, 1000);
  live::async_applied(1, 8, 2, 1000);
  live::async_applied(0, 9, 2, 500);
  // Each client's bytes are its own: sync updates and async uploads add up.
  const auto state = nlohmann::json::parse(live::state_json());
  std::map<int, std::pair<uint64_t, uint64_t>> bytes;  // client → (down, up)
  for (const auto& c : state["clients"])
    bytes[c["client"].get<int>()] = {c["bytes_down"].get<uint64_t>(), c["bytes_up"].get<uint64_t>()};
  EXPECT_EQ(bytes[0], std::make_pair(uint64_t{100}, uint64_t{50 + 500}));
  EXPECT_EQ(bytes[1], std::make_pair(uint64_t{0}, uint64_t{2000}));
  EXPECT_EQ(bytes[2], std::make_pair(uint64_t{0}, uint64_t{0}));  // dropped: nothing counted
  const Exposition e = parse_prometheus(live::prometheus_text());
  EXPECT_TRUE(e.errors.empty()) << joined(e.errors);
  for (const auto& [name, type] : e.type) EXPECT_TRUE(e.help.count(name)) << name << " has no HELP";
  EXPECT_EQ(e.samples.front().labels.at("role"), "test \\\"role\\\"\\nx");
  EXPECT_EQ(e.value("memfl_round"), 9);  // the async version is the round of an async run
  EXPECT_EQ(e.value("memfl_rounds_completed_total"), 1);
  EXPECT_EQ(e.value("memfl_test_accuracy"), 0.75);
  EXPECT_EQ(e.value("memfl_last_round_seconds"), 1.25);
  EXPECT_EQ(e.value("memfl_sent_bytes_total"), 300);
  EXPECT_EQ(e.value("memfl_received_bytes_total"), 50);
  EXPECT_EQ(e.value("memfl_clients_dropped_total"), 1);
  EXPECT_GT(e.value("memfl_resident_memory_bytes"), 1 << 20);
  EXPECT_GE(e.value("memfl_resident_memory_peak_bytes"), e.value("memfl_resident_memory_bytes"));
  EXPECT_GT(e.value("memfl_threads"), 0);
  EXPECT_GT(e.value("memfl_open_fds"), 0);
  EXPECT_FALSE(std::isnan(e.value("memfl_ledger_bytes", {{"category", "model"}})));
  // Cumulative buckets: staleness 0 once, 2 twice.
  EXPECT_EQ(e.type.at("memfl_async_staleness"), "histogram");
  EXPECT_EQ(e.value("memfl_async_staleness_bucket", {{"le", "0"}}), 1);
  EXPECT_EQ(e.value("memfl_async_staleness_bucket", {{"le", "2"}}), 3);
  EXPECT_EQ(e.value("memfl_async_staleness_bucket", {{"le", "+Inf"}}), 3);
  EXPECT_EQ(e.value("memfl_async_staleness_sum"), 4);
  EXPECT_EQ(e.value("memfl_async_staleness_count"), 3);
  // The parser itself rejects what is wrong.
  EXPECT_FALSE(parse_prometheus("memfl_x 1\n").errors.empty());  // no TYPE
  EXPECT_FALSE(parse_prometheus("# TYPE memfl_x counter\nmemfl_x 1\n").errors.empty());
  EXPECT_FALSE(parse_prometheus("# TYPE memfl_x gauge\nmemfl_x{a=\"1} 1\n").errors.empty());
  EXPECT_FALSE(parse_prometheus("# TYPE memfl_x gauge\nmemfl_x one\n").errors.empty());
  live::reset_for_test();
}

TEST(LiveMetrics, TimelineAndTablesStayBounded) {
  live::reset_for_test();
  live::enable("bounded");
  for (int i = 0; i < 20000; ++i) live::sample_rss();
  for (int i = 0; i < 3000; ++i) live::phase(i, "train");
  for (int c = 0; c < 6000; ++c) live::client_updated(c, 1, 1, 1);
  const auto j = nlohmann::json::parse(live::state_json());
  EXPECT_LE(j["samples"]["t_ms"].size(), live::kMaxTimelinePoints);
  EXPECT_GE(j["samples"]["t_ms"].size(), live::kMaxTimelinePoints / 4);  // decimated, not emptied
  EXPECT_EQ(j["phases"].size(), live::kMaxPhases);
  EXPECT_EQ(j["clients"].size(), live::kMaxClients);
  EXPECT_EQ(j["clients_not_listed"], 6000 - static_cast<int>(live::kMaxClients));
  live::reset_for_test();
}

// ---- End to end ----

struct Reply {
  int status = 0;  // 0: no HTTP answer (connection refused or closed)
  std::string body;
};

int connect_to(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// One HTTP/1.1 request over a raw socket, so a test can send what a
// well-behaved client library would not (huge headers).
Reply http_get(int port, const std::string& path, const std::string& extra_headers = "") {
  Reply r;
  const int fd = connect_to(port);
  if (fd < 0) return r;
  const std::string req =
      "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra_headers + "\r\n";
  size_t sent = 0;
  while (sent < req.size()) {
    const ssize_t n = send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string raw;
  char buf[65536];
  while (true) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  std::smatch m;
  if (std::regex_search(raw, m, std::regex("^HTTP/1\\.[01] (\\d{3})"))) r.status = std::stoi(m[1]);
  const auto body = raw.find("\r\n\r\n");
  if (body != std::string::npos) r.body = raw.substr(body + 4);
  return r;
}

// A `memfl` command in the background (`prefix` before it: mpirun), its
// endpoint's port read from RUN/`address_file` once it is up.
class BackgroundRun {
 public:
  BackgroundRun(const std::string& args, const std::string& out, const std::string& prefix = "",
                std::string address_file = "http_address")
      : out_(out), address_file_(std::move(address_file)) {
    pid_ = fork();
    if (pid_ == 0) {
      const std::string cmd =
          prefix + std::string(MEMFL_BINARY) + " " + args + " --out " + out + " > " + out + ".log 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~BackgroundRun() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  // The bound port, or 0 when the run ended (or 60 s passed) first.
  int port() {
    for (int i = 0; i < 600; ++i) {
      std::ifstream in(out_ + "/" + address_file_);
      std::string a;
      if (in && std::getline(in, a) && a.find(':') != std::string::npos) return std::stoi(a.substr(a.rfind(':') + 1));
      if (waitpid(pid_, &status_, WNOHANG) == pid_) {
        reaped_ = true;
        return 0;
      }
      std::this_thread::sleep_for(100ms);
    }
    return 0;
  }
  int wait() {
    if (!reaped_) waitpid(pid_, &status_, 0);
    reaped_ = true;
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }
  std::string log() const { return testing::read_file(out_ + ".log"); }

 private:
  std::string out_, address_file_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool reaped_ = false;
};

// Small rounds, many of them: the run lasts long enough to be watched.
std::string live_run_args(int rounds, const std::string& http = "127.0.0.1:0") {
  return "run -q --set server_configs.num_clients=3 --set server_configs.num_global_epochs=" + std::to_string(rounds) +
         " --set client_configs.data_configs.dataset_kwargs.max_train_samples=600"
         " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200"
         " --set client_configs.train_configs.num_threads=1 --http " +
         http;
}

double scraped(int port, const std::string& name, Exposition* out = nullptr) {
  const Reply r = http_get(port, "/metrics");
  if (r.status != 200) return std::nan("");
  Exposition e = parse_prometheus(r.body);
  const double v = e.value(name);
  if (out != nullptr) *out = std::move(e);
  return v;
}

TEST(LiveEndpoint, RunServesMetricsHealthAndRefusesBadRequests) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  // 60 rounds: about 25 s here, long enough that the scrapes below happen
  // while the run goes on a fast machine too (12 rounds took 5 s).
  BackgroundRun bg(live_run_args(60), run);
  const int port = bg.port();
  ASSERT_GT(port, 0) << bg.log();
  EXPECT_NE(bg.log().find("live: http://127.0.0.1:" + std::to_string(port) + "/"), std::string::npos) << bg.log();

  Exposition first;
  const double r1 = scraped(port, "memfl_rounds_completed_total", &first);
  EXPECT_TRUE(first.errors.empty()) << joined(first.errors);
  EXPECT_FALSE(first.samples.empty());
  for (const char* name :
       {"memfl_round", "memfl_rounds_completed_total", "memfl_clients_selected", "memfl_received_bytes_total",
        "memfl_sent_bytes_total", "memfl_last_round_seconds", "memfl_test_accuracy", "memfl_test_loss",
        "memfl_resident_memory_bytes", "memfl_resident_memory_peak_bytes", "memfl_resident_memory_anon_bytes",
        "memfl_resident_memory_file_bytes", "memfl_memory_bound_bytes", "memfl_memory_baseline_bytes", "memfl_threads",
        "memfl_open_fds", "memfl_ledger_bytes"}) {
    EXPECT_TRUE(first.type.count(name)) << name << " missing";
  }
  EXPECT_EQ(http_get(port, "/healthz").status, 200);
  EXPECT_EQ(http_get(port, "/no/such/page").status, 404);
  // A 64 KiB header is refused (or the connection closed), never served.
  const Reply huge = http_get(port, "/metrics", "X-Big: " + std::string(64 * 1024, 'a') + "\r\n");
  EXPECT_NE(huge.status, 200);
  // A crowd of idle connections (more than the endpoint's threads) while
  // the run goes on; a scrape still gets through once they time out or close.
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) {
    const int fd = connect_to(port);
    if (fd >= 0) idle.push_back(fd);
  }
  std::this_thread::sleep_for(300ms);
  for (int fd : idle) close(fd);

  // The round counter moves while the run goes.
  double r2 = r1;
  Exposition later;
  for (int i = 0; i < 600 && !(r2 > r1); ++i) {
    std::this_thread::sleep_for(100ms);
    r2 = scraped(port, "memfl_rounds_completed_total", &later);
  }
  EXPECT_GT(r2, r1) << "rounds_completed stayed at " << r1;
  EXPECT_TRUE(later.errors.empty()) << joined(later.errors);
  EXPECT_GT(later.value("memfl_sent_bytes_total"), 0);
  EXPECT_GT(later.value("memfl_memory_bound_bytes"), 0);
  // The baseline is what the process held before its model: something, and
  // no more than it holds now with the model.
  EXPECT_GT(later.value("memfl_memory_baseline_bytes"), 0);
  EXPECT_LE(later.value("memfl_memory_baseline_bytes"), later.value("memfl_resident_memory_peak_bytes"));
  EXPECT_GE(later.value("memfl_test_accuracy"), 0.0);
  EXPECT_LE(later.value("memfl_test_accuracy"), 1.0);

  // None of this disturbed the run: it finishes every round.
  EXPECT_EQ(bg.wait(), 0) << bg.log();
  const auto rows = read_csv(run + "/metrics.csv");
  EXPECT_EQ(rows.size(), 61u);  // header + 60 rounds
  EXPECT_NE(testing::read_file(run + "/http_address"), "");
}

std::map<int, std::pair<uint64_t, uint64_t>> client_bytes(const std::string& live_state);

// Two DummyTrainer clients of a 4 MB synthetic model, many short rounds.
const std::string kSyntheticTwoClients =
    " --set server_configs.num_clients=2 --set server_configs.num_global_epochs=400"
    " --set client_configs.train_configs.trainer=DummyTrainer --set client_configs.model_configs.model_name=synthetic"
    " --set client_configs.model_configs.model_kwargs.num_params=1000000";

// A launched server (a server process and client processes) counts the
// clients whose session is open; the simulator has none to count.
TEST(LiveEndpoint, LaunchedServerCountsItsConnectedClients) {
  testing::TempDir tmp;
  const std::string run = tmp.file("launch");
  BackgroundRun bg("launch --clients 2" + kSyntheticTwoClients + " --http 127.0.0.1:0", run, "", "server/http_address");
  const int port = bg.port();
  ASSERT_GT(port, 0) << bg.log();
  double connected = std::nan("");
  for (int i = 0; i < 300 && !(connected == 2); ++i) {
    connected = scraped(port, "memfl_clients_connected");
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(connected, 2) << bg.log();
  EXPECT_EQ(bg.wait(), 0) << bg.log();
  // In process there are no client processes: no such gauge.
  BackgroundRun sim(live_run_args(40), tmp.file("sim"));
  const int sim_port = sim.port();
  ASSERT_GT(sim_port, 0) << sim.log();
  Exposition e;
  for (int i = 0; i < 100 && e.samples.empty(); ++i) (void)scraped(sim_port, "memfl_round", &e);
  EXPECT_FALSE(e.samples.empty());
  EXPECT_EQ(e.type.count("memfl_clients_connected"), 0u);
  EXPECT_EQ(sim.wait(), 0) << sim.log();
}

#ifdef MEMFL_TEST_MPI
// Rank 0 of an MPI job serves the endpoint: its round counter moves, and
// it counts the client ranks still in the job.
TEST(LiveEndpoint, MpiRankZeroServesMetricsWithItsRanksConnected) {
  testing::TempDir tmp;
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  const std::string run = tmp.file("mpi");
  BackgroundRun bg("mpi" + kSyntheticTwoClients + " --http 127.0.0.1:0", run, "mpirun -np 3 --oversubscribe ",
                   "rank_0/http_address");
  const int port = bg.port();
  ASSERT_GT(port, 0) << bg.log();
  // The gauge appears with the first round.
  Exposition first;
  for (int i = 0; i < 300 && !(first.value("memfl_clients_connected") == 2); ++i) {
    (void)scraped(port, "memfl_round", &first);
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(first.errors.empty()) << joined(first.errors);
  EXPECT_EQ(first.value("memfl_clients_connected"), 2) << bg.log();
  const double r1 = first.value("memfl_rounds_completed_total");
  double r2 = r1;
  for (int i = 0; i < 300 && !(r2 > r1); ++i) {
    std::this_thread::sleep_for(50ms);
    r2 = scraped(port, "memfl_rounds_completed_total");
  }
  EXPECT_GT(r2, r1) << bg.log();
  EXPECT_EQ(bg.wait(), 0) << bg.log();
  // Rank 0 froze its page; each client's bytes are its own: uncompressed,
  // the 4 MB model down and its 4 MB update up every round.
  const auto bytes = client_bytes(run + "/rank_0/live_state.json");
  const uint64_t rounds = read_csv(run + "/rank_0/metrics.csv").size() - 1;
  ASSERT_EQ(bytes.size(), 2u);
  for (const auto& [client, b] : bytes) {
    EXPECT_EQ(b.first, rounds * 4'000'000) << "client " << client;
    EXPECT_EQ(b.second, rounds * 4'000'000) << "client " << client;
  }
}
#endif

TEST(LiveEndpoint, TokenIsRequiredExceptForHealth) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  BackgroundRun bg(live_run_args(4) + " --http-token s3cret", run);
  const int port = bg.port();
  ASSERT_GT(port, 0) << bg.log();
  EXPECT_EQ(http_get(port, "/metrics").status, 401);
  EXPECT_EQ(http_get(port, "/metrics", "Authorization: Bearer wrong\r\n").status, 401);
  EXPECT_EQ(http_get(port, "/api/state").status, 401);
  const Reply ok = http_get(port, "/metrics", "Authorization: Bearer s3cret\r\n");
  EXPECT_EQ(ok.status, 200);
  EXPECT_NE(ok.body.find("memfl_round"), std::string::npos);
  EXPECT_EQ(http_get(port, "/api/state?token=s3cret").status, 200);
  EXPECT_EQ(http_get(port, "/healthz").status, 200);
  EXPECT_EQ(bg.wait(), 0) << bg.log();
}

TEST(LiveEndpoint, BadAddressIsAnErrorNamingTheFlag) {
  testing::TempDir tmp;
  const Result r = memfl_cli("run -q --http 127.0.0.1:notaport --out " + tmp.file("run"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--http 127.0.0.1:notaport"), std::string::npos) << r.output;
}

// An endpoint in this process, on a free loopback port.
std::unique_ptr<LiveEndpoint> local_endpoint() {
  live::reset_for_test();
  auto ep = LiveEndpoint::start({"127.0.0.1:0", "", "test"});
  EXPECT_TRUE(ep.ok()) << ep.status().message();
  return ep.ok() ? std::move(*ep) : nullptr;
}

// Far more connections than the endpoint has threads, each sending its
// request head a byte a second and never finishing it: /healthz and
// /metrics still answer while they trickle.
TEST(LiveEndpoint, AnswersWhileManyConnectionsTrickleTheirHeaders) {
  auto ep = local_endpoint();
  ASSERT_NE(ep, nullptr);
  const int port = ep->port();
  std::vector<int> tricklers;
  for (int i = 0; i < 200; ++i) {
    if (const int fd = connect_to(port); fd >= 0) tricklers.push_back(fd);
  }
  ASSERT_GT(tricklers.size(), 100u);
  const std::string head = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
  std::atomic<bool> done{false};
  std::thread trickle([&] {
    for (size_t i = 0; !done; ++i) {
      const char c = i < head.size() ? head[i] : 'a';
      for (const int fd : tricklers) (void)send(fd, &c, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      for (int k = 0; k < 10 && !done; ++k) std::this_thread::sleep_for(100ms);
    }
  });
  std::this_thread::sleep_for(2500ms);  // every trickler has begun its head
  // http_get waits up to 10 s for an answer: no answer at all is the failure.
  const Reply health = http_get(port, "/healthz");
  const Reply metrics = http_get(port, "/metrics");
  done = true;
  trickle.join();
  for (const int fd : tricklers) close(fd);
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body, "ok\n");
  EXPECT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.body.find("memfl_up"), std::string::npos);
}

// The head's limit holds for its total, not only for each header line.
TEST(LiveEndpoint, AHeadOfManySmallHeadersIsRefused) {
  auto ep = local_endpoint();
  ASSERT_NE(ep, nullptr);
  std::string many;
  for (int i = 0; i < 100'000; ++i) many += "X-a: b\r\n";
  const Reply r = http_get(ep->port(), "/healthz", many);
  EXPECT_TRUE(r.status == 431 || r.status == 0) << "answered " << r.status;  // 0: the connection was closed
  // As many headers as a browser sends still pass.
  std::string some;
  for (int i = 0; i < 20; ++i) some += "X-" + std::to_string(i) + ": " + std::string(100, 'b') + "\r\n";
  EXPECT_EQ(http_get(ep->port(), "/healthz", some).status, 200);
}

// A Range header of many ranges gets the page once, whole: no answer grows
// with the number of ranges asked for.
TEST(LiveEndpoint, ARangeOfManyRangesIsAnsweredWhole) {
  auto ep = local_endpoint();
  ASSERT_NE(ep, nullptr);
  const Reply whole = http_get(ep->port(), "/");
  ASSERT_EQ(whole.status, 200);
  std::string ranges = "bytes=0-";
  for (int i = 0; i < 99; ++i) ranges += ",0-";
  const Reply r = http_get(ep->port(), "/", "Range: " + ranges + "\r\n");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body.size(), whole.body.size());
}

// Off loopback, the endpoint needs a token, or a flag saying an open
// endpoint is meant; the refusal comes before it listens.
TEST(LiveEndpoint, AnAddressOffLoopbackNeedsATokenOrTheFlagSayingItIsMeant) {
  testing::TempDir tmp;
  unsetenv("MEMFL_HTTP_TOKEN");
  const Result open = memfl_cli(live_run_args(2, "0.0.0.0:0") + " --out " + tmp.file("open"));
  EXPECT_NE(open.exit_code, 0);
  EXPECT_NE(open.output.find("--http 0.0.0.0:0"), std::string::npos) << open.output;
  EXPECT_NE(open.output.find("--http-token"), std::string::npos) << open.output;
  EXPECT_NE(open.output.find("--http-insecure-bind"), std::string::npos) << open.output;
  EXPECT_FALSE(std::filesystem::exists(tmp.file("open") + "/http_address"));
  // Said to be meant: it listens on every address, loopback among them.
  BackgroundRun meant(live_run_args(20, "0.0.0.0:0") + " --http-insecure-bind", tmp.file("meant"));
  const int port = meant.port();
  ASSERT_GT(port, 0) << meant.log();
  EXPECT_EQ(http_get(port, "/healthz").status, 200);
  EXPECT_EQ(http_get(port, "/metrics").status, 200);
  EXPECT_EQ(meant.wait(), 0) << meant.log();
  // A token is enough.
  const Result token = memfl_cli(live_run_args(2, "0.0.0.0:0") + " --http-token s3cret --out " + tmp.file("token"));
  EXPECT_EQ(token.exit_code, 0) << token.output;
}

TEST(LiveEndpoint, AServerWithTlsKeepsItsPlainHttpEndpointOnLoopback) {
  testing::TempDir tmp;
  // The refusal comes before the certificates are read, so placeholders do.
  const std::string g = " --set server_configs.comm_configs.grpc_configs.";
  std::string certs;
  for (const char* key : {"server_cert", "server_key", "root_cert"}) {
    std::ofstream(tmp.file(key)) << "not a PEM file\n";
    certs += g + key + "=" + tmp.file(key);
  }
  const Result r = memfl_cli("server -q --http 0.0.0.0:0 --out " + tmp.file("srv") + g + "use_ssl=true" + certs);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--http 0.0.0.0:0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("use_ssl"), std::string::npos) << r.output;
}

// What headless Chromium shows of the live page at `url`.
std::string rendered(const std::string& url, const std::string& profile_dir) {
  return run_shell(
             "timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
             "--disable-background-networking --disable-component-update --disable-sync --user-data-dir=" +
             profile_dir + " --virtual-time-budget=4000 --dump-dom '" + url + "' 2>/dev/null")
      .output;
}

int count_of(const std::string& status, const std::string& key) {
  std::smatch m;
  if (std::regex_search(status, m, std::regex(key + "=(\\d+)"))) return std::stoi(m[1]);
  return -1;
}

TEST(LiveEndpoint, ChromiumShowsCurvesAndAFilledClientsTable) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  BackgroundRun bg(live_run_args(40), run);
  const int port = bg.port();
  ASSERT_GT(port, 0) << bg.log();
  // Two finished rounds first, so both curves have a line.
  for (int i = 0; i < 600 && !(scraped(port, "memfl_rounds_completed_total") >= 2); ++i)
    std::this_thread::sleep_for(100ms);
  const std::string dom = rendered("http://127.0.0.1:" + std::to_string(port) + "/", tmp.file("chrome"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, std::regex("<div id=\"memfl-status\">([^<]*)</div>")))
      << "no status in " << dom.size() << " bytes of DOM (is Debian's chromium installed?)";
  const std::string status = m[1];
  EXPECT_EQ(status.rfind("ok", 0), 0u) << status;
  EXPECT_GE(count_of(status, "charts"), 3) << status;  // accuracy, loss, RSS timeline
  EXPECT_EQ(count_of(status, "clients"), 3) << status;
  EXPECT_GE(count_of(status, "polls"), 1) << status;
  EXPECT_NE(dom.find("data-curve=\"accuracy\""), std::string::npos);
  EXPECT_NE(dom.find("data-curve=\"loss\""), std::string::npos);
  EXPECT_NE(dom.find("<canvas"), std::string::npos);  // uPlot drew
  // The clients table: a header and a row per client, with its state.
  EXPECT_NE(dom.find("<th class=\"l\">client</th>"), std::string::npos);
  EXPECT_TRUE(std::regex_search(dom, std::regex("<td class=\"l\">2</td><td class=\"l\">(selected|done)</td>")))
      << dom.substr(0, 4000);
  EXPECT_EQ(bg.wait(), 0) << bg.log();
}

// Sums of one column of metrics.csv over its rounds.
uint64_t column_sum(const std::string& csv, const std::string& column) {
  const auto rows = read_csv(csv);
  const auto at = std::find(rows.at(0).begin(), rows.at(0).end(), column) - rows.at(0).begin();
  uint64_t sum = 0;
  for (size_t i = 1; i < rows.size(); ++i) sum += std::stoull(rows[i].at(static_cast<size_t>(at)));
  return sum;
}

// Each client's bytes on the wire, from a frozen live state: (down, up).
std::map<int, std::pair<uint64_t, uint64_t>> client_bytes(const std::string& live_state) {
  std::map<int, std::pair<uint64_t, uint64_t>> out;
  const auto state = nlohmann::json::parse(testing::read_file(live_state));
  for (const auto& c : state["clients"])
    out[c["client"].get<int>()] = {c["bytes_down"].get<uint64_t>(), c["bytes_up"].get<uint64_t>()};
  return out;
}

// A role's frozen clients table (DIR/live_state.json) against its
// metrics.csv: `clients` rows whose bytes add up to the rounds' totals, the
// uploads compressed, and no two clients shown the same upload bytes (a
// round's mean would show them all alike).
void expect_each_clients_own_bytes(const std::string& dir, size_t clients) {
  const auto bytes = client_bytes(dir + "/live_state.json");
  ASSERT_EQ(bytes.size(), clients);
  uint64_t down = 0, up = 0;
  std::set<uint64_t> ups;
  for (const auto& [client, b] : bytes) {
    down += b.first;
    up += b.second;
    ups.insert(b.second);
    EXPECT_GT(b.second, 0u) << "client " << client;
  }
  EXPECT_EQ(down, column_sum(dir + "/metrics.csv", "bytes_down"));
  EXPECT_EQ(up, column_sum(dir + "/metrics.csv", "bytes_up"));
  EXPECT_LT(up, column_sum(dir + "/metrics.csv", "bytes_up_raw"));  // compressed
  EXPECT_EQ(ups.size(), clients) << "clients shown the same bytes up: a mean, not each one's own";
}

// Lossy compression of Fashion-MNIST updates: each client's data differ
// (Dirichlet partitions), so its update codes to its own size.
const std::string kCompressedUpdates =
    " --set client_configs.comm_configs.compressor_configs.enable_compression=true"
    " --set client_configs.comm_configs.compressor_configs.lossy_compressor=SZ2Compressor"
    " --set client_configs.comm_configs.compressor_configs.error_bounding_mode=REL"
    " --set client_configs.comm_configs.compressor_configs.error_bound=0.001";

// The clients table shows each client's own bytes, not the round's mean:
// with compressed updates they differ, and they add up to the round totals
// in metrics.csv. At the end the role leaves its live page frozen
// (live.html, drawn once from live_state.json), and the report shows its
// clients table and links it.
TEST(LiveEndpoint, FrozenPageAndReportShowEachClientsOwnBytes) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  const Result r = memfl_cli(live_run_args(2) + " --out " + run + kCompressedUpdates);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_each_clients_own_bytes(run, 3);

  // The frozen page: the live page's script, drawing the last state once.
  const std::string dom = rendered("file://" + run + "/live.html", tmp.file("chrome"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, std::regex("<div id=\"memfl-status\">([^<]*)</div>"))) << dom.size();
  EXPECT_EQ(m[1].str().rfind("ok", 0), 0u) << m[1];
  EXPECT_GE(count_of(m[1], "charts"), 3) << m[1];  // accuracy, loss, the RSS timeline
  EXPECT_NE(dom.find("finished — round 2 of 2"), std::string::npos) << dom.substr(0, 3000);
  EXPECT_NE(dom.find("as it ended"), std::string::npos);
  EXPECT_NE(dom.find("last seen s before the end"), std::string::npos);
  EXPECT_TRUE(std::regex_search(dom, std::regex("<td class=\"l\">1</td><td class=\"l\">done</td>")))
      << dom.substr(0, 4000);

  // The report carries the clients table and links the frozen page.
  ASSERT_EQ(memfl_cli("report " + run).exit_code, 0);
  const std::string rep = rendered("file://" + run + "/report/index.html", tmp.file("chrome2"));
  EXPECT_NE(rep.find("Clients (process, as the live page ended)"), std::string::npos) << rep.substr(0, 3000);
  EXPECT_NE(rep.find("href=\"../live.html\""), std::string::npos);
}

// A launched server counts each client's own frames (its gRPC session's
// bytes), and they add up to the server's round totals.
TEST(LiveEndpoint, LaunchedServerShowsEachClientsOwnBytes) {
  testing::TempDir tmp;
  const std::string run = tmp.file("launch");
  const Result r = memfl_cli(
      "launch --clients 3 -q --set server_configs.num_clients=3 --set server_configs.num_global_epochs=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=600"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200"
      " --set client_configs.train_configs.num_threads=1 --http 127.0.0.1:0 --out " +
      run + kCompressedUpdates);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_each_clients_own_bytes(run + "/server", 3);
  EXPECT_TRUE(std::filesystem::exists(run + "/server/live.html"));
}

// The report page is the live page's frozen form: the same curves, no
// debug line in view, and it says why a section is empty.
TEST(ReportPage, ShowsCurvesAndSaysWhyAllocationSitesAreEmpty) {
  testing::TempDir tmp;
  const std::string run = tmp.file("run");
  const Result r = memfl_cli(
      "run -q --set server_configs.num_clients=2 --set server_configs.num_global_epochs=2"
      " --set client_configs.data_configs.dataset_kwargs.max_train_samples=1000"
      " --set client_configs.data_configs.dataset_kwargs.max_test_samples=200"
      " --set client_configs.train_configs.num_threads=1 --out " +
      run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(memfl_cli("report " + run).exit_code, 0);
  const std::string dom = rendered("file://" + run + "/report/index.html", tmp.file("chrome"));
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dom, m, std::regex("<div id=\"memfl-status\">([^<]*)</div>"))) << dom.size();
  EXPECT_EQ(m[1].str().rfind("ok", 0), 0u) << m[1];
  EXPECT_GE(count_of(m[1], "charts"), 3) << m[1];  // accuracy, loss, the RSS timeline
  EXPECT_NE(dom.find("data-curve=\"accuracy\""), std::string::npos);
  EXPECT_NE(dom.find("data-curve=\"loss\""), std::string::npos);
  EXPECT_NE(dom.find("No allocation sites: the run was not profiled"), std::string::npos);
  EXPECT_NE(dom.find("Gradients and optimizer state are libtorch"), std::string::npos);
  // The render status is for tests, hidden from readers.
  EXPECT_NE(testing::read_file(run + "/report/index.html").find("#memfl-status { display: none; }"), std::string::npos);
  // The ledger accounts for the gradients and the optimizer's momentum: held
  // from a round's first step on, they have a peak. What it held at the RSS
  // peak is a snapshot of the same ledger, so never above that peak; it may
  // be 0 (a peak inside a train phase but before its first step: a round's
  // client starts with neither), so it is not required to be positive.
  const auto mem = nlohmann::json::parse(testing::read_file(run + "/memory.json"));
  for (const char* category : {"gradients", "optimizer"}) {
    const auto& c = mem["ledger"][category];
    EXPECT_GT(c["peak_bytes"].get<int64_t>(), 0) << category;
    EXPECT_GE(c["at_rss_peak_bytes"].get<int64_t>(), 0) << category;
    EXPECT_LE(c["at_rss_peak_bytes"].get<int64_t>(), c["peak_bytes"].get<int64_t>()) << category;
  }
}

}  // namespace
}  // namespace memfl
