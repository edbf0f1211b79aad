// What the MPI roles share (roles/mpi_roles.cpp starts the job and runs the
// client ranks; roles/mpi_server.cpp runs rank 0).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <functional>
#include <string>

#include "config/config.h"
#include "comm/mpi/mpi_transport.h"
#include "io/run_dir.h"
#include "memory/sampler.h"

namespace memfl {

// A client rank's registration (kTagRegister): who it is, and where it
// runs — the server lets a rank it excluded go (SIGCONT) before the job
// ends, parked (SIGUSR1): OpenMPI's mpirun was seen to hang ending a job
// around a stopped process, and to deadlock when the woken rank went on.
struct WireRegister {
  int32_t rank, clients, pid, pad;
  uint64_t host;  // a hash of the host name
};

inline WireRegister this_rank_registration(int rank, int clients) {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return {rank, clients, static_cast<int32_t>(getpid()), 0, std::hash<std::string>{}(name)};
}

// A rank's memory sampler, written to its directory however the rank ends.
struct RankState {
  MemorySampler sampler;
  std::string dir;
  WriteMemoryOnExit write_on_exit{sampler, dir};
  RankState(const std::string& role, int interval, std::string d) : sampler(role, interval), dir(std::move(d)) {
    sampler.start();
  }
};

Status run_mpi_server(const ExperimentConfig& cfg, int world, const std::string& dir, bool progress, bool resume,
                      const SharedRing& shm);

}  // namespace memfl
