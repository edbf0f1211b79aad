// ServerTransport: what the server core needs of a transport (in-process,
// gRPC, MPI) — hand the global model's chunks to the round's clients, and
// feed each client's update, chunk by chunk, into the aggregator as it
// arrives. The round driver (server/round_driver.h) is written once against
// this interface; a transport knows nothing of rounds beyond their number,
// nor of how updates combine (it sees an UpdateOpener). The transports live
// beside it in comm/; the server core includes them, never the reverse.
//
//   BroadcastResult down;
//   MEMFL_RETURN_IF_ERROR(transport.broadcast(round, selected, global_arena, &down));
//   MEMFL_RETURN_IF_ERROR(aggregator.begin_round(round, fold_order));   // an UpdateOpener
//   CollectResult up;
//   MEMFL_RETURN_IF_ERROR(transport.collect(round, selected, aggregator, &up));
#pragma once

#include <string>
#include <vector>

#include <functional>
#include <memory>
#include <span>
#include <utility>

#include "comm/chunk.h"
#include "common/status.h"
#include "tensor/arena.h"

namespace memfl {

// What a client reported with its update (its metadata), and what moving
// its bytes took.
struct ClientUpdateInfo {
  int client = -1;
  double sample_count = 0;  // FedAvg's weight under client_weights_mode: sample_size
  double train_loss = 0, train_accuracy = 0;
  bool has_validation = false;
  double val_weight = 0, val_loss = 0, val_accuracy = 0;
  // DP-SGD: the client's steps this round and their Poisson rate.
  int64_t dp_steps = 0;
  double dp_sample_rate = 0;
  // This client's bytes on the wire this round (frames, when compressed):
  // the model down and its update up. Clients differ when their updates
  // compress differently or some are sent the model's change and others
  // its bytes.
  uint64_t bytes_down = 0, bytes_up = 0;
};

struct BroadcastResult {
  uint64_t bytes = 0;
  double seconds = 0;  // first byte to last, over all clients
};

struct CollectResult {
  std::vector<ClientUpdateInfo> committed;  // updates the aggregator accepted whole
  std::vector<int> failed;                  // selected clients that sent no whole update
  uint64_t bytes_up = 0;
  double upload_seconds = 0;
  // Transports where a client downloads inside collect (the in-process
  // simulation hands the model to a worker only when one is free).
  uint64_t bytes_down = 0;
  double download_seconds = 0;
};

// Where a transport takes each update it receives (the aggregator).
class UpdateOpener {
 public:
  virtual ~UpdateOpener() = default;
  // Opens the upload of `client_id`, whose metadata said `sample_count`.
  virtual StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) = 0;
  // The same for an update handed over inside this process (the simulator's
  // workers): its chunks carry no checksum (0), since their bytes never left
  // memory the process owns, and sizes, offsets and values are checked as
  // for any update. Openers that cannot tell fall back to open_update.
  virtual StatusOr<std::unique_ptr<UpdateStream>> open_local_update(const std::string& client_id, double sample_count) {
    return open_update(client_id, sample_count);
  }
};

// The round's global model as compressed frames of its change from the
// model its clients received the round before
// (compressor_configs.broadcast_compression: lossy), made once by the server
// (compress/broadcast_delta.h) and sent to each client that holds that
// model; the others get the model's bytes.
class BroadcastFrames {
 public:
  virtual ~BroadcastFrames() = default;
  // The frames turn round from_round()'s model into round to_round()'s
  // (−1: none made yet), one per chunk of chunk_bytes() in model order.
  virtual int from_round() const = 0;
  virtual int to_round() const = 0;
  virtual size_t chunk_bytes() const = 0;
  // The frame of the chunk at model offset `offset`, into `buffer`.
  virtual StatusOr<std::span<const std::byte>> frame(uint64_t offset, std::vector<std::byte>* buffer) const = 0;
};

class ServerTransport {
 public:
  virtual ~ServerTransport() = default;
  virtual std::string_view name() const = 0;
  // The most the transport holds for chunks in flight, every client
  // together (a shared pool of chunk buffers): its term of the server's
  // stated bound, which server_configs.memory_budget is checked against.
  virtual uint64_t transfer_buffer_bytes() const { return 0; }
  // Whether broadcast() has finished reading the global arena when it
  // returns, so the arena may become the running sum during collect().
  virtual bool broadcast_done_before_collect() const = 0;
  // Sends `global` to `selected` (client ids, sorted). A client that cannot
  // be reached is dropped from the round (collect reports it as failed); an
  // error return ends the run.
  virtual Status broadcast(int round, const std::vector<int>& selected, const Arena& global, BroadcastResult* out) = 0;
  // Receives the round's updates, in whatever order they come, each through
  // updates.open_update(client_id(c), sample_count); returns when every
  // selected client has committed or failed (or the round's deadline passed).
  virtual Status collect(int round, const std::vector<int>& selected, const Arena& global, UpdateOpener& updates,
                         CollectResult* out) = 0;
  // The run is over (clients are told; the transport may stop).
  virtual void finish(int last_round) = 0;
  // Clients that were out and have come back since the last call (a client
  // process restarted after it died): the driver selects them again.
  virtual std::vector<int> take_rejoined() { return {}; }
  // Clients whose process is connected now (a gRPC session open, an MPI
  // rank still in the job); -1 where clients are not processes.
  virtual int connected_clients() { return -1; }
  // Where the broadcast's frames are, for a transport that sends them
  // (null: none). Set once; read during broadcast().
  virtual void set_broadcast_frames(const BroadcastFrames* /*frames*/) {}
};

// One client update: where its bytes wait and what the server knows of it.
struct AsyncTripRecord {
  int client = -1;
  std::shared_ptr<UpdateSource> update;  // whole and checked
  int64_t base_version = 0;              // the global version it trained from
  double dispatched_at = 0, arrived_at = 0;
  int64_t local_steps = 0;
  double train_loss = 0;
  uint64_t bytes_up = 0;      // the update's bytes on the wire (frames, when compressed)
  int64_t update_number = 0;  // arrival order, from 1 (set by the core)
  std::string how;            // alone | group N | late | buffer
  int64_t staleness = 0;
  double alpha = 0;
};

struct AsyncDispatch {
  int client;
  int local_steps;  // 0: the config's own
};

struct AsyncNext {
  std::vector<AsyncDispatch> send;                // clients to send the model to now
  std::vector<std::pair<double, int>> deadlines;  // FedCompass: (time, group) to call deadline() at
};

// What an asynchronous server's rules offer a transport (server/async_core.h
// implements them; comm/ sees only this): a client's first trip, each
// update as it arrives whole, a FedCompass group's deadline — each answered
// with the clients to send the model to next.
class AsyncUpdateHandler {
 public:
  virtual ~AsyncUpdateHandler() = default;
  virtual int start(int client, double now) = 0;
  virtual StatusOr<AsyncNext> arrive(AsyncTripRecord trip, double now) = 0;
  virtual StatusOr<AsyncNext> deadline(int group, double now) = 0;
  virtual int64_t version() const = 0;
  virtual int64_t arrivals() const = 0;
  // Where an update's bytes go once it is no longer needed.
  virtual void set_release(std::function<void(AsyncTripRecord&)> release) = 0;
  virtual Status flush_log() = 0;
};

// Whether the update that brought the count to `arrivals` is followed by an
// evaluation: after every `every` updates, and after the last of `total`.
inline bool async_eval_due(int64_t arrivals, int64_t every, int64_t total) {
  return arrivals % every == 0 || arrivals >= total;
}

// How a transport serves an asynchronous run (its serve_async).
struct AsyncServeOptions {
  int64_t total = 0;       // client updates to play (num_global_epochs)
  int64_t eval_every = 1;  // on_eval after every this many
  std::string spool_dir;   // where updates wait until they are applied
  // Called with the model unchanged while it runs: the evaluation number,
  // updates so far, seconds since the start.
  std::function<Status(int evaluation, int64_t updates, double seconds)> on_eval;
  // Wraps each update's stream into its spool slot before a chunk is read
  // (compressed updates are decoded there); none: the chunks go as they are.
  std::function<std::unique_ptr<UpdateStream>(std::unique_ptr<UpdateStream> slot, const std::string& peer)> wrap_update;
  bool eval_due(int64_t arrivals) const { return async_eval_due(arrivals, eval_every, total); }
};

// How every transport names client `c` to the aggregator (and in messages).
inline std::string client_id(int c) { return "client_" + std::to_string(c); }

}  // namespace memfl
