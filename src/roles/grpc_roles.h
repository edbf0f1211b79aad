// memfl over gRPC: `memfl server`, `memfl client`, `memfl launch`.
//
// The server holds the global model, what its aggregator needs, and in-flight
// chunks — nothing per client. With FedAvg on f32 models the running sum
// takes the global model's place once every selected client has received it
// (the pre-round checkpoint on disk is the undo), so the server's model state
// is one model-sized arena whatever the number of clients.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"

namespace memfl {

struct RoleOptions {
  std::string run_dir;
  bool progress = true;
  bool resume = false;  // continue after the newest committed round of run_dir
};

Status run_grpc_server(const ExperimentConfig& cfg, const RoleOptions& opts);
Status run_grpc_client(const ExperimentConfig& local_cfg, int client_id, const RoleOptions& opts);

// Starts one server and `num_clients` client processes of this executable on
// this machine, waits for them and gathers their run directories under
// `run_dir` (server/, client_0/, ...) with a summary.json.
// `server_args` go to the server's command line only (--http ADDR:PORT):
// when it names --http, the live page's address is printed once it listens.
Status run_launch(const std::string& config_path, const std::vector<std::string>& sets, int num_clients,
                  const std::string& run_dir, bool progress, const std::vector<std::string>& server_args = {});

}  // namespace memfl
