#include "server/round_driver.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>
#include <optional>

#include <spdlog/spdlog.h>

#include "comm/update_check.h"
#include "compress/decoding_opener.h"
#include "dp/rdp_accountant.h"
#include "live/live_metrics.h"
#include "memory/budget.h"
#include "secagg/secagg_round.h"
#include "server/server_state.h"

namespace memfl {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The one update the aggregator sees in a securely aggregated round.
constexpr const char* kSecureAggregateId = "secure_aggregate";

nlohmann::json round_metrics_to_json(const RoundMetrics& m) {
  return {m.round,      m.clients,         m.train_loss,  m.train_accuracy, m.val_loss,         m.val_accuracy,
          m.test_loss,  m.test_accuracy,   m.bytes_moved, m.round_seconds,  m.download_seconds, m.upload_seconds,
          m.bytes_down, m.bytes_up,        m.rss_bytes,   m.peak_rss_bytes, m.commit_seconds,   m.threads,
          m.open_fds,   m.virtual_seconds, m.bytes_up_raw};
}

RoundMetrics round_metrics_from_json(const nlohmann::json& j) {
  RoundMetrics m;
  m.round = j[0];
  m.clients = j[1];
  m.train_loss = j[2];
  m.train_accuracy = j[3];
  m.val_loss = j[4];
  m.val_accuracy = j[5];
  m.test_loss = j[6];
  m.test_accuracy = j[7];
  m.bytes_moved = j[8];
  m.round_seconds = j[9];
  m.download_seconds = j[10];
  m.upload_seconds = j[11];
  m.bytes_down = j[12];
  m.bytes_up = j[13];
  m.rss_bytes = j[14];
  m.peak_rss_bytes = j[15];
  if (j.size() > 16) m.commit_seconds = j[16];
  if (j.size() > 18) {
    m.threads = j[17];
    m.open_fds = j[18];
  }
  if (j.size() > 19) m.virtual_seconds = j[19];
  m.bytes_up_raw = j.size() > 20 ? j[20].get<uint64_t>() : m.bytes_up;
  return m;
}

RoundDriver::RoundDriver(const ExperimentConfig& cfg, GlobalModel& global, ServerTransport& transport,
                         Scheduler& scheduler, MemorySampler& sampler, RoundDriverOptions opts)
    : cfg_(cfg),
      global_(global),
      transport_(transport),
      scheduler_(scheduler),
      sampler_(sampler),
      opts_(std::move(opts)),
      compression_(compression_settings(cfg)) {
  if (compression_.enabled)
    spdlog::info("{}: client updates arrive compressed: {}", opts_.role, describe_compression(compression_));
  if (cfg_.secagg.enable) secagg_experiment_ = secagg_experiment_id(experiment_identity(cfg_));
}

Status RoundDriver::resume() {
  MEMFL_ASSIGN_OR_RETURN(CommittedState st, load_committed_state(opts_.run_dir, global_.layout(), global_.arena(),
                                                                 experiment_identity(cfg_)));
  MEMFL_RETURN_IF_ERROR(scheduler_.load(st.scheduler));
  if (opts_.load_extra) MEMFL_RETURN_IF_ERROR(opts_.load_extra(st.extra));
  dp_fedavg_epsilon_ = st.extra.value("dp_fedavg_epsilon", 0.0);
  for (int c : st.extra.value("dropped", std::vector<int>{})) dropped_.push_back(c);
  for (const auto& row : st.extra.value("metrics", nlohmann::json::array()))
    rounds_.push_back(round_metrics_from_json(row));
  if (!st.aggregator.empty()) {
    MEMFL_RETURN_IF_ERROR(
        global_.aggregator().load_state((fs::path(opts_.run_dir) / "state").string(), st.aggregator.dump()));
  } else if (cfg_.server.aggregator != "FedAvgAggregator") {
    return failed_precondition(
        "--resume {}: the committed state has no {} state (was the run started with another "
        "server_configs.aggregator?)",
        opts_.run_dir, cfg_.server.aggregator);
  }
  // The undo checkpoint is the committed model again.
  MEMFL_RETURN_IF_ERROR(global_.write_checkpoint(st.round));
  first_round_ = st.round + 1;
  return Status::Ok();
}

Status RoundDriver::check_disk() const {
  const auto& sc = cfg_.server;
  MEMFL_ASSIGN_OR_RETURN(const uint64_t free_bytes, free_disk_bytes(opts_.run_dir));
  return check_checkpoint_disk(opts_.run_dir, CheckpointPolicy::from(sc), global_.layout().total_bytes(),
                               checkpoint_bytes_on_disk(opts_.run_dir), free_bytes, sc.num_global_epochs,
                               global_.aggregator().saved_state_bytes());
}

Status RoundDriver::start_commit(int round) {
  sampler_.mark(round, "commit");
  // Refused with the numbers before a byte is written, not by a write that
  // fails half way; the commits already on disk stay resumable.
  MEMFL_RETURN_IF_ERROR(check_disk());
  CommittedState st;
  st.round = round;
  st.experiment = experiment_identity(cfg_);
  st.scheduler = scheduler_.save();
  nlohmann::json extra = opts_.save_extra ? opts_.save_extra() : nlohmann::json::object();
  extra["dp_fedavg_epsilon"] = dp_fedavg_epsilon_;
  extra["dropped"] = dropped_;
  extra["metrics"] = nlohmann::json::array();
  for (const auto& m : rounds_) extra["metrics"].push_back(round_metrics_to_json(m));
  st.extra = std::move(extra);
  pending_commit_.emplace();
  pending_commit_->round = round;
  pending_commit_->started = Clock::now();
  pending_commit_->done =
      std::async(std::launch::async, [this, round, st = std::move(st)]() mutable { return write_commit(round, std::move(st)); });
  return Status::Ok();
}

Status RoundDriver::write_commit(int round, CommittedState st) {
  const CheckpointPolicy policy = CheckpointPolicy::from(cfg_.server);
  // Written after every round, committed or not: the checkpoint file is the
  // next round's undo (GlobalModel::restore reloads it when a round's
  // aggregate cannot be trusted, the in-place modes having overwritten the
  // global arena). The policy thins out the commits kept under state/, not
  // this file.
  MEMFL_RETURN_IF_ERROR(global_.write_checkpoint(round));
  if (!policy.commits(round, cfg_.server.num_global_epochs)) return Status::Ok();
  // The aggregator's state between rounds (a server optimizer's moments),
  // written under state/ before the commit that names it.
  std::string record;
  MEMFL_RETURN_IF_ERROR(global_.aggregator().save_state((fs::path(opts_.run_dir) / "state").string(), round, &record));
  st.aggregator = record.empty() ? nlohmann::json::object() : nlohmann::json::parse(record);
  return commit_state(opts_.run_dir, global_.checkpoint_path(), global_.layout(), global_.arena(), std::move(st),
                      policy.keep);
}

Status RoundDriver::settle_commit() {
  if (!pending_commit_) return Status::Ok();
  PendingCommit pending = std::move(*pending_commit_);
  pending_commit_.reset();
  Status st = pending.done.get();
  if (!st.ok()) return st.with_context(fmt::format("round {}, commit", pending.round));
  auto it =
      std::find_if(rounds_.begin(), rounds_.end(), [&](const RoundMetrics& m) { return m.round == pending.round; });
  if (it == rounds_.end()) return internal_error("round {}: committed but never played", pending.round);
  it->commit_seconds = std::chrono::duration<double>(Clock::now() - pending.started).count();
  // A round still being evaluated is published when its result is in.
  if (pending_evaluation_ != pending.round) MEMFL_RETURN_IF_ERROR(publish(*it));
  return Status::Ok();
}

// A crash point of the fault tests, after the commit in flight is durable:
// which commit --resume finds then does not depend on the disk's speed.
void RoundDriver::crash_after_commit(int round, const char* point) {
  if (crash_point_armed(round, point)) (void)settle_commit();
  crash_point(round, point);
}

Status RoundDriver::play_round(int round, RoundMetrics* m, bool* redo) {
  *redo = false;
  const auto t_round = Clock::now();
  for (int c : transport_.take_rejoined()) std::erase(dropped_, c);
  std::vector<int> selected;
  for (int c : scheduler_.select(round)) {
    if (std::find(dropped_.begin(), dropped_.end(), c) == dropped_.end()) selected.push_back(c);
  }
  if (selected.empty()) return failed_precondition("round {}: every selected client has failed", round);
  m->round = round;
  live::round_started(round, selected);
  live::clients_connected(transport_.connected_clients());

  sampler_.mark(round, "broadcast");
  crash_after_commit(round, "broadcast");
  BroadcastResult down;
  MEMFL_RETURN_IF_ERROR(transport_.broadcast(round, selected, global_.arena(), &down));

  // Secure aggregation: keys are exchanged before any masked chunk moves,
  // the masked streams are summed by the SecAggRound, and the aggregator
  // sees one update, the unmasked mean.
  std::unique_ptr<SecAggRound> secure;
  std::vector<int> key_failed;
  // The previous round's commit reads the global model: it is durable
  // before the upload writes over it (a fold in place, a masked sum in the
  // model's memory). Otherwise the uploads fold elsewhere and it has until
  // the aggregate (in process: the whole of the clients' training).
  if (global_.folds_over_model() || cfg_.secagg.enable) MEMFL_RETURN_IF_ERROR(settle_commit());
  if (cfg_.secagg.enable) {
    if (opts_.secure_aggregation == nullptr) {
      return failed_precondition(
          "server_configs.secure_aggregation.enable: the {} transport does not carry secure aggregation's key "
          "exchange",
          transport_.name());
    }
    const SecAggConfig& a = cfg_.secagg;
    const SecAggParams params = secagg_params(a);
    // Once the model has left (the transport is done with it before the
    // upload) and the aggregator will write its one update over it, the
    // masked sum lives in the model's own memory: no second model.
    // Otherwise (in process, where clients read the global model while
    // others upload) it lives in the aggregator's own sum, which the mean
    // then writes over in the same way.
    std::span<uint32_t> in_model;
    const size_t words = global_.layout().total_bytes() / 4;
    if (transport_.broadcast_done_before_collect() && global_.folds_over_model()) {
      in_model = std::span(reinterpret_cast<uint32_t*>(global_.arena().data()), words);
    } else if (std::span<std::byte> idle = global_.aggregator().idle_state_bytes(); idle.size() >= words * 4) {
      in_model = std::span(reinterpret_cast<uint32_t*>(idle.data()), words);
    }
    MEMFL_ASSIGN_OR_RETURN(secure,
                           SecAggRound::start(round, selected, params, secagg_experiment_, global_.layout(), in_model));
    spdlog::info("round {}: secure aggregation over {} clients: k = {} shares each, t = {} reconstruct", round,
                 selected.size(), secure->settings().neighbours, secure->settings().threshold);
    sampler_.mark(round, "secagg_keys");
    MEMFL_RETURN_IF_ERROR(secure->exchange_keys(*opts_.secure_aggregation, &key_failed));
  }
  // A client whose secure-aggregation messages were refused is out for the
  // rest of the run, whether or not the round could go on without it.
  const auto drop_culprits = [&] {
    if (!secure) return;
    for (int c : secure->culprits()) {
      if (std::find(dropped_.begin(), dropped_.end(), c) != dropped_.end()) continue;
      spdlog::warn("round {}: {} is out of the run: its secure-aggregation messages were refused", round, client_id(c));
      live::client_dropped(c, round);
      dropped_.push_back(c);
    }
  };
  // Updates fold in client order whatever order they arrive in (parked
  // until their turn), so every transport gives the same model bit for bit.
  std::vector<std::string> fold_order;
  if (secure) {
    fold_order.push_back(kSecureAggregateId);
  } else {
    for (int c : selected) fold_order.push_back(client_id(c));
  }
  MEMFL_RETURN_IF_ERROR(global_.begin_round(round, std::move(fold_order)));
  sampler_.mark(round, "upload");
  crash_after_commit(round, "upload");
  CollectResult up;
  // Every update's sample count and values are checked before they count.
  CheckedUpdateOpener checked(global_.aggregator(), global_.layout(), round, UpdateLimits{cfg_.server.max_num_samples});
  // Compressed updates are decoded first, frame by frame, so the checks and
  // the fold see the model's chunks; lossy deltas are rebuilt against the
  // round's global model.
  std::unique_ptr<BaseModel> base;
  std::optional<DecodingUpdateOpener> decoded;
  if (compression_.enabled) {
    if (compression_.lossy != Lossy::kNone) {
      MEMFL_ASSIGN_OR_RETURN(base, global_.round_base());
    }
    decoded.emplace(checked, global_.layout(), base.get());
  }
  UpdateOpener& opener = secure    ? static_cast<UpdateOpener&>(*secure)
                         : decoded ? static_cast<UpdateOpener&>(*decoded)
                                   : checked;
  Status collected = transport_.collect(round, selected, global_.arena(), opener, &up);
  MEMFL_RETURN_IF_ERROR(settle_commit());
  MEMFL_RETURN_IF_ERROR(collected);
  int contributors = 0;
  if (secure) {
    sampler_.mark(round, "secagg_unmask");
    // The unmasked mean through the same value checks as any update.
    auto n = secure->unmask_into(*opts_.secure_aggregation, checked, kSecureAggregateId);
    opts_.secure_aggregation->end_round(round);
    drop_culprits();
    if (!n.ok()) {
      if (n.status().code() != StatusCode::kAborted) return n.status();
      // Nothing was folded: the pre-round model stays; the clients that
      // failed are out, the round is played again with the others.
      (void)global_.finish_round(round);
      for (int c : up.failed) {
        if (std::find(dropped_.begin(), dropped_.end(), c) == dropped_.end()) dropped_.push_back(c);
      }
      spdlog::warn("{} — redoing the round with the clients still in", n.status().message());
      *redo = true;
      return Status::Ok();
    }
    contributors = static_cast<int>(*n);
    spdlog::info("round {}: secure aggregation unmasked the mean of {} clients ({} dropped)", round, *n,
                 selected.size() - *n);
  }
  // The previous round's evaluation has had this round's training to run in.
  MEMFL_RETURN_IF_ERROR(finish_evaluation());
  for (int c : up.failed) {
    live::client_dropped(c, round);
    if (!secure) (void)global_.aggregator().withdraw(client_id(c));
    if (std::find(dropped_.begin(), dropped_.end(), c) == dropped_.end()) dropped_.push_back(c);
  }

  sampler_.mark(round, "aggregate");
  crash_point(round, "aggregate");
  Status fin = global_.finish_round(round, contributors);
  if (!fin.ok()) {
    if (up.committed.empty() && fin.code() != StatusCode::kAborted) return fin.with_context(opts_.role);
    spdlog::warn("round {}: {} — the pre-round model is back; redoing the round with the clients still in", round,
                 fin.message());
    *redo = true;
    return Status::Ok();
  }
  const auto& sc = cfg_.server;
  if (sc.dp_fedavg_clip_norm > 0) {
    const bool all = sc.clients_per_round <= 0 || sc.clients_per_round >= sc.num_clients;
    const double q = all ? 1.0 : static_cast<double>(sc.clients_per_round) / sc.num_clients;
    auto eps = rdp_epsilon(sc.dp_fedavg_noise_multiplier, q, round, sc.dp_fedavg_delta);
    dp_fedavg_epsilon_ = eps.ok() ? *eps : std::numeric_limits<double>::infinity();
    spdlog::info("round {}: client-level DP-FedAvg ε = {:.3f} (δ = {}, σ = {}, q = {:.4f})", round, dp_fedavg_epsilon_,
                 sc.dp_fedavg_delta, sc.dp_fedavg_noise_multiplier, q);
  }
  if (broadcast_delta_ && round < sc.num_global_epochs) {
    // The next broadcast, coded now: the model is replaced by what every
    // client will rebuild, before it is evaluated and committed.
    sampler_.mark(round, "encode_broadcast");
    MEMFL_RETURN_IF_ERROR(broadcast_delta_->prepare(round + 1, global_.arena()));
  }

  // Metrics: sample-weighted means of what clients reported, in client order.
  std::sort(up.committed.begin(), up.committed.end(),
            [](const ClientUpdateInfo& a, const ClientUpdateInfo& b) { return a.client < b.client; });
  double wsum = 0, vsum = 0;
  for (const auto& u : up.committed) {
    scheduler_.record(round, u.client, u.train_loss, u.dp_steps, u.dp_sample_rate);
    m->clients++;
    wsum += u.sample_count;
    m->train_loss += u.sample_count * u.train_loss;
    m->train_accuracy += u.sample_count * u.train_accuracy;
    if (u.has_validation) {
      vsum += u.val_weight;
      m->val_loss += u.val_weight * u.val_loss;
      m->val_accuracy += u.val_weight * u.val_accuracy;
    }
  }
  if (wsum > 0) {
    m->train_loss /= wsum;
    m->train_accuracy /= wsum;
  }
  if (vsum > 0) {
    m->val_loss /= vsum;
    m->val_accuracy /= vsum;
  }
  m->bytes_down = down.bytes + up.bytes_down;
  m->bytes_up = up.bytes_up;
  m->bytes_up_raw = static_cast<uint64_t>(up.committed.size()) * global_.layout().total_bytes();
  m->bytes_moved = m->bytes_down + m->bytes_up;
  if (live::enabled()) {
    live::round_bytes(m->bytes_down, m->bytes_up);
    for (const auto& u : up.committed) live::client_updated(u.client, round, u.bytes_down, u.bytes_up);
  }
  m->download_seconds = down.seconds + up.download_seconds;
  m->upload_seconds = up.upload_seconds;

  if (opts_.evaluate) {
    sampler_.mark(round, "evaluate");
    auto ev = opts_.evaluate(round, global_.arena());
    if (!ev.ok()) return ev.status().with_context(fmt::format("round {}, server evaluation", round));
    m->test_loss = ev->loss;
    m->test_accuracy = ev->accuracy;
  } else if (opts_.begin_evaluation) {
    sampler_.mark(round, "evaluate");
    MEMFL_RETURN_IF_ERROR(
        opts_.begin_evaluation(round, global_.arena()).with_context(fmt::format("round {}, server evaluation", round)));
    pending_evaluation_ = round;
  }
  m->round_seconds = std::chrono::duration<double>(Clock::now() - t_round).count();
  if (opts_.round_virtual_seconds) {
    const double before = rounds_.empty() ? 0.0 : rounds_.back().virtual_seconds;
    m->virtual_seconds = before + opts_.round_virtual_seconds(round);
  }
  record_process_metrics(sampler_, m);
  return Status::Ok();
}

Status check_server_memory_bound(const ExperimentConfig& cfg_, GlobalModel& global_, uint64_t transport_bytes) {
  // The server's stated bound: the global model (anonymous unless
  // file-backed) + what the aggregator keeps between rounds + what it may
  // hold during one. Refused before any round, naming the key.
  MEMFL_ASSIGN_OR_RETURN(const int64_t budget,
                         parse_memory_budget(cfg_.server.memory_budget, total_ram_bytes(/*log_source=*/true)));
  const Aggregator& agg = global_.aggregator();
  const size_t model = global_.arena().file_backed() ? 0 : global_.layout().total_bytes();
  const size_t need = model + agg.state_bytes() + agg.working_bytes() + transport_bytes;
  live::set_memory_bound(static_cast<int64_t>(need), budget);
  if (static_cast<int64_t>(need) > budget) {
    return resource_exhausted(
        "server_configs.memory_budget ({}): the global model ({}) and {}'s state ({} between rounds, {} more during "
        "one){} need {}; raise the budget, or set memory_configs.arena_backing: file",
        format_bytes(static_cast<double>(budget)), format_bytes(static_cast<double>(model)), cfg_.server.aggregator,
        format_bytes(static_cast<double>(agg.state_bytes())), format_bytes(static_cast<double>(agg.working_bytes())),
        transport_bytes > 0 ? fmt::format(" with the transport's chunk buffers and sessions ({})",
                                          format_bytes(static_cast<double>(transport_bytes)))
                            : std::string(),
        format_bytes(static_cast<double>(need)));
  }
  return Status::Ok();
}

Status RoundDriver::publish(const RoundMetrics& m) {
  MEMFL_RETURN_IF_ERROR(metrics_->append(m));
  if (opts_.on_round) opts_.on_round(m);
  return Status::Ok();
}

Status RoundDriver::finish_evaluation() {
  if (pending_evaluation_ == 0) return Status::Ok();
  const int round = pending_evaluation_;
  pending_evaluation_ = 0;
  auto ev = opts_.end_evaluation(round);
  if (!ev.ok()) return ev.status().with_context(fmt::format("round {}, server evaluation", round));
  auto it = std::find_if(rounds_.begin(), rounds_.end(), [&](const RoundMetrics& m) { return m.round == round; });
  if (it == rounds_.end()) return internal_error("round {}: evaluated but never committed", round);
  it->test_loss = ev->loss;
  it->test_accuracy = ev->accuracy;
  return publish(*it);
}

Status RoundDriver::run() {
  if (cfg_.secagg.enable && opts_.secure_aggregation == nullptr) {
    // Refused before any client waits on a round.
    return failed_precondition(
        "server_configs.secure_aggregation.enable: the {} transport does not carry secure aggregation's key "
        "exchange",
        transport_.name());
  }
  MEMFL_RETURN_IF_ERROR(check_server_memory_bound(cfg_, global_, transport_.transfer_buffer_bytes()));
  // The checkpoint policy's disk, before any client waits on a round.
  MEMFL_RETURN_IF_ERROR(check_disk());
  if (opts_.resume) MEMFL_RETURN_IF_ERROR(resume());
  if (compression_.lossy_broadcast) {
    // The first broadcast goes as its bytes and is what the next one's
    // change is taken from (compress/broadcast_delta.h).
    const std::string dir = cfg_.memory.scratch_dir.empty() ? opts_.run_dir : cfg_.memory.scratch_dir;
    broadcast_delta_ = std::make_unique<BroadcastDelta>(
        global_.layout(), compression_, dir,
        grpc_chunk_bytes(cfg_.server.use_model_chunking, cfg_.server.model_chunk_size, global_.layout().total_bytes()));
    MEMFL_RETURN_IF_ERROR(broadcast_delta_->prepare(first_round_, global_.arena()));
    transport_.set_broadcast_frames(broadcast_delta_.get());
  }
  MEMFL_ASSIGN_OR_RETURN(metrics_, MetricsWriter::open((fs::path(opts_.run_dir) / "metrics.csv").string()));
  for (const auto& m : rounds_) MEMFL_RETURN_IF_ERROR(metrics_->append(m));  // the committed rounds, again
  const int last = cfg_.server.num_global_epochs;
  live::set_planned(last, /*asynchronous=*/false);
  int retries = 0;  // of the round now played
  for (int round = first_round_; round <= last;) {
    RoundMetrics m;
    bool redo = false;
    if (Status played = play_round(round, &m, &redo); !played.ok()) {
      (void)settle_commit();  // the round before this one keeps its commit and its row
      return played;
    }
    if (redo) {
      // Each redo leaves out the clients that made it necessary when it can
      // tell them; the cap is for when it cannot.
      if (++retries > cfg_.server.max_round_retries) {
        return aborted(
            "round {}: could not complete after {} retries (server_configs.max_round_retries); the log says why each "
            "try failed",
            round, cfg_.server.max_round_retries);
      }
      continue;
    }
    retries = 0;
    // Committed first (with this round's metrics), then the metrics row: a
    // kill in between loses nothing, --resume rewrites metrics.csv from the
    // commit. A round the checkpoint policy does not commit is replayed by
    // --resume from the newest commit (same selection, same model).
    rounds_.push_back(m);
    MEMFL_RETURN_IF_ERROR(start_commit(round));
    if (opts_.between_rounds) opts_.between_rounds(round);
    ++round;
  }
  MEMFL_RETURN_IF_ERROR(settle_commit());
  MEMFL_RETURN_IF_ERROR(finish_evaluation());
  sampler_.mark(last, "done");
  live::loop_finished();
  transport_.finish(last);
  return Status::Ok();
}

}  // namespace memfl

namespace memfl {

nlohmann::json secure_aggregation_summary(const ExperimentConfig& cfg) {
  const SecAggConfig& a = cfg.secagg;
  if (!a.enable) return nullptr;
  const auto& sc = cfg.server;
  const int per_round = sc.clients_per_round > 0 ? std::min(sc.clients_per_round, sc.num_clients) : sc.num_clients;
  const SecAggParams params = secagg_params(a);
  nlohmann::json j = {{"clients_per_round", per_round},
                      {"num_shares", a.num_shares},
                      {"reconstruction_threshold", a.reconstruction_threshold}};
  auto s = SecAggSettings::resolve(params, static_cast<size_t>(std::max(per_round, 0)));
  if (s.ok()) {
    j["k"] = s->neighbours;
    j["t"] = s->threshold;
  }
  return j;
}

}  // namespace memfl
