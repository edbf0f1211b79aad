// ClientAgent over gRPC: register, get the configuration, then per round get
// the global model (chunks straight into the local arena), train, and upload
// (chunks straight from the arena).
#include <csignal>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/grpc/client_session.h"
#include "comm/grpc/data_channel.h"
#include "comm/grpc/wire.h"
#include "memory/malloc_policy.h"
#include "memory/sampler.h"
#include "client/client_driver.h"
#include "client/client_work.h"
#include "roles/grpc_roles.h"
#include "io/run_dir.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

using Stream = ClientStream;

Status write(Stream& stream, const google::protobuf::MessageLite& msg, const std::string& peer) {
  return write_client_message(stream, msg, peer);
}

}  // namespace

// Fault injection for the integration tests: MEMFL_FAULT=<kind> makes client
// MEMFL_FAULT_CLIENT (default 0) misbehave in its first upload, as a broken or
// hostile peer would. Kinds: disconnect_mid_upload, bad_checksum,
// wrong_layout_hash, offset_past_end, extra_bytes, wrong_token; and a stalled
// node: stop_in_broadcast and stop_mid_upload stop the process (SIGSTOP)
// after the first chunk, once; SIGCONT lets it go on.
std::string injected_fault(int client_id) {
  const char* kind = std::getenv("MEMFL_FAULT");
  const char* who = std::getenv("MEMFL_FAULT_CLIENT");
  if (kind == nullptr || std::atoi(who != nullptr ? who : "0") != client_id) return "";
  return kind;
}

Status run_grpc_client(const ExperimentConfig& local, int client_id, const RoleOptions& opts) {
  const std::string fault = injected_fault(client_id);
  // A client that trains keeps its activation memory between batches; one
  // that only moves a synthetic model (the transfer benchmarks) streams.
  if (is_spec_only(local)) {
    tune_malloc_for_streaming();
  } else {
    tune_malloc_for_training();
  }
  const std::string role = fmt::format("client_{}", client_id);
  MemorySampler sampler(role, local.memory.sample_interval_ms);
  sampler.start();
  WriteMemoryOnExit write_on_exit(sampler, opts.run_dir);
  sampler.mark(0, "setup");
  const int64_t baseline_rss = read_rss_bytes();

  const auto& lc = local.server;
  const std::string peer = lc.server_uri;
  MEMFL_ASSIGN_OR_RETURN(auto channel, make_client_channel(lc.server_uri, lc.use_ssl, lc.root_cert, lc.max_message_size,
                                                           lc.connect_timeout_s));
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<Stream> stream;
  // The session's data channel, when the server offers one (data_channel:
  // tcp): the model's chunks travel there, the stream keeps the rest.
  std::unique_ptr<DataSocket> data_link;
  DecodedFrame d;
  wire::ServerMessage msg;
  wire::ClientMessage out;
  // A session: Register, then GetConfiguration (the experiment's YAML).
  auto open_session = [&]() -> StatusOr<std::string> {
    ctx = std::make_unique<grpc::ClientContext>();
    grpc::internal::RpcMethod method(kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel);
    stream.reset(grpc::internal::ClientReaderWriterFactory<Frame, Frame>::Create(channel.get(), method, ctx.get()));
    out.Clear();
    out.mutable_register_()->set_client_id(std::to_string(client_id));
    out.mutable_register_()->set_token(fault == "wrong_token" ? lc.auth_token + "-wrong" : lc.auth_token);
    out.mutable_register_()->set_data_channel(true);  // the server's config decides
    MEMFL_RETURN_IF_ERROR(write(*stream, out, peer));
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream, peer, &d, &msg));
    if (d.is_chunk || !msg.has_register_reply()) return data_loss("server {}: expected a RegisterReply", peer);
    if (!msg.register_reply().accepted()) {
      return Status(StatusCode::kFailedPrecondition,
                    fmt::format("server {} refused {}: {}", peer, role, msg.register_reply().message()));
    }
    data_link.reset();
    const uint64_t ticket = msg.register_reply().data_ticket() ^ (fault == "wrong_data_ticket" ? 1 : 0);
    MEMFL_ASSIGN_OR_RETURN(
        data_link, join_data_channel(*stream, msg.register_reply(), lc.server_uri, static_cast<uint32_t>(client_id),
                                     ticket, lc.connect_timeout_s, role));
    // The server's configuration is the experiment; the local one only says
    // how to reach the server.
    out.Clear();
    out.mutable_get_configuration();
    MEMFL_RETURN_IF_ERROR(write(*stream, out, peer));
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream, peer, &d, &msg));
    if (d.is_chunk || !msg.has_configuration()) return data_loss("server {}: expected a Configuration", peer);
    return msg.configuration().config_yaml();
  };
  // The server went away (killed, restarted with --resume): a new session,
  // with backoff from 0.1 s to 2 s, for connect_timeout_s at most.
  auto reconnect = [&](const Status& why) -> Status {
    spdlog::warn("{}; reconnecting for up to {} s", why.message(), lc.connect_timeout_s);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(lc.connect_timeout_s);
    auto wait = std::chrono::milliseconds(100);
    Status last = why;
    while (std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(wait);
      wait = std::min(2 * wait, std::chrono::milliseconds(2000));
      if (!channel->WaitForConnected(std::chrono::system_clock::now() + wait)) continue;
      auto yaml = open_session();
      if (yaml.ok()) {
        spdlog::info("{}: reconnected to server {}", role, peer);
        return Status::Ok();
      }
      last = yaml.status();
      if (last.code() != StatusCode::kUnavailable) return last;  // refused: say why, stop
    }
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: gave up reconnecting to server {} after {} s (server_configs.comm_configs."
                              "grpc_configs.connect_timeout_s); last error: {}",
                              role, peer, lc.connect_timeout_s, last.message()));
  };
  MEMFL_ASSIGN_OR_RETURN(std::string config_yaml, open_session());
  MEMFL_ASSIGN_OR_RETURN(ExperimentConfig cfg, load_config_text(config_yaml, "configuration from server " + peer));
  if (cfg.train.num_threads == 0) cfg.train.num_threads = 1;  // clients share the machine's cores

  std::optional<DatasetSplits> data;
  std::vector<ClientPartition> parts;
  InputSpec input;
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(parts, make_partitions(cfg, data->train));
  }
  const int64_t before_model_rss = read_rss_bytes();
  MEMFL_ASSIGN_OR_RETURN(LocalModel model, make_local_model(cfg, input, /*fill=*/false, cfg.server.seed, opts.run_dir));
  const Layout& layout = model.layout();
  const size_t chunk =
      grpc_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes());
  std::atomic<int64_t> inflight{0};
  int rounds = 0;
  bool stopped_once = false;  // a stop_* fault fires once, even if the client rejoins
  auto stop_here = [&](const char* kind) {
    if (fault != kind || stopped_once) return;
    stopped_once = true;
    spdlog::warn("{}: injected fault {}: stopping (SIGSTOP)", role, kind);
    std::raise(SIGSTOP);
  };
  ClientDriver driver(cfg, opts.run_dir, data ? &*data : nullptr, parts);
  // A sharded model's upload: one chunk at a time, read from the ranks that
  // own it. It lives as long as the arena would: gRPC sends it zero-copy.
  std::vector<std::byte> from_shards;

  // One round; true when the server says the run is finished.
  auto play_round = [&]() -> StatusOr<bool> {
    out.Clear();
    out.mutable_get_global_model();
    MEMFL_RETURN_IF_ERROR(write(*stream, out, peer));
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream, peer, &d, &msg));
    if (d.is_chunk || !msg.has_model_begin()) return data_loss("server {}: expected ModelBegin", peer);
    const auto begin = msg.model_begin();
    if (begin.finished()) return true;
    if (begin.layout_hash() != layout.hash() || begin.total_bytes() != layout.total_bytes()) {
      return data_loss(
          "server {}: its model (layout {:016x}, {} bytes) is not this client's (layout {:016x}, {} bytes)", peer,
          begin.layout_hash(), begin.total_bytes(), layout.hash(), layout.total_bytes());
    }
    const int round = begin.round();
    sampler.mark(round, "broadcast");
    // Our previous upload's slices must be released before the arena is overwritten.
    while (inflight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    // A model sharded over ranks takes each chunk straight into its shards.
    ShardedModelIo* shards = ClientDriver::receive_shards(model);
    std::unique_ptr<ModelWriter> into;
    if (shards != nullptr) {
      into = std::make_unique<ShardedWriter>(layout, *shards, "server " + peer);
    } else {
      into = std::make_unique<ArenaWriter>(layout, model.arena(), "server " + peer);
    }
    // The next chunks are read while one is checked and copied in
    // (read_chunk_run). A download that fails is not drained: the stream
    // is cancelled, and the client registers again.
    if (data_link != nullptr) {
      // Over the data channel: a header, checked before a byte lands, then
      // the bytes straight into the arena and their checksum there (the
      // chunk is still in cache); a sharded model takes them through its
      // writer, one chunk-sized buffer.
      std::vector<std::byte> buffer(shards != nullptr ? chunk : 0);
      for (uint64_t next = 0; next < layout.total_bytes();) {
        ChunkHeader h;
        MEMFL_RETURN_IF_ERROR(data_link->read_header(&h, chunk));
        if (shards != nullptr) {
          const auto payload = std::span(buffer).first(static_cast<size_t>(h.length));
          MEMFL_RETURN_IF_ERROR(data_link->read_exact(payload));
          MEMFL_RETURN_IF_ERROR(into->accept(h, std::span<const std::byte>(payload)));
        } else {
          MEMFL_RETURN_IF_ERROR(verify_chunk_header(h, h.length, layout, next, "server " + peer));
          const auto dst = model.arena().bytes(h.offset, h.length);
          MEMFL_RETURN_IF_ERROR(data_link->read_exact(dst));
          if (chunk_checksum(std::span<const std::byte>(dst)) != h.checksum) {
            return checksum_mismatch(h, "server " + peer);
          }
        }
        next += h.length;
        stop_here("stop_in_broadcast");
      }
      MEMFL_RETURN_IF_ERROR(read_server_message(*stream, peer, &d, &msg));
      if (d.is_chunk) return data_loss("server {}: a chunk on the stream while the data channel is open", peer);
    } else {
      bool broke = false;
      Status down = read_chunk_run([&](Frame* f) { return stream->Read(f); }, [&] { ctx->TryCancel(); },
                                   kServerChunkField, "server " + peer, ChunkRunOptions{.drain = {}},
                                   [&](const DecodedFrame& frame) {
                                     MEMFL_RETURN_IF_ERROR(into->accept(frame.header, frame.payload()));
                                     stop_here("stop_in_broadcast");
                                     return Status::Ok();
                                   },
                                   &msg, &broke);
      MEMFL_RETURN_IF_ERROR(down);  // a broken stream: "server <peer> closed the stream"
    }
    if (msg.has_error()) return failed_precondition("server {}: {}", peer, msg.error().message());
    if (!msg.has_model_end()) return data_loss("server {}: unexpected message during the model download", peer);
    if (data_link == nullptr || shards != nullptr) MEMFL_RETURN_IF_ERROR(into->finish());
    out.Clear();
    out.mutable_model_received();
    MEMFL_RETURN_IF_ERROR(write(*stream, out, peer));

    sampler.mark(round, "train");
    MEMFL_ASSIGN_OR_RETURN(TripUpdate up, driver.train(model, client_id, round, begin.local_steps()));
    const Arena* upload = up.upload;
    shards = up.shards;
    sampler.mark(round, "upload");
    out.Clear();
    auto* md = out.mutable_update_metadata();
    md->set_round(round);
    md->set_sample_count(up.sample_count);
    (*md->mutable_metrics())["train_loss"] = up.trained.train_loss;
    (*md->mutable_metrics())["val_accuracy"] = up.trained.val_accuracy;
    (*md->mutable_metrics())["local_steps"] = static_cast<double>(up.local_steps);
    if (up.has_epsilon) (*md->mutable_metrics())["epsilon"] = up.epsilon;
    MEMFL_RETURN_IF_ERROR(write(*stream, out, peer));
    size_t index = 0;
    for (size_t off = 0; off < layout.total_bytes(); off += chunk, ++index) {
      const size_t len = std::min(chunk, layout.total_bytes() - off);
      std::span<const std::byte> bytes;
      if (upload != nullptr) {
        bytes = upload->bytes(off, len);
      } else {
        // gRPC may still hold the previous chunk's bytes (zero-copy slices).
        while (inflight.load() > 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
        from_shards.resize(len);
        MEMFL_RETURN_IF_ERROR(shards->read(off, from_shards));
        bytes = from_shards;
      }
      ChunkHeader h{layout.hash(), off, len, chunk_checksum(bytes)};
      const bool inject = !fault.empty() && rounds == 0 && (index == 1 || off + len >= layout.total_bytes());
      if (inject && fault == "disconnect_mid_upload") {
        ctx->TryCancel();
        if (data_link != nullptr) data_link->shutdown();
        return Status(StatusCode::kAborted, "injected fault: disconnected in the middle of the upload");
      }
      if (index == 1) stop_here("stop_mid_upload");
      if (inject && fault == "bad_checksum") h.checksum ^= 1;
      if (inject && fault == "wrong_layout_hash") h.layout_hash ^= 1;
      if (inject && fault == "offset_past_end") h.offset = layout.total_bytes() + 8;
      if (inject && fault == "extra_bytes") h.length = len - 1;  // more bytes than the header announces
      if (data_link != nullptr) {
        // The kernel has copied the bytes when write_chunk returns.
        if (Status w = data_link->write_chunk(h, bytes); !w.ok()) {
          return Status(StatusCode::kUnavailable, fmt::format("{} during the upload", w.message()));
        }
      } else if (!stream->Write(encode_chunk_frame(kClientChunkField, h, bytes, &inflight))) {
        return Status(StatusCode::kUnavailable, fmt::format("server {} closed the stream during the upload", peer));
      }
    }
    out.Clear();
    out.mutable_update_end();
    MEMFL_RETURN_IF_ERROR(write(*stream, out, peer));
    MEMFL_RETURN_IF_ERROR(read_server_message(*stream, peer, &d, &msg));
    if (d.is_chunk || !msg.has_update_ack()) return data_loss("server {}: expected UpdateAck", peer);
    if (!msg.update_ack().accepted()) {
      return Status(StatusCode::kAborted,
                    fmt::format("server {} rejected the update of {}: {}", peer, role, msg.update_ack().message()));
    }
    ++rounds;
    sampler.mark(round, "idle");
    return false;
  };
  while (true) {
    auto finished = play_round();
    if (finished.ok()) {
      if (*finished) break;
      continue;
    }
    // Only a server that went away is worth a new session; bad bytes,
    // refusals and injected faults end the client with their message.
    if (finished.status().code() != StatusCode::kUnavailable) return finished.status();
    // The call is over: its status tells a server that went away (the
    // connection broke: UNAVAILABLE) from one that ended our session (it
    // dropped this client: CANCELLED, DATA_LOSS, …), which a new session
    // would not change.
    // (Finish waits for every message to be read: read what is left first;
    // a rejection of our update says best why the session ended.)
    for (Frame left; stream->Read(&left);) {
      DecodedFrame ld;
      wire::ServerMessage lm;
      if (decode_frame(left, kServerChunkField, peer, &ld, &lm).ok() && !ld.is_chunk && lm.has_update_ack() &&
          !lm.update_ack().accepted()) {
        return Status(StatusCode::kAborted,
                      fmt::format("server {} rejected the update of {}: {}", peer, role, lm.update_ack().message()));
      }
    }
    const grpc::Status ended = stream->Finish();
    // CANCELLED: the server dropped this client at a deadline (it stalled,
    // or its link did): a new session rejoins from the next round.
    if (ended.error_code() != grpc::StatusCode::UNAVAILABLE && ended.error_code() != grpc::StatusCode::CANCELLED) {
      return Status(StatusCode::kAborted,
                    fmt::format("{}; the server ended this client's session ({}{}{})", finished.status().message(),
                                static_cast<int>(ended.error_code()), ended.error_message().empty() ? "" : ": ",
                                ended.error_message()));
    }
    MEMFL_RETURN_IF_ERROR(reconnect(finished.status()));
  }
  out.Clear();
  out.mutable_bye();
  (void)write(*stream, out, peer);
  stream->WritesDone();
  grpc::Status fin = stream->Finish();
  (void)fin;  // the server may already have shut down; the rounds are what counts

  nlohmann::ordered_json summary;
  summary["role"] = role;
  summary["rounds"] = rounds;
  summary["malloc_policy"] = malloc_policy();
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["before_model_rss_bytes"] = before_model_rss;
  summary["peak_rss_bytes"] = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n"));
  return Status::Ok();
}

}  // namespace memfl
