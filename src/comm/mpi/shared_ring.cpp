// The shared-memory ring of the MPI transport (comm/mpi/mpi_transport.h):
// one MPI-3 shared window of chunk slots, allocated by the server, when every
// rank runs on the server's node.
#include <mpi.h>

#include "comm/chunk.h"
#include "comm/mpi/mpi_detail.h"
#include "comm/mpi/mpi_transport.h"

namespace memfl {

using mpi_detail::chunks_in_flight;
using mpi_detail::kMaxSharedSlot;

SharedRing open_shared_ring(const ExperimentConfig& cfg, int rank) {
  SharedRing ring;
  const size_t chunk = transfer_chunk_bytes(true, cfg.server.model_chunk_size, kMaxTransferChunk);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int here = rank == 0 ? 1 : 0, server_here = 0, everywhere = 0;
  MPI_Allreduce(&here, &server_here, 1, MPI_INT, MPI_MAX, node);
  MPI_Allreduce(&server_here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Comm_size(node, &ring.ranks_on_node);
  if (!cfg.server.mpi_shared_memory || !everywhere || !cfg.server.use_model_chunking || chunk > kMaxSharedSlot) {
    MPI_Comm_free(&node);
    return ring;
  }
  ring.slots = chunks_in_flight(chunk);
  // Room for a frame, which may exceed its chunk: a compressed frame by its
  // header, a masked one by its tag and the masked weight.
  ring.slot_bytes = chunk + (cfg.compressor.enable_compression || cfg.secagg.enable ? kMaxFrameOverhead : 0);
  void* mine = nullptr;
  const MPI_Aint bytes = rank == 0 ? static_cast<MPI_Aint>(ring.slots * ring.slot_bytes) : 0;
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

}  // namespace memfl
