// `memfl bench transfer`: peak RSS per role and throughput per direction of
// a real server + N client processes moving a synthetic model (DummyTrainer).
#pragma once

#include <string>

#include "common/status.h"

namespace memfl {

struct TransferBenchOptions {
  std::string transport = "grpc";
  double model_mb = 256;  // MiB
  int clients = 2;
  std::string dtype = "f32";
  double chunk_mb = 1;  // MiB
  std::string memory_mode = "streaming";
  // gRPC: where chunks travel — auto (the config's default: on one host,
  // the data channel's Unix socket), grpc (the stream), tcp (data_channel:
  // tcp over the TCP port), unix (data_channel: tcp over the Unix socket).
  std::string data_channel = "auto";
  std::string mpi_path = "shared_ring";         // MPI on one node: shared_ring | point_to_point
  std::string aggregator = "FedAvgAggregator";  // server_configs.aggregator
  std::string arena_backing = "memory";         // memory_configs.arena_backing: memory | file
  std::string dummy_delays;                     // train_configs.dummy_delay_s (a slow client: "1.5,0.5,0.5,0.5")
  std::string json_out;
  std::string run_dir;  // kept when given, else a temporary directory
};

// Runs the benchmark and returns its JSON (also written to json_out).
StatusOr<std::string> run_bench_transfer(const TransferBenchOptions& opts);

}  // namespace memfl
