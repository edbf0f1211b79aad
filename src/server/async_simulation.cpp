#include "server/async_simulation.h"

#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "client/client_driver.h"
#include "server/async_core.h"
#include "server/async_driver.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

StatusOr<AsyncSimulationResult> simulate_async(const ExperimentConfig& cfg, const std::string& run_dir,
                                               const SimClients& clients, LocalModel& worker, MemorySampler& sampler,
                                               std::function<void(const RoundMetrics&)> on_eval) {
  const auto& sc = cfg.server;
  // The global model: built with the seed, as the worker was, so it is the
  // initial model; with a network, its replica evaluates it in place.
  MEMFL_ASSIGN_OR_RETURN(LocalModel global, make_local_model(cfg, clients.input, /*fill=*/true, sc.seed, run_dir));
  const Layout& layout = global.layout();
  MEMFL_ASSIGN_OR_RETURN(auto aggregator, make_async_aggregator(cfg, layout, run_dir));

  AsyncDriverOptions dopts;
  dopts.run_dir = run_dir;
  dopts.step_time_s = client_step_times(sc);
  const std::vector<double> samples = clients.sample_counts(cfg);
  double total_samples = 0;
  for (double n : samples) total_samples += n;
  for (double n : samples)
    dopts.weights.push_back(sc.client_weights_mode == "sample_size" ? n / total_samples : 1.0 / sc.num_clients);
  std::string speeds = "client,step_time_s,weight\n";
  for (size_t c = 0; c < dopts.step_time_s.size(); ++c)
    speeds += fmt::format("{},{:.6f},{:.9g}\n", c, dopts.step_time_s[c], dopts.weights[c]);
  MEMFL_RETURN_IF_ERROR(write_text_file((fs::path(run_dir) / "client_speeds.csv").string(), speeds));
  // The clients' side, as every transport's; the driver (AsyncDriver) still
  // holds the global model each trip started from and writes a
  // gradient_based change against it into the spool, so no base is kept.
  if (cfg.compressor.enable_compression) {
    spdlog::warn(
        "compressor_configs: the asynchronous simulator hands each update to its spool in memory, uncompressed; "
        "compression applies over gRPC and MPI, and in synchronous simulations");
  }
  ClientDriver client_driver(cfg, run_dir, clients.splits(), clients.parts, /*record_privacy=*/true,
                             /*keep_base=*/false);
  dopts.train = [&](int c, int local_steps, const Arena& g, AsyncTrip* trip) -> StatusOr<const Arena*> {
    std::memcpy(worker.arena().data(), g.data(), layout.total_bytes());
    const int version = static_cast<int>(trip->version);
    MEMFL_ASSIGN_OR_RETURN(TripUpdate up, client_driver.train(worker, c, version, local_steps));
    trip->train_loss = up.trained.train_loss;
    trip->steps = up.local_steps;
    return up.upload;
  };
  if (sc.do_server_eval && global.replica() != nullptr) {
    dopts.evaluate = [&](Arena&) {
      return global.replica()->evaluate(clients.data->test, clients.test_idx, sc.eval_batch_size);
    };
  }
  dopts.on_eval = std::move(on_eval);
  spdlog::info("{} with {}: {} clients, {} updates, speeds {} (client_speeds.csv)", sc.scheduler, sc.aggregator,
               sc.num_clients, sc.num_global_epochs, sc.client_speed_distribution);
  AsyncDriver driver(cfg, layout, global.arena(), *aggregator, sampler, std::move(dopts));
  MEMFL_RETURN_IF_ERROR(driver.run());
  MEMFL_RETURN_IF_ERROR(write_safetensors(
      (fs::path(run_dir) / "global_model.safetensors").string(), layout, global.arena(),
      {{"format", "memfl"}, {"updates", std::to_string(sc.num_global_epochs)}, {"model_name", cfg.model.model_name}}));
  AsyncSimulationResult out;
  out.evaluations = driver.evaluations();
  out.versions = driver.versions();
  out.mean_staleness = driver.mean_staleness();
  out.max_staleness = driver.max_staleness();
  out.aggregator_state_bytes = aggregator->state_bytes();
  return out;
}

}  // namespace memfl
