#include "schedule/scheduler.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace memfl {

std::vector<int> select_clients(int num_clients, int clients_per_round, uint64_t seed, int round) {
  std::vector<int> all(static_cast<size_t>(num_clients));
  std::iota(all.begin(), all.end(), 0);
  if (clients_per_round <= 0 || clients_per_round >= num_clients) return all;
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(round));
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(clients_per_round));
  std::sort(all.begin(), all.end());
  return all;
}

namespace {

class SyncScheduler final : public Scheduler {
 public:
  SyncScheduler(const SchedulerOptions& opts, std::unique_ptr<ClientSelection> method)
      : opts_(opts),
        method_(std::move(method)),
        stats_(static_cast<size_t>(opts.num_clients)),
        rng_(opts.seed * 7919 + 17) {
    for (size_t c = 0; c < stats_.size() && c < opts.client_samples.size(); ++c)
      stats_[c].samples = opts.client_samples[c];
  }
  std::string_view name() const override { return "SyncScheduler"; }

  std::vector<int> select(int round) override {
    const bool all = opts_.clients_per_round <= 0 || opts_.clients_per_round >= opts_.num_clients;
    if (all || opts_.client_selection == "random") {
      return select_clients(opts_.num_clients, opts_.clients_per_round, opts_.seed, round);
    }
    return method_->select(round, opts_.clients_per_round, stats_, rng_);
  }

  void record(int round, int client, double train_loss, int64_t dp_steps, double dp_sample_rate) override {
    auto& cs = stats_[static_cast<size_t>(client)];
    cs.last_loss = train_loss;
    cs.times_picked++;
    cs.last_round = round;
    cs.dp_steps += dp_steps;
    if (dp_steps > 0) cs.dp_sample_rate = dp_sample_rate;
  }
  const std::vector<ClientStats>& stats() const override { return stats_; }

  nlohmann::json save() const override {
    std::ostringstream rng;
    rng << rng_;
    nlohmann::json clients = nlohmann::json::array();
    for (const auto& c : stats_) {
      clients.push_back({c.samples, c.last_loss, c.times_picked, c.last_round, c.dp_steps, c.dp_sample_rate});
    }
    return {{"name", name()}, {"rng", rng.str()}, {"clients", clients}};
  }

  Status load(const nlohmann::json& j) override {
    if (j.value("name", std::string()) != name()) {
      return failed_precondition("--resume: the committed state is of scheduler '{}', the config says '{}'",
                                 j.value("name", std::string("?")), name());
    }
    const auto& clients = j.at("clients");
    if (clients.size() != stats_.size()) {
      return failed_precondition("--resume: the committed state has {} clients, the config {}", clients.size(),
                                 stats_.size());
    }
    for (size_t c = 0; c < stats_.size(); ++c) {
      const auto& r = clients[c];
      stats_[c] = ClientStats{r[0].get<double>(), r[1].get<double>(),  r[2].get<int>(),
                              r[3].get<int>(),    r[4].get<int64_t>(), r[5].get<double>()};
    }
    std::istringstream rng(j.at("rng").get<std::string>());
    rng >> rng_;
    return Status::Ok();
  }

 private:
  SchedulerOptions opts_;
  std::unique_ptr<ClientSelection> method_;
  std::vector<ClientStats> stats_;
  std::mt19937_64 rng_;
};

}  // namespace

const std::vector<std::string>& scheduler_names() {
  static const std::vector<std::string> names = {"SyncScheduler", "AsyncScheduler", "CompassScheduler"};
  return names;
}

StatusOr<std::unique_ptr<Scheduler>> make_scheduler(const std::string& name, const SchedulerOptions& opts) {
  if (name == "AsyncScheduler" || name == "CompassScheduler") {
    return invalid_argument(
        "server_configs.scheduler: {} is asynchronous: it has no rounds to select for (server/async_core.h drives it)",
        name);
  }
  if (name != "SyncScheduler") {
    return invalid_argument("server_configs.scheduler: unknown scheduler '{}'; known: {}", name,
                            fmt::join(scheduler_names(), ", "));
  }
  MEMFL_ASSIGN_OR_RETURN(auto method, make_client_selection(opts.client_selection, opts.selection));
  return std::unique_ptr<Scheduler>(std::make_unique<SyncScheduler>(opts, std::move(method)));
}

}  // namespace memfl
