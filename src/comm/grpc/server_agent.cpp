// What every mode of the gRPC server transport uses (server_agent.h says
// which file holds what): the data channel, dropping a client, sending the
// global model, reading an update's frames, waiting for clients to register.
#include "comm/grpc/server_agent.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

namespace memfl::grpc_detail {

Status read_update_frames(grpc::ServerContext* ctx, grpc::ServerReaderWriter<Frame, Frame>* stream,
                          const std::string& peer, uint64_t total, std::atomic<int>* read_ahead_budget,
                          uint64_t* received, DataSocket* data, ChunkPool* buffers, uint64_t order, size_t chunk,
                          bool framed, const std::function<Status(const DecodedFrame&)>& on_chunk) {
  wire::ClientMessage msg;
  bool broke = false;
  if (data != nullptr) {
    // Each chunk is read into a buffer of the shared pool, taken once its
    // header has been checked and given back once the chunk is folded (or
    // parked): a session between chunks, or whose client is slow, holds none.
    const size_t limit = chunk + (framed ? kMaxFrameOverhead : 0);
    DecodedFrame d;
    d.is_chunk = true;
    auto read_chunks = [&]() -> Status {
      uint64_t covered = 0;  // model bytes the chunks so far stand for
      while (covered < total) {
        ChunkHeader h;
        MEMFL_RETURN_IF_ERROR(data->read_header(&h, std::min(limit, buffers->buffer_bytes())));
        // Served in fold order: the update whose turn it is reads first.
        auto lease = buffers->acquire([ctx] { return ctx->IsCancelled(); }, order);
        if (!lease) return Status(StatusCode::kUnavailable, "cancelled while it waited for a chunk buffer");
        const auto payload = lease->bytes().first(static_cast<size_t>(h.length));
        MEMFL_RETURN_IF_ERROR(data->read_exact(payload));
        d.header = h;
        d.pieces.assign(1, std::span<const std::byte>(payload));
        MEMFL_RETURN_IF_ERROR(on_chunk(d));
        *received += h.length;
        covered += framed ? std::min<uint64_t>(chunk, total - covered) : h.length;
      }
      return Status::Ok();
    };
    Status st = read_chunks();
    if (st.code() == StatusCode::kUnavailable) {
      return Status(StatusCode::kUnavailable, fmt::format("{} disconnected after {} of {} bytes of its update ({})",
                                                          peer, *received, total, st.message()));
    }
    MEMFL_RETURN_IF_ERROR(st);
    Frame frame;
    if (!stream->Read(&frame)) {
      return Status(StatusCode::kUnavailable, fmt::format("{} disconnected before the end of its update", peer));
    }
    MEMFL_RETURN_IF_ERROR(decode_frame(frame, kClientChunkField, peer, &d, &msg));
    if (d.is_chunk || !msg.has_update_end()) return data_loss("{}: unexpected message at the end of an update", peer);
    return Status::Ok();
  }
  Status st = read_chunk_run([stream](Frame* f) { return stream->Read(f); }, [ctx] { ctx->TryCancel(); },
                             kClientChunkField, peer, ChunkRunOptions{.budget = read_ahead_budget},
                             [&](const DecodedFrame& d) {
                               MEMFL_RETURN_IF_ERROR(on_chunk(d));
                               *received += d.header.length;
                               return Status::Ok();
                             },
                             &msg, &broke);
  if (broke) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("{} disconnected after {} of {} bytes of its update", peer, *received, total));
  }
  MEMFL_RETURN_IF_ERROR(st);
  if (!msg.has_update_end()) return data_loss("{}: unexpected message in the middle of an update", peer);
  return Status::Ok();
}

Status ServerAgent::start_data_channel() {
  // Under TLS the chunks may leave the encrypted stream only where they never
  // leave the kernel: the Unix socket, for clients on this host (its ticket
  // travels inside the TLS stream). A plain server also offers a TCP port.
  const bool tcp = !cfg_.server.use_ssl;
  const bool unix_socket = cfg_.server.data_channel_unix || !tcp;
  MEMFL_RETURN_IF_ERROR(data_listener_.start(
      cfg_.server.server_uri, cfg_.server.data_channel_port, unix_socket,
      [this](int fd, const DataHello& hello, const std::string& addr) { return attach_data(fd, hello, addr); }, tcp));
  data_port_ = data_listener_.port();
  offers_data_ = data_port_ != 0 || !data_listener_.unix_name().empty();
  if (tcp) {
    spdlog::info("server: TCP data channel on port {}{}", data_port_,
                 data_listener_.unix_name().empty() ? "" : ", and a Unix socket for clients on this host");
  } else if (offers_data_) {
    spdlog::info(
        "server: data channel on a Unix socket for clients on this host (TLS: clients elsewhere use the "
        "encrypted stream)");
  }
  return Status::Ok();
}

bool ServerAgent::attach_data(int fd, const DataHello& hello, const std::string& addr) {
  std::lock_guard lock(mu_);
  if (hello.client_id >= slots_.size()) return false;
  auto& s = slots_[hello.client_id];
  // The ticket is the session's, and good once.
  if (s.data_ticket == 0 || s.data_ticket != hello.ticket || !send_data_welcome(fd)) return false;
  s.data_ticket = 0;
  s.data = std::make_shared<DataSocket>(fd, fmt::format("client_{} ({}, data channel)", hello.client_id, addr));
  spdlog::info("client_{}: chunks on the data channel ({})", hello.client_id, addr);
  cv_.notify_all();
  return true;
}

std::shared_ptr<DataSocket> ServerAgent::wait_for_data(int id, uint64_t session) {
  std::unique_lock lock(mu_);
  auto& s = slots_[static_cast<size_t>(id)];
  wait_for(lock, Clock::now() + std::chrono::seconds(cfg_.server.connect_timeout_s),
           [&] { return s.data != nullptr || s.failed || s.session != session; });
  return s.session == session && !s.failed ? s.data : nullptr;
}

bool ServerAgent::wait_for(std::unique_lock<std::mutex>& lock, Clock::time_point deadline,
                           const std::function<bool()>& pred) {
  return cv_.wait_until(lock, deadline, pred);
}

void ServerAgent::fail_locked(int id, const std::string& why, bool cancel) {
  auto& s = slots_[static_cast<size_t>(id)];
  if (s.failed) return;
  s.failed = true;
  spdlog::warn("client_{} is out: {}", id, why);
  if (cancel && s.ctx != nullptr) s.ctx->TryCancel();
  // A read or write blocked on its data channel returns now.
  if (s.data) s.data->shutdown();
  cv_.notify_all();
}

grpc::Status ServerAgent::send_model(grpc::ServerReaderWriter<Frame, Frame>* stream, int round, const std::string& peer,
                                     DataSocket* data, int local_steps, std::atomic<int64_t>* progress, int held_round,
                                     uint64_t* sent_out) {
  auto made_progress = [progress] {
    if (progress != nullptr) progress->store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  };
  const Layout& layout = layout_;
  wire::ServerMessage begin;
  begin.mutable_model_begin()->set_round(round);
  begin.mutable_model_begin()->set_local_steps(local_steps);
  begin.mutable_model_begin()->set_layout_hash(layout.hash());
  begin.mutable_model_begin()->set_total_bytes(layout.total_bytes());
  // The change from the model the client holds, when the broadcast was
  // coded from it (broadcast_compression: lossy; compress/broadcast_delta.h).
  const bool changes = frames_ != nullptr && !async_ && !naive_ && held_round > 0 &&
                       frames_->from_round() == held_round && frames_->to_round() == round &&
                       frames_->chunk_bytes() == chunk_;
  if (changes) begin.mutable_model_begin()->set_change_from_round(held_round);
  if (!stream->Write(encode_message(begin))) return {grpc::StatusCode::UNAVAILABLE, peer + " went away"};
  {
    std::lock_guard lock(mu_);
    if (!down_start_) down_start_ = Clock::now();
    // Every sender of this model shares its chunks' checksums. Asynchronous,
    // a new version forgets the old ones (the model changes only while no
    // sender runs); in rounds, broadcast() resets them.
    if (async_) down_sums_.reset(round, layout.total_bytes(), chunk_);
  }
  // Naive mode serialises the whole model into one buffer first, as typical
  // frameworks do (pickle/torch.save); streaming sends from the arena.
  NaiveSerialised serialised;
  const std::byte* base = naive_ ? serialised.copy(global_->data(), layout.total_bytes()) : global_->data();
  // One frame at a time, read back from the frames' file; gRPC holds it by
  // reference until sent, so the next is read once it has let go (the
  // destructor waits too).
  NaiveSerialised frame;
  uint64_t sent = 0;
  for (size_t off = 0; off < layout.total_bytes(); off += chunk_) {
    const size_t len = std::min(chunk_, layout.total_bytes() - off);
    std::span<const std::byte> bytes(base + off, len);
    ChunkHeader h;
    if (changes) {
      while (frame.inflight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
      auto f = frames_->frame(off, &frame.bytes);
      if (!f.ok()) return {grpc::StatusCode::INTERNAL, f.status().message()};
      bytes = *f;
      h = ChunkHeader{layout.hash(), off, bytes.size(), chunk_checksum(bytes)};
    } else {
      h = ChunkHeader{layout.hash(), off, len, down_sums_.get(off, bytes)};
    }
    sent += bytes.size();
    if (data != nullptr) {
      // The kernel copies the bytes before write_chunk returns.
      const Status w = data->write_chunk(h, bytes);
      if (!w.ok()) return {grpc::StatusCode::UNAVAILABLE, peer + " went away during the broadcast: " + w.message()};
      made_progress();
      continue;
    }
    // One write in flight: Write returns when gRPC has taken the message.
    std::atomic<int64_t>* holds = changes ? &frame.inflight : naive_ ? &serialised.inflight : &inflight_;
    if (!stream->Write(encode_chunk_frame(kServerChunkField, h, bytes, holds))) {
      return {grpc::StatusCode::UNAVAILABLE, peer + " went away during the broadcast"};
    }
    made_progress();
  }
  wire::ServerMessage end;
  end.mutable_model_end();
  if (!stream->Write(encode_message(end))) return {grpc::StatusCode::UNAVAILABLE, peer + " went away"};
  std::lock_guard lock(mu_);
  bytes_down_ += sent;
  if (sent_out != nullptr) *sent_out = sent;
  return grpc::Status::OK;
}

void ServerAgent::finish(int) {
  std::lock_guard lock(mu_);
  phase_ = Phase::kFinished;
  cv_.notify_all();
}

void ServerAgent::wait_for_clients() {
  std::unique_lock lock(mu_);
  const auto deadline = Clock::now() + std::chrono::seconds(cfg_.server.round_timeout_s);
  if (!wait_for(lock, deadline, [&] {
        return std::all_of(slots_.begin(), slots_.end(), [](const ClientSlot& s) { return s.connected; });
      })) {
    int n = static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](auto& s) { return s.connected; }));
    spdlog::warn("server: only {} of {} clients registered within {} s; going on with them", n, cfg_.server.num_clients,
                 cfg_.server.round_timeout_s);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].connected) slots_[i].failed = true;
    }
  }
}

}  // namespace memfl::grpc_detail
