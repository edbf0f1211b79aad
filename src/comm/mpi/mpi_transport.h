// The MPI transport: how memfl's ranks talk, whatever each one runs. Control
// messages (register, ModelBegin, ModelReceived, UpdateMeta) are small
// point-to-point messages with the tags below; a model's bytes go as chunk
// streams (ServerStreams on rank 0, ClientStreams on the client ranks):
// a header message (layout hash, offset, length, xxh3), then the bytes, sent
// from the arena and received straight into the destination arena
// (downloads) or a small ring folded into the running sum by a worker thread
// (uploads), several chunks in flight each way — or, when every rank shares
// the server's node, through a shared-memory ring of chunk slots
// (SharedRing) with only the headers as messages. MpiServerTransport puts the
// server's side behind memfl::ServerTransport, for the round driver.
// roles/mpi_roles.cpp wires the ranks (who runs what, in which order) on top.
//
// Only the main thread of a rank calls MPI (MPI_THREAD_FUNNELED). A peer's
// wrong bytes end the job (abort_job), as a dead rank does.
//
//   SharedRing shm = open_shared_ring(cfg, rank);  // collective
//   ServerStreams streams(layout, model, chunk, shm);           // rank 0
//   MpiServerTransport transport(cfg, layout, streams, world);  // for RoundDriver
//   ...
//   ClientStreams streams(layout, chunk, shm, rank);            // ranks 1..N
//   streams.receive_model(arena);
//   streams.send_update(arena);
//   ...
//   close_shared_ring(shm);
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/mpi/mpi_detail.h"
#include "config/config.h"
#include "comm/client_transport.h"
#include "comm/transport.h"
#include "tensor/arena.h"
#include "tensor/layout.h"
#include "tensor/sharded_model_io.h"

namespace memfl {

// The tags of memfl's MPI messages (MPI_COMM_WORLD).
enum MpiTag : int {
  kTagRegister = 1,
  kTagModelBegin,
  kTagChunkHeader,
  kTagChunkData,
  kTagModelReceived,
  kTagUpdateMeta,
  kTagSlotHeader,     // shared-memory ring: a chunk is in slot s (WireSlotHeader)
  kTagSlotDone,       // a client has copied slot s out (download)
  kTagSlotGrant,      // the server lends slot s to a client (upload)
  kTagBye,            // a client rank has written its outputs after the last round
  kTagExcluded,       // the run ended without this client rank (a stall, a refused update)
  kTagSecAggRequest,  // secure aggregation: a stage's request (length, then bytes; length 0: stages over)
  kTagSecAggReply,    // a client rank's reply to it (length, then bytes)
};

// The server's word to each client rank at a round's start (kTagModelBegin):
// whether it takes part, or whether the run is over.
struct WireModelBegin {
  int32_t round, finished, participate;
  int32_t local_steps;  // asynchronous (FedCompass): this trip's local steps (0: the config's)
  uint64_t layout_hash, total_bytes;
};
// A client's metadata ahead of its update's bytes (kTagUpdateMeta).
// The update report's map (comm/update_report.h) in a fixed struct:
// kWireMetricNames[i] is in values[i] where bit i of `present` is set.
inline constexpr const char* kWireMetricNames[] = {"train_loss", "train_accuracy", "val_samples",
                                                   "val_loss",   "val_accuracy",   "local_steps",
                                                   "dp_steps",   "dp_sample_rate", "epsilon"};
inline constexpr size_t kWireMetrics = sizeof(kWireMetricNames) / sizeof(kWireMetricNames[0]);
struct WireUpdateMeta {
  int32_t round, client;
  double sample_count;
  uint32_t present;
  double values[kWireMetrics];
};
// The metadata of `meta`'s report (the names above; others are not sent).
WireUpdateMeta wire_update_meta(int round, int client, double sample_count,
                                const std::map<std::string, double>& metrics);
// The named values a WireUpdateMeta carries, for decode_update_report.
std::vector<std::pair<std::string, double>> wire_metrics(const WireUpdateMeta& md);

// A peer's wrong bytes are not survivable in an MPI job (no rank can leave
// it alone): abort every rank with a message that names the culprit.
[[noreturn]] void abort_job(const std::string& why);

// A rank the server excluded for a stall is told so at the end of the run:
// by a message (kTagExcluded), which reaches it on any host once its link
// carries packets again, and by SIGUSR1 as well when it runs on the
// server's host (a rank stopped by SIGSTOP reads no message; it gets
// SIGCONT too). Its waits, and its abort_job once it knows, then throw
// RankExcluded instead, and the rank leaves through MPI_Finalize, so the
// job ends normally: OpenMPI's MPI_Finalize waits for every rank of the
// job, and mpirun was seen to hang or crash when the job was aborted
// around such a rank.
struct RankExcluded {};
// On a client rank, before its first wait: take the notice either way.
void install_exclusion_notice();
// On rank 0, once every round is written: the message to each rank of
// `ranks`, waited for until it is handed to MPI (its delivery needs the
// rank's link, as the job's end does).
void send_exclusion_notices(const std::vector<int>& ranks);

// Blocking receive of a small control message, waiting quietly.
void quiet_recv(void* buf, int bytes, int source, int tag);

// The rank that hosts virtual client `client` (APPFL's convention: rank r
// hosts clients (r−1)·k … (r−1)·k + k − 1).
int rank_of_client(int client, int per_rank);

// The shared-memory ring: when every rank runs on the server's node, chunks
// pass through `slots` slots of one MPI-3 shared window that the server
// allocates, and only small control messages go point to point. Over
// MPI's own shared-memory transport a chunk costs a single copy done by the
// receiver, at 5.4 GB/s here (CMA); through the ring each side does a plain
// memcpy (12 GB/s here) and the server folds from its own copy. Nothing in
// a slot is trusted: the reader copies a slot into memory only it can
// write (the client's arena; the server's receive ring) and checks the
// header and the xxh3 on that copy, so a peer that scribbles on a slot
// later changes nothing that was checked.
struct SharedRing {
  MPI_Win win = MPI_WIN_NULL;
  std::byte* base = nullptr;
  size_t slot_bytes = 0, slots = 0;
  int ranks_on_node = 1;  // ranks sharing this rank's node, itself included (ring on or off)
  bool enabled() const { return base != nullptr; }
  std::byte* slot(size_t i) const { return base + i * slot_bytes; }
  // The unified memory model's fence between the slot's bytes and the
  // message that announces them (writer before sending, reader after).
  void sync() const { MPI_Win_sync(win); }
};

// Collective over all ranks. Off (p2p chunks) unless the config allows it,
// every rank shares the server's node, and a chunk fits a slot.
SharedRing open_shared_ring(const ExperimentConfig& cfg, int rank);

// Frees the ring's window (a no-op when the ring is off).
void close_shared_ring(SharedRing& ring);

// The server's chunk streams of a round, through the shared-memory ring or
// point to point. A peer's bad bytes end the job (abort_job names the peer
// and the check that failed).
class ServerStreams {
 public:
  // `framed`: updates arrive as compressed frames (compress/frame.h), one
  // per chunk, each at most chunk + kMaxFrameOverhead bytes.
  ServerStreams(const Layout& layout, size_t chunk, const SharedRing& shm, bool framed = false);

  // Sends `global` (the round's global model: a file-backed one is mapped
  // afresh every round) to every rank in `ranks` at once. A rank that leaves
  // a chunk untaken for `stall` is dropped from the stream (the others go
  // on); the dropped ranks are returned.
  std::vector<int> broadcast(const std::vector<int>& ranks, const Arena& global, std::chrono::seconds stall);

  // Receives rank `r`'s update (the whole model's bytes) into `update` and
  // commits it, in the order of the calls. kUnavailable when the rank
  // leaves the stream without a chunk for `stall` (it is not committed).
  Status receive_update(int r, const std::string& peer, const std::shared_ptr<UpdateStream>& update,
                        std::chrono::seconds stall);

  // One rank's update in a batch received together.
  struct Incoming {
    int rank;
    std::string peer;
    std::shared_ptr<UpdateStream> update;
  };
  // How many updates receive_updates takes at once: through the ring, as
  // many as leave each rank two slots (its fill overlaps the server's fold);
  // point to point, one (the fold worker takes one update at a time).
  size_t max_together() const;
  // Receives the updates of `batch` (one per rank, in fold order) together:
  // chunk i of each in turn, in that order, each rank filling its own share
  // of the ring's slots. So the ranks copy at once, and each update's fold
  // of chunk i finds the running sum's chunk i in cache from the update
  // before it, which folded it a moment ago (the aggregator lets an update
  // fold behind one fed by the same thread once that one has folded the
  // range). Commits each update that arrives whole; returns one status per
  // entry, kUnavailable for a rank that left the stream without a chunk for
  // `stall`: its update is closed uncommitted there and then (the
  // aggregator withdraws it, and the others go on).
  std::vector<Status> receive_updates(std::vector<Incoming>& batch, std::chrono::seconds stall);

  // Returns once every update received is folded and committed.
  void drain();

 private:
  size_t length(size_t i) const;
  std::vector<int> broadcast_through_ring(const std::vector<int>& ranks, const Arena& global,
                                          std::chrono::seconds stall);
  std::vector<int> broadcast_point_to_point(const std::vector<int>& ranks, const Arena& global,
                                            std::chrono::seconds stall);
  std::vector<Status> receive_through_ring(std::vector<Incoming>& batch, std::chrono::seconds stall);
  Status receive_point_to_point(int r, const std::string& peer, const std::shared_ptr<UpdateStream>& update,
                                std::chrono::seconds stall);

  const Layout& layout_;
  const size_t chunk_, nchunks_, depth_;
  const SharedRing& shm_;
  const bool framed_;
  mpi_detail::BufferRing ring_;       // point to point: received chunks waiting for the fold worker
  mpi_detail::OrderedWorker worker_;  // point to point: checks and folds while the MPI thread receives
  // Headers of broadcasts in which a rank was dropped: its sends were let
  // go, not finished, and may still read them.
  std::vector<std::vector<mpi_detail::WireHeader>> retired_headers_;
  std::vector<std::vector<mpi_detail::WireSlotHeader>> retired_slot_headers_;
};

// A client rank's chunk streams: the global model in, each update out.
class ClientStreams {
 public:
  // Streams of `layout`'s bytes in chunks of `chunk` bytes; `rank` names this rank in errors.
  ClientStreams(const Layout& layout, size_t chunk, const SharedRing& shm, int rank);

  // Receives the global model into `into`; returns once every chunk passed
  // its checks (the model is not used before).
  void receive_model(Arena& into);

  // Sends the update in `model` (after its WireUpdateMeta).
  void send_update(const Arena& model);
  // The same as compressed frames: one per chunk, each from place.frame(),
  // one at a time (the place reuses its buffer).
  void send_frames(ModelPlace& place);

  // The same for a model sharded over ranks (a client with num_gpus > 1):
  // each chunk passes through one chunk-sized buffer on its way to or from
  // the ranks that own its bytes, one chunk at a time, checked as above.
  void receive_model(ShardedModelIo& into);
  void send_update(ShardedModelIo& model);

 private:
  uint64_t length_at(uint64_t offset) const;
  void receive_through_ring(Arena& into);
  void receive_point_to_point(Arena& into);
  void send_through_ring(const Arena& model);
  void send_point_to_point(const Arena& model);
  void fill_next_slot(uint64_t off, const std::byte* src, uint64_t len);

  const Layout& layout_;
  const size_t chunk_, depth_;
  const SharedRing& shm_;
  const int rank_;
};

// The MPI transport of the server core (rank 0): ModelBegin to every rank,
// the chunk streams to the participating ones; updates are taken in the
// order ranks send them (whichever rank's metadata comes first), and fold or
// park as they stream (aggregate/fedavg_aggregator.h).
class MpiServerTransport final : public ServerTransport {
 public:
  // Over `world` ranks (rank 0 is this server), with `streams` for the bytes.
  MpiServerTransport(const ExperimentConfig& cfg, const Layout& layout, ServerStreams& streams, int world)
      : cfg_(cfg), layout_(layout), streams_(streams), world_(world) {}
  std::string_view name() const override { return "mpi"; }
  bool broadcast_done_before_collect() const override { return true; }

  Status broadcast(int round, const std::vector<int>& selected, const Arena&, BroadcastResult* out) override;
  Status collect(int round, const std::vector<int>& selected, const Arena&, UpdateOpener& agg,
                 CollectResult* out) override;
  // Tells every rank still in that the run is over, and waits (a while) for
  // their Bye: they have written their outputs.
  void finish(int) override;
  // Ranks that missed a deadline: out of the run (MPI cannot take a rank
  // back, and one that stalls would hang MPI_Finalize).
  std::vector<int> excluded_ranks() const;
  int connected_clients() override {
    const int out = static_cast<int>(std::count(excluded_.begin(), excluded_.end(), true));
    return (world_ - 1 - out) * cfg_.server.clients_per_rank;
  }
  // The most updates received together in one batch so far (summary.json:
  // updates_received_together).
  size_t most_received_together() const { return most_together_; }
  // For the tests: before it looks for updates, the upload waits until
  // every rank still in the round has announced its own, for `hold` at
  // most (MEMFL_HOLD_COLLECT_MS), so that the updates are received together.
  void set_collect_hold(std::chrono::milliseconds hold) { collect_hold_ = hold; }
  // Asynchronous FL (one client per rank): a rank gets the model as it is
  // when its previous update was applied (FedCompass: when its group was),
  // with its local steps; its update, checked chunk by chunk into a spool
  // slot, goes to `core` whole. Deadlines of FedCompass groups are kept
  // between probes. Returns after options.total updates, once the ranks
  // still training have sent theirs (not applied); finish() then ends them.
  Status serve_async(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options);
  // Secure aggregation's stages as opaque bytes (roles/mpi_server.cpp makes
  // them a secagg RemoteSecAggChannel): `request` to the rank of `client`,
  // and its reply, secure_aggregation.timeout seconds at most (0: the
  // upload's deadline) — a rank that does not answer is out of the run.
  StatusOr<std::string> secagg_exchange(int client, std::string request);
  // The round's stages are over: ranks still waiting for an unmasking
  // request (their clients were not asked) are told so.
  void secagg_end_round();
  void secagg_drop(int client, const std::string& why);

 private:
  void exclude(int rank, int round, const std::string& why);
  void hold_until_announced(const std::vector<int>& ranks);
  bool send_model_to(int rank, int round, int local_steps, const Arena& global);
  const ExperimentConfig& cfg_;
  const Layout& layout_;
  ServerStreams& streams_;
  int world_;
  std::vector<bool> excluded_;    // by rank
  int round_ = 0;                 // the current round
  std::vector<int> round_ranks_;  // its participating ranks
  size_t most_together_ = 0;
  std::chrono::milliseconds collect_hold_{0};
};

}  // namespace memfl
