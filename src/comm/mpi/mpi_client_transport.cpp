#include "comm/mpi/mpi_client_transport.h"

#include <fmt/format.h>

namespace memfl {

MpiClientTransport::MpiClientTransport(const Layout& layout, size_t chunk, const SharedRing& shm, int rank,
                                       std::function<std::vector<int>(int)> clients_of_round, TransferFaults* faults)
    : layout_(layout),
      streams_(layout, chunk, shm, rank),
      rank_(rank),
      clients_of_round_(std::move(clients_of_round)),
      faults_(faults != nullptr ? faults : &no_faults_) {}

StatusOr<RoundOffer> MpiClientTransport::next_round() {
  if (last_round_ >= 0) faults_->after_round(last_round_);
  last_round_ = -1;
  RoundOffer offer;
  while (true) {
    WireModelBegin b{};
    quiet_recv(&b, sizeof b, 0, kTagModelBegin);
    if (b.finished) return offer;
    if (!b.participate) continue;  // none of this rank's clients was selected
    if (b.layout_hash != layout_.hash() || b.total_bytes != layout_.total_bytes()) {
      // Every rank built its model from the same config: another layout is a
      // broken job, not a round to skip.
      abort_job(fmt::format("rank {}: the server's model (layout {:016x}) is not this rank's ({:016x})", rank_,
                            b.layout_hash, layout_.hash()));
    }
    offer.round = b.round;
    offer.local_steps = b.local_steps;
    offer.clients = clients_of_round_(b.round);
    last_round_ = b.round;
    return offer;
  }
}

Status MpiClientTransport::receive(ModelPlace& into) {
  faults_->in_broadcast();
  // Every chunk is checked before this returns; a bad one ends the job.
  if (ShardedModelIo* shards = into.shards()) {
    streams_.receive_model(*shards);
  } else if (Arena* arena = into.arena()) {
    streams_.receive_model(*arena);
  } else {
    return invalid_argument("rank {}: an MPI client receives into an arena or shards", rank_);
  }
  int32_t ok = 1;
  MPI_Send(&ok, 1, MPI_INT32_T, 0, kTagModelReceived, MPI_COMM_WORLD);
  return Status::Ok();
}

Status MpiClientTransport::send(const UpdateMeta& meta, ModelPlace& from) {
  UpdateMeta told = meta;
  faults_->before_update_meta(&told);  // the fault tests' lying rank
  const WireUpdateMeta md = wire_update_meta(told.round, told.client, told.sample_count, told.metrics);
  MPI_Send(&md, sizeof md, MPI_BYTE, 0, kTagUpdateMeta, MPI_COMM_WORLD);
  MEMFL_RETURN_IF_ERROR(faults_->before_upload_chunk(0, false, nullptr));
  if (from.framed()) {
    streams_.send_frames(from);
  } else if (ShardedModelIo* shards = from.shards()) {
    streams_.send_update(*shards);
  } else if (Arena* arena = from.arena()) {
    streams_.send_update(*arena);
  } else {
    return invalid_argument("rank {}: an MPI client sends from an arena or shards", rank_);
  }
  return Status::Ok();
}

StatusOr<std::string> MpiClientTransport::next_secagg_request() {
  uint64_t n = 0;
  quiet_recv(&n, sizeof n, 0, kTagSecAggRequest);
  if (n > kMaxSecAggMessage) {
    abort_job(fmt::format("rank {}: the server announced a secure aggregation request of {} bytes (at most {})", rank_,
                          n, kMaxSecAggMessage));
  }
  std::string request(n, '\0');
  if (n > 0) quiet_recv(request.data(), static_cast<int>(n), 0, kTagSecAggRequest);
  return request;
}

Status MpiClientTransport::send_secagg_reply(std::string reply) {
  const uint64_t n = reply.size();
  MPI_Send(&n, sizeof n, MPI_BYTE, 0, kTagSecAggReply, MPI_COMM_WORLD);
  MPI_Send(reply.data(), static_cast<int>(n), MPI_BYTE, 0, kTagSecAggReply, MPI_COMM_WORLD);
  return Status::Ok();
}

Status MpiClientTransport::close() {
  if (closed_) return Status::Ok();
  closed_ = true;
  int32_t bye = 1;
  MPI_Send(&bye, 1, MPI_INT32_T, 0, kTagBye, MPI_COMM_WORLD);
  return Status::Ok();
}

}  // namespace memfl
