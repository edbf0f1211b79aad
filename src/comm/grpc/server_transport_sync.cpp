// Rounds over gRPC (server_agent.h says which file holds what): the round
// driver puts the transport in the broadcast phase, then the upload phase;
// sessions send the model and take each update as it comes, the aggregator
// parking one whose turn to fold has not come, so no client waits for another.
#include "comm/grpc/server_agent.h"

#include <algorithm>
#include <cmath>

#include <spdlog/spdlog.h>

#include "comm/update_check.h"
#include "comm/update_report.h"

namespace memfl::grpc_detail {

grpc::Status ServerAgent::receive_update(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                                         int id, uint64_t session, const wire::UpdateMetadata& md,
                                         const std::string& peer, DataSocket* data) {
  UpdateReport report;
  {
    std::unique_lock lock(mu_);
    // The others' broadcast may still run: this update waits for the upload
    // phase at most as long as the two phases may take.
    const auto deadline = Clock::now() + std::chrono::seconds(cfg_.server.broadcast_deadline_s()) +
                          std::chrono::seconds(cfg_.server.upload_deadline_s());
    // No turn to wait for: the aggregator parks an update that is early.
    if (!wait_for(lock, deadline, [&] {
          return phase_ == Phase::kFinished || slots_[static_cast<size_t>(id)].failed || phase_ == Phase::kUpload;
        })) {
      return {grpc::StatusCode::DEADLINE_EXCEEDED, peer + ": the upload phase did not reach it in time"};
    }
    if (slots_[static_cast<size_t>(id)].failed || phase_ != Phase::kUpload) {
      return {grpc::StatusCode::ABORTED, peer + ": not part of this round's upload"};
    }
    // The metadata before any byte: an update for another round, or one
    // whose metrics are not numbers, is refused as a bad sample count is.
    Status meta = check_update_round(md.round(), round_, client_id(id));
    if (meta.ok()) {
      auto decoded = decode_update_report(md.sample_count(), md.metrics(), client_id(id), round_);
      if (decoded.ok()) report = *decoded;
      meta = decoded.status();
    }
    if (!meta.ok()) return {grpc::StatusCode::INVALID_ARGUMENT, meta.message()};
    if (!up_start_) up_start_ = Clock::now();
    slots_[static_cast<size_t>(id)].uploading = true;
  }
  // However this update ends, the round may be aggregated once it has.
  struct Done {
    ServerAgent* a;
    int id;
    ~Done() {
      std::lock_guard lock(a->mu_);
      a->slots_[static_cast<size_t>(id)].uploading = false;
      a->cv_.notify_all();
    }
  };
  const Layout& layout = layout_;
  std::unique_ptr<UpdateStream> update;
  Done done{this, id};  // declared before `update`: the stream closes first
  if (!naive_) {
    UpdateOpener* agg = nullptr;
    {
      std::lock_guard lock(mu_);
      agg = aggregator_;
    }
    if (agg == nullptr) return {grpc::StatusCode::ABORTED, peer + ": not part of this round's upload"};
    auto u = agg->open_update(client_id(id), md.sample_count());
    if (!u.ok()) return {grpc::StatusCode::INVALID_ARGUMENT, u.status().message()};
    update = std::move(*u);
  } else {
    if (!(md.sample_count() > 0)) return {grpc::StatusCode::INVALID_ARGUMENT, peer + ": bad sample count"};
    update = naive_open_update(peer);
  }
  uint64_t received = 0;
  Status bad = read_update_frames(ctx, stream, peer, layout.total_bytes(), &read_ahead_budget_, &received, data,
                                  &upload_buffers_, static_cast<uint64_t>(id), chunk_,
                                  cfg_.compressor.enable_compression || cfg_.secagg.enable,
                                  [&](const DecodedFrame& d) { return update->accept(d.header, d.payload()); });
  if (bad.ok()) bad = update->commit();
  wire::ServerMessage ack;
  ack.mutable_update_ack()->set_accepted(bad.ok());
  ack.mutable_update_ack()->set_message(bad.ok() ? "" : bad.message());
  stream->Write(encode_message(ack));
  std::lock_guard lock(mu_);
  if (slots_[static_cast<size_t>(id)].session != session) {
    // The client registered again meanwhile: this session was cancelled, and
    // its update never counts (the round already closed on it).
    update.reset();
    return {grpc::StatusCode::CANCELLED, peer + ": session replaced"};
  }
  if (!bad.ok()) {
    update.reset();  // aborts: taints the sum if some bytes were folded
    fail_locked(id, bad.message());
    return {grpc::StatusCode::DATA_LOSS, bad.message()};
  }
  auto& s = slots_[static_cast<size_t>(id)];
  s.committed = true;
  s.info = update_info(id, report);
  s.info.bytes_down = s.bytes_down;
  s.info.bytes_up = received;
  if (naive_) naive_keep_locked(id, md.sample_count(), std::move(update));
  bytes_up_ += received;
  up_end_ = Clock::now();
  cv_.notify_all();
  return grpc::Status::OK;
}

Status ServerAgent::broadcast(int round, const std::vector<int>& selected, const Arena& global, BroadcastResult* out) {
  std::unique_lock lock(mu_);
  global_ = &global;
  deadline_ = Clock::now() + std::chrono::seconds(cfg_.server.broadcast_deadline_s());
  order_.clear();
  for (auto& s : slots_) s.selected = false;
  for (int c : selected) {
    auto& s = slots_[static_cast<size_t>(c)];
    if (s.failed) continue;
    s.selected = true;
    s.received = s.committed = false;
    s.served_round = 0;
    s.bytes_down = 0;
    order_.push_back(c);
  }
  if (order_.empty()) return failed_precondition("round {}: every selected client has failed", round);
  down_start_.reset();
  up_start_.reset();
  bytes_down_ = bytes_up_ = 0;
  naive_updates_.clear();
  // A new model to send (a round redone after a broken update sends the
  // restored model again: its checksums are computed again too). No sender
  // runs until the phase below says so.
  down_sums_.reset(++broadcasts_, layout_.total_bytes(), chunk_);
  for (auto& s : slots_) s.secagg_request.reset(), s.secagg_reply.reset();
  round_ = round;
  phase_ = Phase::kBroadcast;
  cv_.notify_all();
  auto all_received = [&] {
    for (int c : order_) {
      const auto& s = slots_[static_cast<size_t>(c)];
      if (!s.failed && !s.received && s.lost_round != round_) return false;
    }
    return true;
  };
  if (!wait_for(lock, deadline_, all_received)) {
    for (int c : order_) {
      if (!slots_[static_cast<size_t>(c)].received && slots_[static_cast<size_t>(c)].lost_round != round)
        fail_locked(c,
                    fmt::format("round {}: it had not received the global model after {} s "
                                "(server_configs.broadcast_timeout_s); the round goes on without it",
                                round, cfg_.server.broadcast_deadline_s()),
                    /*cancel=*/true);
    }
  }
  // gRPC may still hold references to the arena's bytes; the sum must not
  // overwrite them before it lets go.
  lock.unlock();
  while (inflight_.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  lock.lock();
  out->bytes = bytes_down_;
  if (down_start_) out->seconds = std::chrono::duration<double>(down_end_ - *down_start_).count();
  return Status::Ok();
}

Status ServerAgent::collect(int round, const std::vector<int>&, const Arena&, UpdateOpener& aggregator,
                            CollectResult* out) {
  std::unique_lock lock(mu_);
  aggregator_ = &aggregator;
  // The upload's own deadline: a client stalled in the broadcast has not
  // used up the others' time.
  deadline_ = Clock::now() + std::chrono::seconds(cfg_.server.upload_deadline_s());
  phase_ = Phase::kUpload;
  cv_.notify_all();
  auto all_done = [&] {
    for (int c : order_) {
      const auto& s = slots_[static_cast<size_t>(c)];
      if (!s.failed && !s.committed && s.lost_round != round_) return false;
    }
    return true;
  };
  if (!wait_for(lock, deadline_, all_done)) {
    for (int c : order_) {
      if (!slots_[static_cast<size_t>(c)].committed && slots_[static_cast<size_t>(c)].lost_round != round)
        fail_locked(c,
                    fmt::format("round {}: no complete update {} s into the upload (server_configs.upload_timeout_s); "
                                "the round ends with the clients that finished",
                                round, cfg_.server.upload_deadline_s()),
                    /*cancel=*/true);
    }
    // A session still inside its update holds a stream of the aggregator:
    // it ends (cancelled above) before the round can be aggregated.
    lock.unlock();
    while (true) {
      lock.lock();
      const bool busy =
          std::any_of(order_.begin(), order_.end(), [&](int c) { return slots_[static_cast<size_t>(c)].uploading; });
      lock.unlock();
      if (!busy) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    lock.lock();
  }
  phase_ = Phase::kWaiting;
  if (naive_) naive_average_locked();
  aggregator_ = nullptr;
  for (int c : order_) {
    const auto& s = slots_[static_cast<size_t>(c)];
    if (s.committed) {
      out->committed.push_back(s.info);
    } else {
      out->failed.push_back(c);
    }
  }
  out->bytes_up = bytes_up_;
  if (up_start_) out->upload_seconds = std::chrono::duration<double>(up_end_ - *up_start_).count();
  return Status::Ok();
}

StatusOr<std::string> ServerAgent::secagg_exchange(int client, std::string request) {
  std::unique_lock lock(mu_);
  if (client < 0 || static_cast<size_t>(client) >= slots_.size()) {
    return invalid_argument("secure aggregation: no client_{} in this run", client);
  }
  auto& s = slots_[static_cast<size_t>(client)];
  if (s.failed) return Status(StatusCode::kUnavailable, fmt::format("client_{} is out of the run", client));
  s.secagg_reply.reset();
  s.secagg_request = std::move(request);
  cv_.notify_all();
  const int wait_s = cfg_.secagg_deadline_s();
  if (wait_for(lock, Clock::now() + std::chrono::seconds(wait_s), [&] { return s.secagg_reply || s.failed; }) &&
      s.secagg_reply) {
    std::string reply = std::move(*s.secagg_reply);
    s.secagg_reply.reset();
    return reply;
  }
  s.secagg_request.reset();
  const std::string why = s.failed ? fmt::format("client_{} left during secure aggregation", client)
                                   : fmt::format(
                                         "client_{} did not answer secure aggregation within {} s "
                                         "(server_configs.secure_aggregation.timeout)",
                                         client, wait_s);
  fail_locked(client, fmt::format("round {}: {}", round_, why), /*cancel=*/true);
  return Status(StatusCode::kUnavailable, why);
}

void ServerAgent::secagg_end_round() {
  std::lock_guard lock(mu_);
  // Every client of the round polls until it hears this.
  for (int c : order_) slots_[static_cast<size_t>(c)].secagg_over = true;
  cv_.notify_all();
}

void ServerAgent::secagg_drop(int client, const std::string& why) {
  std::lock_guard lock(mu_);
  if (client >= 0 && static_cast<size_t>(client) < slots_.size()) {
    fail_locked(client, fmt::format("round {}: secure aggregation: {}", round_, why), /*cancel=*/true);
  }
}

}  // namespace memfl::grpc_detail
