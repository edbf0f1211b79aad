// Asynchronous FL over gRPC (server_agent.h says which file holds what):
// the same sessions; a client gets the model as it is when it asks (and,
// from FedCompass, its local steps), its update goes to a spool slot,
// checked chunk by chunk, and the rules (an AsyncUpdateHandler) apply it
// once whole, with the senders kept off the model meanwhile.
#include "comm/grpc/server_agent.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "comm/update_check.h"
#include "comm/update_report.h"

namespace memfl::grpc_detail {

void ServerAgent::follow_locked(const AsyncNext& next) {
  for (const auto& d : next.send) async_->ready_steps[static_cast<size_t>(d.client)] = d.local_steps;
  for (const auto& dl : next.deadlines) async_->deadlines.push_back(dl);
  cv_.notify_all();
}

grpc::Status ServerAgent::async_send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int id, uint64_t session,
                                           const std::string& peer, DataSocket* data, bool* finished) {
  Async& a = *async_;
  int steps = 0;
  {
    std::unique_lock lock(mu_);
    auto& s = slots_[static_cast<size_t>(id)];
    // A FedCompass client whose group has not aggregated yet waits here.
    cv_.wait(lock, [&] {
      return phase_ == Phase::kFinished || a.done || s.failed || s.session != session ||
             (a.core != nullptr && a.ready_steps[static_cast<size_t>(id)] >= 0);
    });
    if (s.failed || s.session != session) return {grpc::StatusCode::ABORTED, peer + " was dropped from the run"};
    if (phase_ == Phase::kFinished || a.done) {
      *finished = true;
      return grpc::Status::OK;
    }
    steps = std::exchange(a.ready_steps[static_cast<size_t>(id)], -1);
  }
  // The model cannot change while it is sent: its version is the trip's base.
  std::shared_lock model_lock(a.model_mu);
  int64_t version = 0;
  {
    std::lock_guard lock(mu_);
    if (slots_[static_cast<size_t>(id)].session != session) return {grpc::StatusCode::ABORTED, peer + " was replaced"};
    version = a.core->version();
    a.base_version[static_cast<size_t>(id)] = version;
    a.dispatched_at[static_cast<size_t>(id)] = a.now();
    a.sending_since[static_cast<size_t>(id)] = Clock::now();
    a.send_progress[static_cast<size_t>(id)].store(Clock::now().time_since_epoch().count());
    global_ = a.global;
  }
  grpc::Status sent =
      send_model(stream, static_cast<int>(version), peer, data, steps, &a.send_progress[static_cast<size_t>(id)]);
  std::lock_guard lock(mu_);
  if (slots_[static_cast<size_t>(id)].session == session)
    a.sending_since[static_cast<size_t>(id)] = Clock::time_point::max();
  return sent;
}

// Applying an update (or a FedCompass group) needs the model alone: it
// waits for the senders, and says so to the watchdog while it waits.
std::unique_lock<std::shared_mutex> ServerAgent::lock_to_apply(Async& a) {
  a.appliers_waiting.fetch_add(1);
  std::unique_lock lock(a.model_mu);
  a.appliers_waiting.fetch_sub(1);
  return lock;
}

void ServerAgent::cancel_stalled_senders_locked() {
  Async& a = *async_;
  const auto limit = std::chrono::seconds(cfg_.server.broadcast_deadline_s());
  const auto stall = std::chrono::seconds(cfg_.server.connect_timeout_s);
  const bool someone_waits = a.appliers_waiting.load() > 0;
  const auto now = Clock::now();
  for (size_t id = 0; id < a.sending_since.size(); ++id) {
    if (a.sending_since[id] == Clock::time_point::max()) continue;
    const auto last = Clock::time_point(Clock::duration(a.send_progress[id].load(std::memory_order_relaxed)));
    std::string why;
    if (now - a.sending_since[id] >= limit) {
      why = fmt::format("did not take the model within {} s (server_configs.broadcast_timeout_s)",
                        cfg_.server.broadcast_deadline_s());
    } else if (someone_waits && now - last >= stall) {
      why = fmt::format("took no chunk of the model for {} s (grpc_configs.connect_timeout_s) while updates waited",
                        cfg_.server.connect_timeout_s);
    } else {
      continue;
    }
    a.sending_since[id] = Clock::time_point::max();
    fail_locked(static_cast<int>(id), why + "; its send is cancelled so that updates can be applied", /*cancel=*/true);
  }
}

grpc::Status ServerAgent::async_receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                                               int id, uint64_t session, const wire::UpdateMetadata& md,
                                               const std::string& peer, DataSocket* data) {
  Async& a = *async_;
  const Layout& layout = layout_;
  size_t slot = 0;
  UpdateReport report;
  {
    std::lock_guard lock(mu_);
    // The metadata before any byte: an update says it is the change from
    // the version this client was sent, and its metrics are numbers.
    const int base = static_cast<int>(a.base_version[static_cast<size_t>(id)]);
    Status meta = check_update_round(md.round(), base, client_id(id));
    if (meta.ok()) {
      auto decoded = decode_update_report(md.sample_count(), md.metrics(), client_id(id), base);
      if (decoded.ok()) report = *decoded;
      meta = decoded.status();
    }
    if (!meta.ok()) return {grpc::StatusCode::INVALID_ARGUMENT, meta.message()};
    slot = a.slots->take();
  }
  auto give_back = [&] {
    std::lock_guard lock(mu_);
    a.slots->give_back(slot);
  };
  // The update is checked chunk by chunk into its spool slot; it touches the
  // model only once it is whole.
  std::unique_ptr<UpdateStream> into = std::make_unique<SpoolSlotWriter>(a.slots->spool(), slot, layout, peer);
  if (a.options.wrap_update) into = a.options.wrap_update(std::move(into), peer);
  uint64_t received = 0;
  Status bad = read_update_frames(ctx, stream, peer, layout.total_bytes(), &read_ahead_budget_, &received, data,
                                  &upload_buffers_, 0, chunk_, cfg_.compressor.enable_compression,
                                  [&](const DecodedFrame& d) { return into->accept(d.header, d.payload()); });
  if (bad.ok()) bad = into->commit();
  if (!bad.ok()) {
    give_back();
    wire::ServerMessage nack;
    nack.mutable_update_ack()->set_accepted(false);
    nack.mutable_update_ack()->set_message(bad.message());
    stream->Write(encode_message(nack));
    std::lock_guard lock(mu_);
    if (slots_[static_cast<size_t>(id)].session == session) fail_locked(id, bad.message());
    return {grpc::StatusCode::DATA_LOSS, bad.message()};
  }
  Status applied;
  {
    std::unique_lock model_lock = lock_to_apply(a);
    wait_for_sent_chunks();
    std::lock_guard lock(mu_);
    if (a.done || slots_[static_cast<size_t>(id)].session != session) {
      // The run has all its updates (or the session was replaced): not applied.
      a.slots->give_back(slot);
    } else {
      AsyncTripRecord trip;
      trip.client = id;
      trip.update = std::make_shared<SpoolSlotSource>(a.slots->spool(), slot, layout.total_bytes());
      trip.base_version = a.base_version[static_cast<size_t>(id)];
      trip.dispatched_at = a.dispatched_at[static_cast<size_t>(id)];
      trip.local_steps = report.local_steps;
      trip.train_loss = report.train_loss;
      trip.bytes_up = received;
      auto next = a.core->arrive(std::move(trip), a.now());
      if (!next.ok()) {
        applied = next.status();
      } else {
        follow_locked(*next);
        bytes_up_ += layout.total_bytes();
        if (a.options.eval_due(a.core->arrivals())) a.evals_due++;
        if (a.core->arrivals() >= a.options.total) a.done = true;
        cv_.notify_all();
      }
    }
  }
  wire::ServerMessage ack;
  ack.mutable_update_ack()->set_accepted(applied.ok());
  ack.mutable_update_ack()->set_message(applied.ok() ? "" : applied.message());
  stream->Write(encode_message(ack));
  if (!applied.ok()) return {grpc::StatusCode::INTERNAL, applied.message()};
  return grpc::Status::OK;
}

Status ServerAgent::serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options) {
  if (!async_)
    return failed_precondition("serve_async: the config's scheduler ({}) is not asynchronous", cfg_.server.scheduler);
  {
    std::lock_guard lock(mu_);
    async_->global = &global;
    async_->options = options;
    const size_t n = slots_.size();
    async_->slots = std::make_unique<SpoolSlots>("asynchronous update spool", layout_.total_bytes());
    MEMFL_RETURN_IF_ERROR(async_->slots->open(options.spool_dir));
    async_->t0 = Clock::now();
    async_->core = &core;  // last: sessions wait for it
    // Applied (or folded into FedBuff's buffer) updates give their slot back;
    // the core calls this with mu_ held.
    core.set_release([this](AsyncTripRecord& t) { async_->slots->release(t); });
    for (size_t c = 0; c < n; ++c) {
      if (!slots_[c].failed) async_->ready_steps[c] = core.start(static_cast<int>(c), 0.0);
    }
    cv_.notify_all();
  }
  Async& a = *async_;
  // The watchdog runs beside the serving loop, which may itself wait for
  // model_mu (a FedCompass deadline, an evaluation).
  struct Watchdog {
    explicit Watchdog(ServerAgent* a) : agent(a) {}
    ServerAgent* agent;
    std::mutex m;
    std::condition_variable cv;
    bool stop = false;
    std::thread thread;
    ~Watchdog() {
      {
        std::lock_guard lock(m);
        stop = true;
      }
      cv.notify_all();
      if (thread.joinable()) thread.join();
    }
  } watchdog(this);
  watchdog.thread = std::thread([&watchdog] {
    while (true) {
      {
        std::unique_lock lock(watchdog.m);
        if (watchdog.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return watchdog.stop; })) return;
      }
      std::lock_guard agent_lock(watchdog.agent->mu_);
      watchdog.agent->cancel_stalled_senders_locked();
    }
  });
  int64_t evaluated = 0;
  while (true) {
    std::unique_lock lock(mu_);
    auto due = Clock::time_point::max();
    size_t first = 0;
    for (size_t i = 0; i < a.deadlines.size(); ++i) {
      const auto when = a.t0 + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(std::min(a.deadlines[i].first, 1e9)));
      if (when < due) {
        due = when;
        first = i;
      }
    }
    const bool everyone_out = std::all_of(slots_.begin(), slots_.end(), [](const ClientSlot& s) { return s.failed; });
    if (everyone_out)
      return failed_precondition("every client is out; {} updates of {} arrived", core.arrivals(), options.total);
    const auto wake = std::min(due, Clock::now() + std::chrono::seconds(1));
    cv_.wait_until(lock, wake, [&] { return a.evals_due > 0 || (a.done && a.evals_due == 0) || Clock::now() >= due; });
    if (a.evals_due > 0) {
      a.evals_due--;
      const int64_t arrivals = core.arrivals();
      const double seconds = a.now();
      lock.unlock();
      std::shared_lock model_lock(a.model_mu);
      MEMFL_RETURN_IF_ERROR(options.on_eval(++evaluated, arrivals, seconds));
      continue;
    }
    if (a.done) break;
    if (due != Clock::time_point::max() && Clock::now() >= due) {
      const int group = a.deadlines[first].second;
      a.deadlines.erase(a.deadlines.begin() + static_cast<std::ptrdiff_t>(first));
      lock.unlock();
      std::unique_lock model_lock = lock_to_apply(a);
      wait_for_sent_chunks();
      std::lock_guard relock(mu_);
      MEMFL_ASSIGN_OR_RETURN(AsyncNext next, core.deadline(group, a.now()));
      follow_locked(next);
    }
  }
  return core.flush_log();
}

}  // namespace memfl::grpc_detail
