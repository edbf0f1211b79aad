// `memfl client`: one process, one client over gRPC. Wiring only: the
// protocol is GrpcClientTransport's, the rounds ClientDriver's.
#include <filesystem>
#include <future>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "client/client_driver.h"
#include "client/client_work.h"
#include "comm/client_tokens.h"
#include "comm/fault_plan.h"
#include "comm/grpc/grpc_client_transport.h"
#include "io/run_dir.h"
#include "memory/malloc_policy.h"
#include "memory/sampler.h"
#include "roles/grpc_roles.h"
#include "compress/settings.h"

namespace memfl {

Status run_grpc_client(const ExperimentConfig& local, int client_id, const RoleOptions& opts) {
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

  // A client that trains maps libtorch (the trainer plugin) while it
  // connects and the server gets ready, not after: the first round waits
  // for the model and the data only.
  std::future<StatusOr<TrainerBackend*>> plugin;
  if (!is_spec_only(local)) plugin = std::async(std::launch::async, load_trainer_backend);
  // The fault tests' misbehaving peer, when the environment names this client.
  const auto faults = transfer_faults_from_env(client_id, "MEMFL_FAULT_CLIENT");
  const auto& lc = local.server;
  std::string token = lc.auth_token;
  if (!lc.client_tokens_file.empty()) {
    MEMFL_ASSIGN_OR_RETURN(token, load_own_client_token(lc.client_tokens_file, kClientTokensFileKey, client_id));
  }
  MEMFL_ASSIGN_OR_RETURN(auto transport, GrpcClientTransport::connect({.server_uri = lc.server_uri,
                                                                       .client_id = static_cast<uint32_t>(client_id),
                                                                       .token = token,
                                                                       .use_ssl = lc.use_ssl,
                                                                       .root_cert = lc.root_cert,
                                                                       .max_message_size = lc.max_message_size,
                                                                       .connect_timeout_s = lc.connect_timeout_s,
                                                                       .faults = faults.get()}));
  // The server's configuration is the experiment; the local one only says
  // how to reach the server.
  MEMFL_ASSIGN_OR_RETURN(ExperimentConfig cfg,
                         load_config_text(transport->config_yaml(), "configuration from server " + lc.server_uri));
  if (cfg.train.num_threads == 0) cfg.train.num_threads = 1;  // clients share the machine's cores

  std::optional<DatasetSplits> data;
  std::vector<ClientPartition> parts;
  InputSpec input;
  if (!is_spec_only(cfg)) {
    MEMFL_ASSIGN_OR_RETURN(data, load_data(cfg));
    MEMFL_ASSIGN_OR_RETURN(input, input_spec(cfg, data->train));
    MEMFL_ASSIGN_OR_RETURN(parts, make_partitions(cfg, data->train));
  }
  if (plugin.valid()) MEMFL_RETURN_IF_ERROR(plugin.get().status());
  const int64_t before_model_rss = read_rss_bytes();
  MEMFL_ASSIGN_OR_RETURN(LocalModel model, make_local_model(cfg, input, /*fill=*/false, cfg.server.seed, opts.run_dir));
  const Layout& layout = model.layout();
  if (layout.hash() != transport->layout().hash() || layout.total_bytes() != transport->layout().total_bytes()) {
    return data_loss("server {}: its model (layout {:016x}, {} bytes) is not this client's (layout {:016x}, {} bytes)",
                     lc.server_uri, transport->layout().hash(), transport->layout().total_bytes(), layout.hash(),
                     layout.total_bytes());
  }
  ClientDriver driver(cfg, opts.run_dir, data ? &*data : nullptr, parts);
  MEMFL_ASSIGN_OR_RETURN(const int rounds, driver.run(*transport, model, {.sampler = &sampler}));
  (void)transport->close();  // the server may already have shut down; the rounds are what counts

  nlohmann::ordered_json summary;
  summary["role"] = role;
  summary["rounds"] = rounds;
  summary["malloc_policy"] = malloc_policy();
  summary["compression"] = compression_summary(compression_settings(cfg));
  summary["model_bytes"] = layout.payload_bytes();
  summary["baseline_rss_bytes"] = baseline_rss;
  summary["before_model_rss_bytes"] = before_model_rss;
  summary["peak_rss_bytes"] = std::max(sampler.peak_rss(), read_peak_rss_bytes());
  return write_text_file((std::filesystem::path(opts.run_dir) / "summary.json").string(), summary.dump(2) + "\n");
}

}  // namespace memfl
