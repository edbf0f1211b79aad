#include "roles/mpi_roles.h"

#include <mpi.h>

#include <sys/prctl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "memory/sampler.h"
#include "client/client_work.h"
#include "server/global_model.h"
#include "io/run_dir.h"
#include "schedule/scheduler.h"
#include "server/round_driver.h"
#include "server/transport.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

enum Tag : int {
  kTagRegister = 1,
  kTagModelBegin,
  kTagChunkHeader,
  kTagChunkData,
  kTagModelReceived,
  kTagUpdateMeta,
  kTagSlotHeader,  // shared-memory ring: a chunk is in slot s (WireSlotHeader)
  kTagSlotDone,    // a client has copied slot s out (download)
  kTagSlotGrant,   // the server lends slot s to a client (upload)
};

struct WireHeader {
  uint64_t layout_hash, offset, length, checksum;
};
struct WireSlotHeader {
  uint64_t layout_hash, offset, length, checksum;
  int32_t slot, pad;
};
struct WireModelBegin {
  int32_t round, finished, participate, pad;
  uint64_t layout_hash, total_bytes;
};
struct WireUpdateMeta {
  int32_t round, client;
  double sample_count, train_loss, val_accuracy;
};

// A peer's wrong bytes are not survivable in an MPI job (no rank can leave
// it alone): abort every rank with a message that names the culprit.
[[noreturn]] void abort_job(const std::string& why) {
  spdlog::critical("{}", why);
  std::fflush(nullptr);
  MPI_Abort(MPI_COMM_WORLD, 4);
  std::abort();
}

// Waiting without taking a core from the ranks that work. With N + 1 ranks
// on a few cores, a rank that spins in MPI_Wait (OpenMPI polls) takes the
// CPU from the ranks doing the work. What a wait should do depends on who
// moves the bytes: over shared memory the receiver copies (single copy), so
// a receiver's test is work and it yields between tests (a sleeping vCPU
// takes tens of microseconds to wake); a sender whose chunks are posted
// ahead has nothing to do until the receiver is done with them, so it
// sleeps. Either way, after `yield_us` the sleep backs off to `max_sleep_us`
// (a round's start, a client's training).
struct WaitStyle {
  int yield_us;
  int max_sleep_us;
};
constexpr WaitStyle kIdle{100, 1000};      // waiting for a round, a client's training, an ack
constexpr WaitStyle kReceiver{2000, 200};  // a chunk stream's receiving side: this rank copies
constexpr WaitStyle kSender{0, 200};       // a chunk stream's sending side: chunks are posted ahead

void quiet_waitall(int n, MPI_Request* reqs, MPI_Status* statuses, WaitStyle style) {
  int done = 0;
  for (int i = 0; i < 32; ++i) {
    MPI_Testall(n, reqs, &done, statuses);
    if (done) return;
  }
  const auto yield_until = Clock::now() + std::chrono::microseconds(style.yield_us);
  for (int sleep_us = 5;;) {
    MPI_Testall(n, reqs, &done, statuses);
    if (done) return;
    if (Clock::now() < yield_until) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(2 * sleep_us, style.max_sleep_us);
    }
  }
}

// Blocking receive of a small control message, waiting quietly.
void quiet_recv(void* buf, int bytes, int source, int tag) {
  MPI_Request req;
  MPI_Irecv(buf, bytes, MPI_BYTE, source, tag, MPI_COMM_WORLD, &req);
  quiet_waitall(1, &req, MPI_STATUS_IGNORE, kIdle);
}

// The same for the threads of the server: yield a while before blocking, so
// a hand-over between the MPI thread and the fold worker (one per chunk)
// does not wait for a halted vCPU to wake.
template <typename Ready>
void yield_until_ready(const Ready& ready, int yield_us) {
  const auto until = Clock::now() + std::chrono::microseconds(yield_us);
  while (!ready() && Clock::now() < until) std::this_thread::yield();
}

constexpr int kHandOverYieldUs = 500;

// Chunks in flight per stream: enough to keep the single-copy engine busy
// while the other side checks the previous ones, bounded so the ring costs
// at most ≈ 8 MiB (and two chunks when chunks are larger).
size_t chunks_in_flight(size_t chunk) {
  return std::clamp<size_t>((size_t{8} << 20) / std::max<size_t>(chunk, 1), 2, 8);
}

// A thread that runs tasks in the order they are queued, beside the MPI
// thread. The server verifies (xxh3) and folds chunks on it while the MPI
// thread receives the next ones, and a client checks the chunks it has while
// the next ones arrive: over shared memory the receiver does the copy, so
// the copy and the check each get a core. Order is kept, so clients still
// fold in selection order (bit-for-bit the in-process result). Only the main
// thread calls MPI (MPI_THREAD_FUNNELED); the first failure is kept for it,
// and it aborts the job.
class OrderedWorker {
 public:
  OrderedWorker() : thread_([this] { loop(); }) {}
  ~OrderedWorker() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<Status()> task) {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(std::move(task));
      pending_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }
  // Waits until every queued task ran; the first failure, if any.
  Status drain() {
    std::unique_lock lock(mu_);
    idle_cv_.wait(lock, [&] { return tasks_.empty() && !busy_; });
    return error_;
  }
  Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  void loop() {
    std::unique_lock lock(mu_);
    while (true) {
      if (tasks_.empty() && !stop_) {
        lock.unlock();
        yield_until_ready([&] { return pending_.load(std::memory_order_acquire) > 0; }, kHandOverYieldUs);
        lock.lock();
      }
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      pending_.fetch_sub(1, std::memory_order_relaxed);
      busy_ = true;
      lock.unlock();
      Status s = task();  // tasks run even after a failure: they hand their buffers back
      lock.lock();
      if (!s.ok() && error_.ok()) error_ = s;
      busy_ = false;
      if (tasks_.empty()) idle_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<Status()>> tasks_;
  Status error_;
  std::atomic<size_t> pending_{0};  // tasks_.size(), readable without the lock
  bool busy_ = false, stop_ = false;
  std::thread thread_;
};

// Buffers of the server's receive ring, handed back by the fold worker.
class BufferRing {
 public:
  BufferRing(size_t count, size_t bytes) : buffers_(count, std::vector<std::byte>(bytes)) {
    for (size_t i = 0; i < count; ++i) free_.push_back(i);
    free_count_ = count;
  }
  size_t acquire() {
    yield_until_ready([&] { return free_count_.load(std::memory_order_acquire) > 0; }, kHandOverYieldUs);
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    const size_t i = free_.front();
    free_.pop_front();
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    return i;
  }
  std::optional<size_t> try_acquire() {
    std::lock_guard lock(mu_);
    if (free_.empty()) return std::nullopt;
    const size_t i = free_.front();
    free_.pop_front();
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    return i;
  }
  void release(size_t i) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(i);
      free_count_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
  }
  std::byte* data(size_t i) { return buffers_[i].data(); }
  size_t size() const { return buffers_.size(); }

 private:
  std::vector<std::vector<std::byte>> buffers_;
  std::deque<size_t> free_;
  std::atomic<size_t> free_count_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

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
  bool enabled() const { return base != nullptr; }
  std::byte* slot(size_t i) const { return base + i * slot_bytes; }
  // The unified memory model's fence between the slot's bytes and the
  // message that announces them (writer before sending, reader after).
  void sync() const { MPI_Win_sync(win); }
};

constexpr size_t kMaxSharedSlot = size_t{8} << 20;

// Collective over all ranks. Off (p2p chunks) unless the config allows it,
// every rank shares the server's node, and a chunk fits a slot.
SharedRing open_shared_ring(const ExperimentConfig& cfg, int rank) {
  SharedRing ring;
  const size_t chunk = transfer_chunk_bytes(true, cfg.server.model_chunk_size, kMaxTransferChunk);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int here = rank == 0 ? 1 : 0, server_here = 0, everywhere = 0;
  MPI_Allreduce(&here, &server_here, 1, MPI_INT, MPI_MAX, node);
  MPI_Allreduce(&server_here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!cfg.server.mpi_shared_memory || !everywhere || !cfg.server.use_model_chunking || chunk > kMaxSharedSlot) {
    MPI_Comm_free(&node);
    return ring;
  }
  ring.slots = chunks_in_flight(chunk);
  ring.slot_bytes = chunk;
  void* mine = nullptr;
  const MPI_Aint bytes = rank == 0 ? static_cast<MPI_Aint>(ring.slots * chunk) : 0;
  MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, node, &mine, &ring.win);
  MPI_Aint size = 0;
  int disp = 0;
  void* base = nullptr;
  MPI_Win_shared_query(ring.win, 0, &size, &disp, &base);  // node rank 0 is world rank 0: one node, same order
  MPI_Win_lock_all(MPI_MODE_NOCHECK, ring.win);
  ring.base = static_cast<std::byte*>(base);
  MPI_Comm_free(&node);
  return ring;
}

void close_shared_ring(SharedRing& ring) {
  if (ring.win == MPI_WIN_NULL) return;
  MPI_Win_unlock_all(ring.win);
  MPI_Win_free(&ring.win);
  ring.base = nullptr;
}

int rank_of_client(int client, int per_rank) { return 1 + client / per_rank; }

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The round's selection, known to every rank from the config and the seed.
std::vector<int> selection(const ExperimentConfig& cfg, int round) {
  return select_clients(cfg.server.num_clients, cfg.server.clients_per_round, cfg.server.seed, round);
}

struct RankState {
  MemorySampler sampler;
  std::string dir;
  WriteMemoryOnExit write_on_exit{sampler, dir};
  RankState(const std::string& role, int interval, std::string d) : sampler(role, interval), dir(std::move(d)) {
    sampler.start();
  }
};

// The server's chunk streams of a round, through the shared-memory ring or
// point to point. A peer's bad bytes end the job (abort_job names the peer
// and the check that failed).
class ServerStreams {
 public:
  // `model` is read at each broadcast: a file-backed global model is
  // mapped afresh every round.
  ServerStreams(const Layout& layout, LocalModel& model, size_t chunk, const SharedRing& shm)
      : layout_(layout),
        model_(model),
        chunk_(chunk),
        nchunks_((layout.total_bytes() + chunk - 1) / chunk),
        depth_(chunks_in_flight(chunk)),
        shm_(shm),
        ring_(depth_, shm.enabled() ? 0 : chunk) {}

  // Sends the global model to every rank in `ranks` at once.
  void broadcast(const std::vector<int>& ranks) {
    if (shm_.enabled()) {
      broadcast_through_ring(ranks);
    } else {
      broadcast_point_to_point(ranks);
    }
  }

  // Receives rank `r`'s update (the whole model's bytes) into `update` and
  // commits it, in the order of the calls.
  void receive_update(int r, const std::string& peer, const std::shared_ptr<UpdateStream>& update) {
    if (shm_.enabled()) {
      receive_through_ring(r, peer, *update);
      if (Status s = update->commit(); !s.ok()) abort_job(s.message());
    } else {
      receive_point_to_point(r, peer, update);
      worker_.push([update] { return update->commit(); });
    }
  }

  // Returns once every update received is folded and committed.
  void drain() {
    if (Status e = worker_.drain(); !e.ok()) abort_job(e.message());
  }

 private:
  size_t length(size_t i) const { return std::min(chunk_, layout_.total_bytes() - i * chunk_); }

  // Chunk i goes to slot i mod slots once every rank that read the slot's
  // last chunk said so; the header names the slot. One pass copies the
  // chunk and takes its xxh3.
  void broadcast_through_ring(const std::vector<int>& ranks) {
    const size_t slots = shm_.slots;
    std::vector<WireSlotHeader> headers(slots);
    std::vector<int32_t> done(slots * ranks.size());
    std::vector<std::vector<MPI_Request>> in_use(slots);
    auto settle = [](std::vector<MPI_Request>& reqs) {
      if (!reqs.empty()) quiet_waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE, kReceiver);
      reqs.clear();
    };
    for (size_t i = 0; i < nchunks_; ++i) {
      const size_t sl = i % slots, off = i * chunk_, len = length(i);
      auto& reqs = in_use[sl];
      settle(reqs);
      const uint64_t sum = copy_with_checksum(shm_.slot(sl), model_.arena().data() + off, len, ChecksumSide::kSource);
      shm_.sync();
      WireSlotHeader& h = headers[sl];
      h = {layout_.hash(), off, len, sum, static_cast<int32_t>(sl), 0};
      for (size_t j = 0; j < ranks.size(); ++j) {
        reqs.emplace_back();
        MPI_Isend(&h, sizeof h, MPI_BYTE, ranks[j], kTagSlotHeader, MPI_COMM_WORLD, &reqs.back());
        reqs.emplace_back();
        MPI_Irecv(&done[sl * ranks.size() + j], 1, MPI_INT32_T, ranks[j], kTagSlotDone, MPI_COMM_WORLD, &reqs.back());
      }
    }
    for (auto& reqs : in_use) settle(reqs);
  }

  // Up to `depth` chunks in flight, each sent to every participating rank
  // at once; the next chunk's checksum is taken while they move.
  void broadcast_point_to_point(const std::vector<int>& ranks) {
    std::vector<WireHeader> headers(depth_);
    std::vector<std::vector<MPI_Request>> in_flight(depth_);
    auto settle = [](std::vector<MPI_Request>& reqs) {
      if (!reqs.empty()) quiet_waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE, kSender);
      reqs.clear();
    };
    for (size_t i = 0; i < nchunks_; ++i) {
      auto& reqs = in_flight[i % depth_];
      settle(reqs);  // the slot's header and bytes are free again
      const size_t off = i * chunk_, len = length(i);
      auto bytes = model_.arena().bytes(off, len);
      WireHeader& h = headers[i % depth_];
      h = {layout_.hash(), off, len, chunk_checksum(bytes)};
      for (int r : ranks) {
        reqs.emplace_back();
        MPI_Isend(&h, sizeof h, MPI_BYTE, r, kTagChunkHeader, MPI_COMM_WORLD, &reqs.back());
        reqs.emplace_back();
        MPI_Isend(bytes.data(), static_cast<int>(len), MPI_BYTE, r, kTagChunkData, MPI_COMM_WORLD, &reqs.back());
      }
    }
    for (auto& reqs : in_flight) settle(reqs);
  }

  // The server lends the client the slots, the client fills them in the
  // order lent and names each in a header; this thread checks the chunk in
  // the slot (offset, length, slot here; layout and xxh3 in accept) and
  // folds it from there, then lends the slot again: a client gets a slot
  // back only once its fold is done. (A client that wrote into a slot it no
  // longer holds could change bytes after their check — but such a peer
  // could as well have sent those bytes with their checksum: the checksum
  // guards the transfer, not the sender's intent. Downloads copy first.)
  // The fold runs here, not on the worker: the client copies while this
  // thread folds, one busy thread per process; a third shared a core with
  // one of them on this 2-core machine (measured: half the rounds at half
  // the speed).
  void receive_through_ring(int r, const std::string& peer, UpdateStream& update) {
    std::deque<int32_t> lent;
    auto lend = [&](int32_t sl) {
      MPI_Send(&sl, 1, MPI_INT32_T, r, kTagSlotGrant, MPI_COMM_WORLD);
      lent.push_back(sl);
    };
    for (size_t sl = 0; sl < std::min(shm_.slots, nchunks_); ++sl) lend(static_cast<int32_t>(sl));
    for (size_t i = 0; i < nchunks_; ++i) {
      WireSlotHeader h{};
      MPI_Request rq;
      MPI_Irecv(&h, sizeof h, MPI_BYTE, r, kTagSlotHeader, MPI_COMM_WORLD, &rq);
      quiet_waitall(1, &rq, MPI_STATUS_IGNORE, kReceiver);
      const size_t off = i * chunk_, len = length(i);
      if (h.slot != lent.front() || h.offset != off || h.length != len) {
        abort_job(fmt::format("chunk from {}: slot {} [{}, +{}); expected slot {} [{}, +{})", peer, h.slot, h.offset,
                              h.length, lent.front(), off, len));
      }
      lent.pop_front();
      shm_.sync();
      Status folded = update.accept({h.layout_hash, h.offset, h.length, h.checksum},
                                    std::span<const std::byte>(shm_.slot(static_cast<size_t>(h.slot)), h.length));
      if (!folded.ok()) abort_job(folded.message());
      if (i + shm_.slots < nchunks_) lend(h.slot);
    }
  }

  // Receives into the ring of buffers, up to `depth` chunks ahead; each
  // arrived chunk goes to the fold worker, which checks it (length, offset,
  // layout, xxh3) before a byte of it is folded and hands its buffer back.
  // Over MPI's shared memory this thread does the receive's copy (CMA), so
  // the copy and the fold each get a core.
  void receive_point_to_point(int r, const std::string& peer, const std::shared_ptr<UpdateStream>& update) {
    struct Posted {
      size_t buffer;
      WireHeader header;
      MPI_Request rq[2];
    };
    std::deque<Posted> posted;  // deque: posted requests keep their address
    size_t next = 0;
    auto post = [&](size_t buffer) {
      Posted& p = posted.emplace_back();
      p.buffer = buffer;
      MPI_Irecv(&p.header, sizeof(WireHeader), MPI_BYTE, r, kTagChunkHeader, MPI_COMM_WORLD, &p.rq[0]);
      MPI_Irecv(ring_.data(buffer), static_cast<int>(chunk_), MPI_BYTE, r, kTagChunkData, MPI_COMM_WORLD, &p.rq[1]);
      ++next;
    };
    for (size_t i = 0; i < nchunks_; ++i) {
      if (posted.empty()) post(ring_.acquire());
      while (next < nchunks_ && posted.size() < depth_) {
        auto b = ring_.try_acquire();
        if (!b) break;
        post(*b);
      }
      Posted& p = posted.front();
      MPI_Status status[2];
      quiet_waitall(2, p.rq, status, kReceiver);
      int got = 0;
      MPI_Get_count(&status[1], MPI_BYTE, &got);
      const ChunkHeader h{p.header.layout_hash, p.header.offset, p.header.length, p.header.checksum};
      const size_t buffer = p.buffer;
      posted.pop_front();
      if (static_cast<uint64_t>(got) != h.length) {
        abort_job(fmt::format("chunk from {}: header says {} bytes but {} arrived", peer, h.length, got));
      }
      worker_.push([this, update, h, buffer]() {
        Status s = update->accept(h, std::span<const std::byte>(ring_.data(buffer), h.length));
        ring_.release(buffer);
        return s;
      });
      if (Status e = worker_.error(); !e.ok()) abort_job(e.message());
    }
  }

  const Layout& layout_;
  LocalModel& model_;
  const size_t chunk_, nchunks_, depth_;
  const SharedRing& shm_;
  BufferRing ring_;       // point to point: received chunks waiting for the fold worker
  OrderedWorker worker_;  // point to point: checks and folds while the MPI thread receives
};

// A client rank's chunk streams: the global model in, each update out.
class ClientStreams {
 public:
  ClientStreams(const Layout& layout, size_t chunk, const SharedRing& shm, int rank)
      : layout_(layout), chunk_(chunk), depth_(chunks_in_flight(chunk)), shm_(shm), rank_(rank) {}

  // Receives the global model into `into`; returns once every chunk passed
  // its checks (the model is not used before).
  void receive_model(Arena& into) {
    if (shm_.enabled()) {
      receive_through_ring(into);
    } else {
      receive_point_to_point(into);
    }
  }

  // Sends the update in `model` (after its WireUpdateMeta).
  void send_update(Arena& model) {
    if (shm_.enabled()) {
      send_through_ring(model);
    } else {
      send_point_to_point(model);
    }
  }

 private:
  uint64_t length_at(uint64_t offset) const { return std::min<uint64_t>(chunk_, layout_.total_bytes() - offset); }

  // Each header names the slot the chunk is in; the chunk is copied into
  // the arena at the offset this rank expects next, the slot handed back,
  // and the copy — memory only this rank writes — checked, in the same pass.
  void receive_through_ring(Arena& into) {
    const size_t slots = shm_.slots;
    uint64_t next_offset = 0;
    for (size_t i = 0; next_offset < layout_.total_bytes(); ++i) {
      WireSlotHeader h{};
      MPI_Request rq;
      MPI_Irecv(&h, sizeof h, MPI_BYTE, 0, kTagSlotHeader, MPI_COMM_WORLD, &rq);
      quiet_waitall(1, &rq, MPI_STATUS_IGNORE, kReceiver);
      const uint64_t len = length_at(next_offset);
      if (h.layout_hash != layout_.hash() || h.offset != next_offset || h.length != len ||
          h.slot != static_cast<int32_t>(i % slots)) {
        abort_job(
            fmt::format("rank {}: bad chunk from the server (slot {}, offset {}, length {}; expected slot {}, offset "
                        "{}, length {})",
                        rank_, h.slot, h.offset, h.length, i % slots, next_offset, len));
      }
      shm_.sync();
      const uint64_t sum = copy_with_checksum(into.data() + next_offset, shm_.slot(static_cast<size_t>(h.slot)), len,
                                              ChecksumSide::kDestination);
      int32_t sl = h.slot;
      MPI_Send(&sl, 1, MPI_INT32_T, 0, kTagSlotDone, MPI_COMM_WORLD);
      if (sum != h.checksum) {
        abort_job(fmt::format("rank {}: chunk [{}, {}) from the server failed its checksum", rank_, next_offset,
                              next_offset + len));
      }
      next_offset += len;
    }
  }

  // Receives are posted `depth` chunks ahead, each straight into the arena
  // at the offset and length this rank expects next: a peer's header can
  // never steer bytes elsewhere (MPI refuses a longer message). This thread
  // does the receives' copy (CMA); a second one checks each chunk's xxh3,
  // so the two overlap.
  void receive_point_to_point(Arena& into) {
    OrderedWorker checker;
    struct Incoming {
      WireHeader header;
      uint64_t offset, length;
      MPI_Request rq[2];
    };
    std::deque<Incoming> incoming;
    uint64_t next_offset = 0;
    auto post = [&] {
      Incoming& in = incoming.emplace_back();
      in.offset = next_offset;
      in.length = length_at(next_offset);
      MPI_Irecv(&in.header, sizeof(WireHeader), MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD, &in.rq[0]);
      MPI_Irecv(into.data() + in.offset, static_cast<int>(in.length), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD,
                &in.rq[1]);
      next_offset += in.length;
    };
    while (next_offset < layout_.total_bytes() && incoming.size() < depth_) post();
    while (!incoming.empty()) {
      if (Status e = checker.error(); !e.ok()) abort_job(e.message());
      Incoming& in = incoming.front();
      MPI_Status status[2];
      quiet_waitall(2, in.rq, status, kReceiver);
      int got = 0;
      MPI_Get_count(&status[1], MPI_BYTE, &got);
      const WireHeader& h = in.header;
      if (h.layout_hash != layout_.hash() || h.offset != in.offset || h.length != in.length ||
          static_cast<uint64_t>(got) != in.length) {
        abort_job(fmt::format(
            "rank {}: bad chunk from the server (offset {}, length {}, {} bytes; expected offset {}, length {})", rank_,
            h.offset, h.length, got, in.offset, in.length));
      }
      checker.push([&into, rank = rank_, off = in.offset, len = in.length, sum = h.checksum]() -> Status {
        if (chunk_checksum(into.bytes(off, len)) == sum) return Status::Ok();
        return data_loss("rank {}: chunk [{}, {}) from the server failed its checksum", rank, off, off + len);
      });
      incoming.pop_front();
      while (next_offset < layout_.total_bytes() && incoming.size() < depth_) post();
    }
    if (Status e = checker.drain(); !e.ok()) abort_job(e.message());
  }

  // Fills each slot the server lends, in the order lent (copy and xxh3 of
  // the arena in one pass), and says which chunk is in it.
  void send_through_ring(Arena& model) {
    for (uint64_t off = 0; off < layout_.total_bytes(); off += chunk_) {
      int32_t sl = -1;
      MPI_Request rq;
      MPI_Irecv(&sl, 1, MPI_INT32_T, 0, kTagSlotGrant, MPI_COMM_WORLD, &rq);
      quiet_waitall(1, &rq, MPI_STATUS_IGNORE, kReceiver);
      if (sl < 0 || static_cast<size_t>(sl) >= shm_.slots) {
        abort_job(fmt::format("rank {}: the server lent slot {} of {}", rank_, sl, shm_.slots));
      }
      const uint64_t len = length_at(off);
      const uint64_t sum =
          copy_with_checksum(shm_.slot(static_cast<size_t>(sl)), model.data() + off, len, ChecksumSide::kSource);
      shm_.sync();
      WireSlotHeader h{layout_.hash(), off, len, sum, sl, 0};
      MPI_Send(&h, sizeof h, MPI_BYTE, 0, kTagSlotHeader, MPI_COMM_WORLD);
    }
  }

  // Up to `depth` chunks in flight, sent from the arena; the next chunk's
  // checksum is taken while the server pulls the previous ones.
  void send_point_to_point(Arena& model) {
    struct Outgoing {
      WireHeader header;
      MPI_Request rq[2];
    };
    std::deque<Outgoing> outgoing;
    for (uint64_t off = 0; off < layout_.total_bytes(); off += chunk_) {
      if (outgoing.size() == depth_) {
        quiet_waitall(2, outgoing.front().rq, MPI_STATUSES_IGNORE, kSender);
        outgoing.pop_front();
      }
      const uint64_t len = length_at(off);
      auto bytes = model.bytes(off, len);
      Outgoing& o = outgoing.emplace_back();
      o.header = {layout_.hash(), off, len, chunk_checksum(bytes)};
      MPI_Isend(&o.header, sizeof o.header, MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD, &o.rq[0]);
      MPI_Isend(bytes.data(), static_cast<int>(len), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD, &o.rq[1]);
    }
    for (Outgoing& o : outgoing) quiet_waitall(2, o.rq, MPI_STATUSES_IGNORE, kSender);
  }

  const Layout& layout_;
  const size_t chunk_, depth_;
  const SharedRing& shm_;
  const int rank_;
};

// Waits quietly for a message with `tag` from any rank; returns its source.
int quiet_probe_any(int tag) {
  MPI_Status status;
  int flag = 0;
  for (int sleep_us = 5;;) {
    MPI_Iprobe(MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &flag, &status);
    if (flag) return status.MPI_SOURCE;
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(2 * sleep_us, kIdle.max_sleep_us);
  }
}

// The MPI transport of the server core (rank 0): ModelBegin to every rank,
// the chunk streams to the participating ones; updates are taken in the
// order ranks send them (whichever rank's metadata comes first), and fold or
// park as they stream (aggregate/fedavg_aggregator.h).
class MpiServerTransport final : public ServerTransport {
 public:
  MpiServerTransport(const ExperimentConfig& cfg, const Layout& layout, ServerStreams& streams, int world)
      : cfg_(cfg), layout_(layout), streams_(streams), world_(world) {}
  std::string_view name() const override { return "mpi"; }
  bool broadcast_done_before_collect() const override { return true; }

  Status broadcast(int round, const std::vector<int>& selected, const Arena&, BroadcastResult* out) override {
    const int k = cfg_.server.clients_per_rank;
    std::vector<int> ranks;
    for (int c : selected) {
      if (ranks.empty() || ranks.back() != rank_of_client(c, k)) ranks.push_back(rank_of_client(c, k));
    }
    const auto t = Clock::now();
    for (int r = 1; r < world_; ++r) {
      WireModelBegin b{
          round, 0, std::find(ranks.begin(), ranks.end(), r) != ranks.end(), 0, layout_.hash(), layout_.total_bytes()};
      MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
    }
    streams_.broadcast(ranks);
    for (int r : ranks) {
      int32_t ok = 0;
      quiet_recv(&ok, sizeof ok, r, kTagModelReceived);
      out->bytes += layout_.total_bytes() *
                    static_cast<uint64_t>(std::count_if(selected.begin(), selected.end(),
                                                        [&](int c) { return rank_of_client(c, k) == r; }));
    }
    out->seconds = since(t);
    return Status::Ok();
  }

  Status collect(int round, const std::vector<int>& selected, const Arena&, Aggregator& agg,
                 CollectResult* out) override {
    const int k = cfg_.server.clients_per_rank;
    // Upload time runs from the first update's first message to the last
    // byte folded, as for gRPC (the clients' training is not in it).
    std::optional<Clock::time_point> t_up;
    std::vector<bool> done(static_cast<size_t>(cfg_.server.num_clients), false);
    for (size_t n = 0; n < selected.size(); ++n) {
      const int r = quiet_probe_any(kTagUpdateMeta);
      WireUpdateMeta md{};
      quiet_recv(&md, sizeof md, r, kTagUpdateMeta);
      if (!t_up) t_up = Clock::now();
      const bool expected = md.round == round && md.client >= 0 && md.client < cfg_.server.num_clients &&
                            rank_of_client(md.client, k) == r &&
                            std::find(selected.begin(), selected.end(), md.client) != selected.end() &&
                            !done[static_cast<size_t>(md.client)];
      if (!expected) {
        abort_job(fmt::format("rank {} sent an update of client {} round {}, which round {} did not ask of it", r,
                              md.client, md.round, round));
      }
      done[static_cast<size_t>(md.client)] = true;
      const std::string peer = fmt::format("client_{} (rank {})", md.client, r);
      auto opened = agg.open_update(client_id(md.client), md.sample_count);
      if (!opened.ok()) abort_job(opened.status().message());
      std::shared_ptr<UpdateStream> update = std::move(*opened);
      streams_.receive_update(r, peer, update);
      out->bytes_up += layout_.total_bytes();
      ClientUpdateInfo info;
      info.client = md.client;
      info.sample_count = md.sample_count;
      info.train_loss = md.train_loss;
      info.has_validation = true;
      info.val_weight = md.sample_count;
      info.val_accuracy = md.val_accuracy;
      out->committed.push_back(info);
    }
    streams_.drain();
    out->upload_seconds = t_up ? since(*t_up) : 0.0;
    return Status::Ok();
  }

  void finish(int) override {
    for (int r = 1; r < world_; ++r) {
      WireModelBegin b{0, 1, 0, 0, layout_.hash(), layout_.total_bytes()};
      MPI_Send(&b, sizeof b, MPI_BYTE, r, kTagModelBegin, MPI_COMM_WORLD);
    }
  }

 private:
  const ExperimentConfig& cfg_;
  const Layout& layout_;
  ServerStreams& streams_;
  int world_;
};

Status run_server(const ExperimentConfig& cfg, int world, const std::string& dir, bool progress, bool resume,
                  const SharedRing& shm) {
  RankState st("server", cfg.memory.sample_interval_ms, dir);
  st.sampler.mark(0, "setup");
  SchedulerOptions so;
  so.num_clients = cfg.server.num_clients;
  so.clients_per_round = cfg.server.clients_per_round;
  so.seed = cfg.server.seed;
  MEMFL_ASSIGN_OR_RETURN(auto scheduler, make_scheduler(cfg.server.scheduler, so));
  const int64_t baseline = read_rss_bytes();
  std::optional<DatasetSplits> data;
  InputSpec input;
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
  }
  MEMFL_ASSIGN_OR_RETURN(auto global, GlobalModel::create(cfg, input, dir, /*naive=*/false));
  LocalModel& model = global->model();
  const Layout& layout = model.layout();
  const size_t chunk =
      transfer_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes());
  if (chunk > static_cast<size_t>(INT32_MAX))
    return invalid_argument("model_chunk_size must fit an MPI count (< 2 GiB)");
  // Register: every client rank says who it is and how many clients it runs.
  for (int r = 1; r < world; ++r) {
    int32_t reg[2];
    quiet_recv(reg, sizeof reg, r, kTagRegister);
    if (reg[0] != r || reg[1] != cfg.server.clients_per_rank) {
      abort_job(fmt::format("rank {} registered as rank {} with {} clients; expected {}", r, reg[0], reg[1],
                            cfg.server.clients_per_rank));
    }
  }
  ServerStreams streams(layout, model, chunk, shm);
  MpiServerTransport transport(cfg, layout, streams, world);
  RoundDriverOptions dopts;
  dopts.run_dir = dir;
  dopts.role = "mpi server";
  dopts.resume = resume;
  if (cfg.server.do_server_eval && model.replica() != nullptr) {
    dopts.evaluate = [&](int, Arena&) {
      std::vector<uint32_t> idx(data->test.size());
      std::iota(idx.begin(), idx.end(), 0u);
      return model.replica()->evaluate(data->test, idx, cfg.server.eval_batch_size);
    };
  }
  dopts.on_round = [&](const RoundMetrics& m) {
    if (!progress) return;
    fmt::print("mpi round {:>3}/{}  clients {:>3}  test_acc {:.4f}  down {:.2f} GB/s  up {:.2f} GB/s  {:.2f} s\n",
               m.round, cfg.server.num_global_epochs, m.clients, m.test_accuracy,
               m.download_seconds > 0 ? static_cast<double>(m.bytes_down) / m.download_seconds / 1e9 : 0.0,
               m.upload_seconds > 0 ? static_cast<double>(m.bytes_up) / m.upload_seconds / 1e9 : 0.0, m.round_seconds);
    std::fflush(stdout);
  };
  RoundDriver driver(cfg, *global, transport, *scheduler, st.sampler, std::move(dopts));
  Status result = driver.run();
  if (!result.ok()) abort_job(result.message());  // client ranks wait for a round that will not come
  nlohmann::ordered_json summary;
  summary["role"] = "server";
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline;
  summary["peak_rss_bytes"] = std::max(st.sampler.peak_rss(), read_peak_rss_bytes());
  summary["sum_in_place"] = global->aggregator().sums_in_place();
  summary["chunk_path"] = shm.enabled() ? "shared_ring" : "point_to_point";
  return write_text_file(dir + "/summary.json", summary.dump(2) + "\n");
}

Status run_client_rank(const ExperimentConfig& cfg, int rank, const std::string& dir, const SharedRing& shm) {
  RankState st(fmt::format("rank_{}", rank), cfg.memory.sample_interval_ms, dir);
  st.sampler.mark(0, "setup");
  const int64_t baseline = read_rss_bytes();
  const int k = cfg.server.clients_per_rank;
  std::optional<DatasetSplits> data;
  std::vector<ClientPartition> parts;
  InputSpec input;
  ExperimentConfig local = cfg;
  if (local.train.num_threads == 0) local.train.num_threads = 1;  // ranks share the machine's cores
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(parts, make_partitions(cfg, data->train));
  }
  MEMFL_ASSIGN_OR_RETURN(LocalModel model, make_local_model(local, input, /*fill=*/false, cfg.server.seed, dir));
  const Layout& layout = model.layout();
  std::map<int, int64_t> dp_steps;  // DP-SGD steps per virtual client of this rank, for its ε
  // With several virtual clients the rank keeps the round's global model and
  // starts each client from it; with one, the model is received in place.
  Arena global_copy;
  if (k > 1) {
    MEMFL_ASSIGN_OR_RETURN(global_copy,
                           make_model_arena(local, layout.total_bytes(), dir, MemoryCategory::kCommBuffers));
  }
  Arena& into = k > 1 ? global_copy : model.arena();
  int32_t reg[2] = {rank, k};
  MPI_Send(reg, 2, MPI_INT32_T, 0, kTagRegister, MPI_COMM_WORLD);
  const size_t chunk =
      transfer_chunk_bytes(cfg.server.use_model_chunking, cfg.server.model_chunk_size, layout.total_bytes());
  ClientStreams streams(layout, chunk, shm, rank);
  while (true) {
    WireModelBegin b{};
    quiet_recv(&b, sizeof b, 0, kTagModelBegin);
    if (b.finished) break;
    if (!b.participate) continue;
    if (b.layout_hash != layout.hash() || b.total_bytes != layout.total_bytes()) {
      abort_job(fmt::format("rank {}: the server's model (layout {:016x}) is not this rank's ({:016x})", rank,
                            b.layout_hash, layout.hash()));
    }
    st.sampler.mark(b.round, "broadcast");
    streams.receive_model(into);  // every chunk checked: no byte is used before this returns
    int32_t ok = 1;
    MPI_Send(&ok, 1, MPI_INT32_T, 0, kTagModelReceived, MPI_COMM_WORLD);
    for (int c : selection(cfg, b.round)) {
      if (rank_of_client(c, k) != rank) continue;
      if (k > 1) std::memcpy(model.arena().data(), global_copy.data(), layout.total_bytes());
      st.sampler.mark(b.round, "train");
      const ClientPartition* part = parts.empty() ? nullptr : &parts[static_cast<size_t>(c)];
      MEMFL_ASSIGN_OR_RETURN(TrainResult tr, local_update(model, local, data ? &*data : nullptr, part, b.round, c));
      if (cfg.train.dp.enabled) {
        dp_steps[c] += tr.dp_steps;
        MEMFL_RETURN_IF_ERROR(record_client_privacy(cfg, dir, b.round, c, dp_steps[c], tr.dp_sample_rate).status());
      }
      st.sampler.mark(b.round, "upload");
      WireUpdateMeta md{b.round, c, update_sample_count(cfg, part, c), tr.train_loss, tr.val_accuracy};
      MPI_Send(&md, sizeof md, MPI_BYTE, 0, kTagUpdateMeta, MPI_COMM_WORLD);
      streams.send_update(model.arena());
    }
    st.sampler.mark(b.round, "idle");
    // Fault injection for the tests (MEMFL_FAULT=die_after_round_1 on rank
    // MEMFL_FAULT_RANK): the rank dies as a crashed node would.
    const char* fault = std::getenv("MEMFL_FAULT");
    const char* who = std::getenv("MEMFL_FAULT_RANK");
    if (fault != nullptr && std::string(fault) == "die_after_round_1" && b.round == 1 && who != nullptr &&
        std::atoi(who) == rank) {
      std::_Exit(9);
    }
  }
  nlohmann::ordered_json summary;
  summary["role"] = fmt::format("rank_{}", rank);
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline;
  summary["peak_rss_bytes"] = std::max(st.sampler.peak_rss(), read_peak_rss_bytes());
  return write_text_file(dir + "/summary.json", summary.dump(2) + "\n");
}

}  // namespace

Status run_mpi(int* argc, char*** argv, const ExperimentConfig& cfg_in, const MpiOptions& opts) {
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);  // the server's fold worker calls no MPI
  if (provided < MPI_THREAD_FUNNELED) {
    MPI_Finalize();
    return failed_precondition("this MPI library offers no MPI_THREAD_FUNNELED; memfl mpi needs it");
  }
  // Quiet waits sleep a few microseconds at a time: the default 50 µs timer
  // slack would stretch every one of them.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world < 2) {
    MPI_Finalize();
    return invalid_argument("memfl mpi needs at least 2 ranks (server + a client): mpirun -np N+1 memfl mpi CONFIG");
  }
  if (cfg_in.server.client_selection != "random") {
    MPI_Finalize();
    return invalid_argument(
        "server_configs.client_selection: '{}' runs in the in-process simulation; every MPI "
        "rank computes the random selection from the seed",
        cfg_in.server.client_selection);
  }
  if (cfg_in.server.memory_mode != "streaming") {
    MPI_Finalize();
    return invalid_argument("server_configs.memory_mode: '{}' is built for gRPC only; memfl mpi streams",
                            cfg_in.server.memory_mode);
  }
  // APPFL's convention: the client count comes from the world size.
  ExperimentConfig cfg = cfg_in;
  cfg.server.num_clients = (world - 1) * cfg.server.clients_per_rank;
  if (cfg.server.clients_per_round > cfg.server.num_clients) cfg.server.clients_per_round = 0;
  // One run directory for all ranks: rank 0 names it.
  std::string run_dir = opts.run_dir;
  int len = static_cast<int>(run_dir.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  run_dir.resize(static_cast<size_t>(len));
  MPI_Bcast(run_dir.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string dir = fmt::format("{}/rank_{}", run_dir, rank);
  std::error_code ec;
  fs::create_directories(dir, ec);
  MEMFL_RETURN_IF_ERROR(write_text_file(dir + "/config.yaml", cfg.resolved_yaml));
  SharedRing shm = open_shared_ring(cfg, rank);
  Status s =
      rank == 0 ? run_server(cfg, world, dir, opts.progress, opts.resume, shm) : run_client_rank(cfg, rank, dir, shm);
  if (!s.ok()) abort_job(fmt::format("rank {}: {}", rank, s.message()));
  close_shared_ring(shm);
  MPI_Finalize();
  return s;
}

}  // namespace memfl
