// The chunk streams of the MPI transport (comm/mpi/mpi_transport.h): the
// server's (ServerStreams) and a client rank's (ClientStreams), each through
// the shared-memory ring or point to point.
#include <mpi.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/chunk.h"
#include "comm/mpi/mpi_detail.h"
#include "comm/mpi/mpi_transport.h"

namespace memfl {

using mpi_detail::chunks_in_flight;
using mpi_detail::Clock;
using mpi_detail::kReceiver;
using mpi_detail::kSender;
using mpi_detail::OrderedWorker;
using mpi_detail::quiet_waitall;
using mpi_detail::WireHeader;
using mpi_detail::WireSlotHeader;

ServerStreams::ServerStreams(const Layout& layout, size_t chunk, const SharedRing& shm, bool framed)
    : layout_(layout),
      chunk_(chunk),
      nchunks_((layout.total_bytes() + chunk - 1) / chunk),
      depth_(chunks_in_flight(chunk)),
      shm_(shm),
      framed_(framed),
      ring_(depth_, shm.enabled() ? 0 : chunk + (framed ? kMaxFrameOverhead : 0)) {}

std::vector<int> ServerStreams::broadcast(const std::vector<int>& ranks, const Arena& global,
                                          std::chrono::seconds stall) {
  return shm_.enabled() ? broadcast_through_ring(ranks, global, stall) : broadcast_point_to_point(ranks, global, stall);
}

Status ServerStreams::receive_update(int r, const std::string& peer, const std::shared_ptr<UpdateStream>& update,
                                     std::chrono::seconds stall) {
  std::vector<Incoming> one{{r, peer, update}};
  return receive_updates(one, stall).front();
}

size_t ServerStreams::max_together() const { return shm_.enabled() ? std::max<size_t>(shm_.slots / 2, 1) : 1; }

std::vector<Status> ServerStreams::receive_updates(std::vector<Incoming>& batch, std::chrono::seconds stall) {
  if (shm_.enabled()) {
    // Its ranks fill the ring: point to point would wait on chunks that never come.
    assert(batch.size() <= max_together());
    return receive_through_ring(batch, stall);
  }
  std::vector<Status> result;
  for (const Incoming& in : batch) {
    Status s = receive_point_to_point(in.rank, in.peer, in.update, stall);
    if (s.ok()) worker_.push([update = in.update] { return update->commit(); });
    result.push_back(std::move(s));
  }
  return result;
}

namespace {

// One rank's part of a broadcast chunk in flight: its requests, and whether
// it is still in the stream.
struct RankRequests {
  int rank;
  bool in = true;
};

// Waits for the requests of `pending` (two per rank of `who`: `sends` says
// which of each pair are sends); at `deadline` a rank with either request
// unfinished is dropped (its receive cancelled, its send let go) and added
// to `dropped`.
void settle_or_drop(std::vector<MPI_Request>& pending, std::vector<size_t>& who, const bool sends[2],
                    std::vector<RankRequests>& ranks, Clock::time_point deadline, std::vector<int>& dropped,
                    mpi_detail::WaitStyle style) {
  if (pending.empty()) return;
  // A rank dropped at an earlier chunk is not waited for again.
  auto let_go = [&](size_t j) {
    for (int q = 0; q < 2; ++q) {
      MPI_Request* rq = &pending[2 * j + static_cast<size_t>(q)];
      if (sends[q]) {
        mpi_detail::abandon_send(rq);
      } else {
        mpi_detail::cancel_receive(rq);
      }
    }
  };
  for (size_t j = 0; j < who.size(); ++j) {
    if (!ranks[who[j]].in) let_go(j);
  }
  if (!mpi_detail::quiet_waitall_until(static_cast<int>(pending.size()), pending.data(), MPI_STATUSES_IGNORE, style,
                                       deadline)) {
    for (size_t j = 0; j < who.size(); ++j) {
      int done[2] = {0, 0};
      for (int q = 0; q < 2; ++q) MPI_Test(&pending[2 * j + static_cast<size_t>(q)], &done[q], MPI_STATUS_IGNORE);
      if (done[0] && done[1]) continue;
      let_go(j);
      RankRequests& rr = ranks[who[j]];
      if (rr.in) {
        rr.in = false;
        dropped.push_back(rr.rank);
      }
    }
  }
  pending.clear();
  who.clear();
}

}  // namespace

void ServerStreams::drain() {
  if (Status e = worker_.drain(); !e.ok()) abort_job(e.message());
}

size_t ServerStreams::length(size_t i) const { return std::min(chunk_, layout_.total_bytes() - i * chunk_); }

// Chunk i goes to slot i mod slots once every rank that read the slot's
// last chunk said so; the header names the slot. One pass copies the
// chunk and takes its xxh3.
std::vector<int> ServerStreams::broadcast_through_ring(const std::vector<int>& rank_list, const Arena& global,
                                                       std::chrono::seconds stall) {
  const size_t slots = shm_.slots;
  std::vector<WireSlotHeader> headers(nchunks_);  // one per chunk: see broadcast_point_to_point
  std::vector<int32_t> done(slots * rank_list.size());
  std::vector<RankRequests> ranks;
  for (int r : rank_list) ranks.push_back({r});
  std::vector<std::vector<MPI_Request>> in_use(slots);
  std::vector<std::vector<size_t>> who(slots);  // index in `ranks` of each pair of in_use
  std::vector<int> dropped;
  constexpr bool kSendThenReceive[2] = {true, false};
  auto settle = [&](size_t sl) {
    settle_or_drop(in_use[sl], who[sl], kSendThenReceive, ranks, Clock::now() + stall, dropped, kReceiver);
  };
  for (size_t i = 0; i < nchunks_; ++i) {
    const size_t sl = i % slots, off = i * chunk_, len = length(i);
    auto& reqs = in_use[sl];
    settle(sl);
    const uint64_t sum = copy_with_checksum(shm_.slot(sl), global.data() + off, len, ChecksumSide::kSource);
    shm_.sync();
    WireSlotHeader& h = headers[i];
    h = {layout_.hash(), off, len, sum, static_cast<int32_t>(sl), 0};
    for (size_t j = 0; j < ranks.size(); ++j) {
      if (!ranks[j].in) continue;
      who[sl].push_back(j);
      reqs.emplace_back();
      MPI_Isend(&h, sizeof h, MPI_BYTE, ranks[j].rank, kTagSlotHeader, MPI_COMM_WORLD, &reqs.back());
      reqs.emplace_back();
      MPI_Irecv(&done[sl * ranks.size() + j], 1, MPI_INT32_T, ranks[j].rank, kTagSlotDone, MPI_COMM_WORLD,
                &reqs.back());
    }
  }
  for (size_t sl = 0; sl < slots; ++sl) settle(sl);
  // A dropped rank's header sends were let go: their bytes stay (see above).
  if (!dropped.empty()) {
    retired_slot_headers_.push_back(std::move(headers));
  }
  return dropped;
}

// Up to `depth` chunks in flight, each sent to every participating rank
// at once; the next chunk's checksum is taken while they move.
std::vector<int> ServerStreams::broadcast_point_to_point(const std::vector<int>& rank_list, const Arena& global,
                                                         std::chrono::seconds stall) {
  // A header per chunk: a send let go (a dropped rank's) may still read its
  // header, so none is reused, and they outlive the broadcast if one was.
  std::vector<WireHeader> headers(nchunks_);
  std::vector<RankRequests> ranks;
  for (int r : rank_list) ranks.push_back({r});
  std::vector<std::vector<MPI_Request>> in_flight(depth_);
  std::vector<std::vector<size_t>> who(depth_);
  std::vector<int> dropped;
  constexpr bool kBothSends[2] = {true, true};
  auto settle = [&](size_t q) {
    settle_or_drop(in_flight[q], who[q], kBothSends, ranks, Clock::now() + stall, dropped, kSender);
  };
  for (size_t i = 0; i < nchunks_; ++i) {
    auto& reqs = in_flight[i % depth_];
    settle(i % depth_);  // the slot's header and bytes are free again
    const size_t off = i * chunk_, len = length(i);
    auto bytes = global.bytes(off, len);
    WireHeader& h = headers[i];
    h = {layout_.hash(), off, len, chunk_checksum(bytes)};
    for (size_t j = 0; j < ranks.size(); ++j) {
      if (!ranks[j].in) continue;
      who[i % depth_].push_back(j);
      reqs.emplace_back();
      MPI_Isend(&h, sizeof h, MPI_BYTE, ranks[j].rank, kTagChunkHeader, MPI_COMM_WORLD, &reqs.back());
      reqs.emplace_back();
      MPI_Isend(bytes.data(), static_cast<int>(len), MPI_BYTE, ranks[j].rank, kTagChunkData, MPI_COMM_WORLD,
                &reqs.back());
    }
  }
  for (size_t q = 0; q < depth_; ++q) settle(q);
  if (!dropped.empty()) retired_headers_.push_back(std::move(headers));
  return dropped;
}

// The server lends each client of the batch its share of the slots (the
// batch's j-th client slots [j·share, (j + 1)·share)), the client fills them
// in the order lent and names each in a header; this thread checks the chunk in
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
std::vector<Status> ServerStreams::receive_through_ring(std::vector<Incoming>& batch, std::chrono::seconds stall) {
  const size_t n = batch.size(), share = shm_.slots / n;
  std::vector<Status> result(n, Status::Ok());
  std::vector<std::deque<int32_t>> lent(n);  // each rank's slots, in the order it fills them
  auto lend = [&](size_t j, int32_t sl) {
    MPI_Send(&sl, 1, MPI_INT32_T, batch[j].rank, kTagSlotGrant, MPI_COMM_WORLD);
    lent[j].push_back(sl);
  };
  for (size_t j = 0; j < n; ++j) {
    for (size_t k = 0; k < std::min(share, nchunks_); ++k) lend(j, static_cast<int32_t>(j * share + k));
  }
  for (size_t i = 0; i < nchunks_; ++i) {
    for (size_t j = 0; j < n; ++j) {
      if (!result[j].ok()) continue;  // out of the stream: the others go on
      const std::string& peer = batch[j].peer;
      WireSlotHeader h{};
      MPI_Request rq;
      MPI_Irecv(&h, sizeof h, MPI_BYTE, batch[j].rank, kTagSlotHeader, MPI_COMM_WORLD, &rq);
      if (!mpi_detail::quiet_waitall_until(1, &rq, MPI_STATUS_IGNORE, kReceiver, Clock::now() + stall)) {
        mpi_detail::cancel_receive(&rq);
        result[j] = Status(StatusCode::kUnavailable,
                           fmt::format("{}: its update stalled after {} of {} chunks (no chunk for {} s, "
                                       "server_configs.upload_timeout_s)",
                                       peer, i, nchunks_, stall.count()));
        // Closed uncommitted now, the aggregator withdraws it at once, so
        // the updates after it in fold order fold on rather than park.
        batch[j].update.reset();
        continue;
      }
      const size_t off = i * chunk_, len = length(i);
      // A frame stands for the chunk at its offset whatever its own length.
      const bool length_ok = framed_ ? h.length > 0 && h.length <= len + kMaxFrameOverhead : h.length == len;
      if (h.slot != lent[j].front() || h.offset != off || !length_ok) {
        abort_job(fmt::format("chunk from {}: slot {} [{}, +{}); expected slot {} [{}, +{})", peer, h.slot, h.offset,
                              h.length, lent[j].front(), off, len));
      }
      lent[j].pop_front();
      shm_.sync();
      Status folded =
          batch[j].update->accept({h.layout_hash, h.offset, h.length, h.checksum},
                                  std::span<const std::byte>(shm_.slot(static_cast<size_t>(h.slot)), h.length));
      if (!folded.ok()) abort_job(folded.message());
      if (i + share < nchunks_) lend(j, h.slot);
    }
  }
  for (size_t j = 0; j < n; ++j) {
    if (!result[j].ok()) continue;
    if (Status s = batch[j].update->commit(); !s.ok()) abort_job(s.message());
  }
  return result;
}

// Receives into the ring of buffers, up to `depth` chunks ahead; each
// arrived chunk goes to the fold worker, which checks it (length, offset,
// layout, xxh3) before a byte of it is folded and hands its buffer back.
// Over MPI's shared memory this thread does the receive's copy (CMA), so
// the copy and the fold each get a core.
Status ServerStreams::receive_point_to_point(int r, const std::string& peer,
                                             const std::shared_ptr<UpdateStream>& update, std::chrono::seconds stall) {
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
    MPI_Irecv(ring_.data(buffer), static_cast<int>(chunk_ + (framed_ ? kMaxFrameOverhead : 0)), MPI_BYTE, r,
              kTagChunkData, MPI_COMM_WORLD, &p.rq[1]);
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
    if (!mpi_detail::quiet_waitall_until(2, p.rq, status, kReceiver, Clock::now() + stall)) {
      // Every receive posted ahead is cancelled before its buffer goes back.
      for (Posted& q : posted) {
        mpi_detail::cancel_receive(&q.rq[0]);
        mpi_detail::cancel_receive(&q.rq[1]);
        ring_.release(q.buffer);
      }
      return Status(StatusCode::kUnavailable,
                    fmt::format("{}: its update stalled after {} of {} chunks (no chunk for {} s, "
                                "server_configs.upload_timeout_s)",
                                peer, i, nchunks_, stall.count()));
    }
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
  return Status::Ok();
}

ClientStreams::ClientStreams(const Layout& layout, size_t chunk, const SharedRing& shm, int rank)
    : layout_(layout), chunk_(chunk), depth_(chunks_in_flight(chunk)), shm_(shm), rank_(rank) {}

void ClientStreams::receive_model(Arena& into) {
  if (shm_.enabled()) {
    receive_through_ring(into);
  } else {
    receive_point_to_point(into);
  }
}

void ClientStreams::send_update(const Arena& model) {
  if (shm_.enabled()) {
    send_through_ring(model);
  } else {
    send_point_to_point(model);
  }
}

uint64_t ClientStreams::length_at(uint64_t offset) const {
  return std::min<uint64_t>(chunk_, layout_.total_bytes() - offset);
}

// Each header names the slot the chunk is in; the chunk is copied into
// the arena at the offset this rank expects next, the slot handed back,
// and the copy — memory only this rank writes — checked, in the same pass.
void ClientStreams::receive_through_ring(Arena& into) {
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
void ClientStreams::receive_point_to_point(Arena& into) {
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
void ClientStreams::send_through_ring(const Arena& model) {
  for (uint64_t off = 0; off < layout_.total_bytes(); off += chunk_) {
    fill_next_slot(off, model.data() + off, length_at(off));
  }
}

// Waits for the server to lend a slot, copies [src, src + len) — the
// chunk at `off` — into it with its xxh3 in one pass, and names it.
void ClientStreams::fill_next_slot(uint64_t off, const std::byte* src, uint64_t len) {
  int32_t sl = -1;
  MPI_Request rq;
  MPI_Irecv(&sl, 1, MPI_INT32_T, 0, kTagSlotGrant, MPI_COMM_WORLD, &rq);
  quiet_waitall(1, &rq, MPI_STATUS_IGNORE, kReceiver);
  if (sl < 0 || static_cast<size_t>(sl) >= shm_.slots) {
    abort_job(fmt::format("rank {}: the server lent slot {} of {}", rank_, sl, shm_.slots));
  }
  const uint64_t sum = copy_with_checksum(shm_.slot(static_cast<size_t>(sl)), src, len, ChecksumSide::kSource);
  shm_.sync();
  WireSlotHeader h{layout_.hash(), off, len, sum, sl, 0};
  MPI_Send(&h, sizeof h, MPI_BYTE, 0, kTagSlotHeader, MPI_COMM_WORLD);
}

// Up to `depth` chunks in flight, sent from the arena; the next chunk's
// checksum is taken while the server pulls the previous ones.
void ClientStreams::send_point_to_point(const Arena& model) {
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

// Each frame as the chunk it stands for: into the next slot lent, or point
// to point; the place's buffer is reused for the next frame, so one is in
// flight at a time.
void ClientStreams::send_frames(ModelPlace& place) {
  for (uint64_t off = 0; off < layout_.total_bytes(); off += chunk_) {
    auto frame = place.frame(off, length_at(off));
    if (!frame.ok()) abort_job(fmt::format("rank {}: {}", rank_, frame.status().message()));
    const std::span<const std::byte> bytes = *frame;
    if (shm_.enabled()) {
      fill_next_slot(off, bytes.data(), bytes.size());
    } else {
      WireHeader h{layout_.hash(), off, bytes.size(), chunk_checksum(bytes)};
      MPI_Request rq[2];
      MPI_Isend(&h, sizeof h, MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD, &rq[0]);
      MPI_Isend(bytes.data(), static_cast<int>(bytes.size()), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD, &rq[1]);
      quiet_waitall(2, rq, MPI_STATUSES_IGNORE, kSender);
    }
  }
}

// A sharded model's chunks: received whole into one buffer (from the ring
// slot, or point to point at the offset and length this rank expects),
// checked, then written to the shards; or read from the shards into the
// buffer and sent. One chunk at a time: the shards' ranks take part in every
// chunk's collective, and a chunk-sized buffer is all this rank holds.
void ClientStreams::receive_model(ShardedModelIo& into) {
  std::vector<std::byte> buf;
  for (uint64_t off = 0, i = 0; off < layout_.total_bytes(); ++i) {
    const uint64_t len = length_at(off);
    buf.resize(len);
    uint64_t sum = 0, expected = 0;
    if (shm_.enabled()) {
      WireSlotHeader h{};
      MPI_Request rq;
      MPI_Irecv(&h, sizeof h, MPI_BYTE, 0, kTagSlotHeader, MPI_COMM_WORLD, &rq);
      quiet_waitall(1, &rq, MPI_STATUS_IGNORE, kReceiver);
      if (h.layout_hash != layout_.hash() || h.offset != off || h.length != len ||
          h.slot != static_cast<int32_t>(i % shm_.slots)) {
        abort_job(
            fmt::format("rank {}: bad chunk from the server (slot {}, offset {}, length {}; expected slot {}, "
                        "offset {}, length {})",
                        rank_, h.slot, h.offset, h.length, i % shm_.slots, off, len));
      }
      shm_.sync();
      sum = copy_with_checksum(buf.data(), shm_.slot(static_cast<size_t>(h.slot)), len, ChecksumSide::kDestination);
      int32_t sl = h.slot;
      MPI_Send(&sl, 1, MPI_INT32_T, 0, kTagSlotDone, MPI_COMM_WORLD);
      expected = h.checksum;
    } else {
      WireHeader h{};
      MPI_Request rq[2];
      MPI_Status status[2];
      MPI_Irecv(&h, sizeof h, MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD, &rq[0]);
      MPI_Irecv(buf.data(), static_cast<int>(len), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD, &rq[1]);
      quiet_waitall(2, rq, status, kReceiver);
      int got = 0;
      MPI_Get_count(&status[1], MPI_BYTE, &got);
      if (h.layout_hash != layout_.hash() || h.offset != off || h.length != len || static_cast<uint64_t>(got) != len) {
        abort_job(fmt::format(
            "rank {}: bad chunk from the server (offset {}, length {}, {} bytes; expected offset {}, length {})", rank_,
            h.offset, h.length, got, off, len));
      }
      sum = chunk_checksum(std::span<const std::byte>(buf));
      expected = h.checksum;
    }
    if (sum != expected) {
      abort_job(fmt::format("rank {}: chunk [{}, {}) from the server failed its checksum", rank_, off, off + len));
    }
    if (Status e = into.write(off, buf); !e.ok()) abort_job(fmt::format("rank {}: {}", rank_, e.message()));
    off += len;
  }
}

void ClientStreams::send_update(ShardedModelIo& model) {
  std::vector<std::byte> buf;
  for (uint64_t off = 0; off < layout_.total_bytes(); off += chunk_) {
    const uint64_t len = length_at(off);
    buf.resize(len);
    if (Status e = model.read(off, buf); !e.ok()) abort_job(fmt::format("rank {}: {}", rank_, e.message()));
    if (shm_.enabled()) {
      fill_next_slot(off, buf.data(), len);
    } else {
      WireHeader h{layout_.hash(), off, len, chunk_checksum(std::span<const std::byte>(buf))};
      MPI_Request rq[2];
      MPI_Isend(&h, sizeof h, MPI_BYTE, 0, kTagChunkHeader, MPI_COMM_WORLD, &rq[0]);
      MPI_Isend(buf.data(), static_cast<int>(len), MPI_BYTE, 0, kTagChunkData, MPI_COMM_WORLD, &rq[1]);
      quiet_waitall(2, rq, MPI_STATUSES_IGNORE, kSender);
    }
  }
}

}  // namespace memfl
