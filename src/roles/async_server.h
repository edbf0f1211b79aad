// The asynchronous server process, whatever its transport (gRPC, MPI): the
// aggregator and the rules (server/async_core.h) on the global model,
// metrics.csv every async_eval_every updates (a network model is evaluated
// by a model worker process, so the server never maps libtorch), the final
// checkpoint and summary.json. The transport's serve_async plays the run.
#pragma once

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/transport.h"
#include "config/config.h"
#include "memory/sampler.h"
#include "server/global_model.h"

namespace memfl {

using AsyncServeFn = std::function<Status(AsyncUpdateHandler& core, Arena& global, const AsyncServeOptions& options)>;

Status run_async_server(const ExperimentConfig& cfg, const std::string& run_dir, bool progress, GlobalModel& global,
                        MemorySampler& sampler, int64_t baseline_rss, const AsyncServeFn& serve,
                        const std::function<void(nlohmann::ordered_json&)>& add_summary = {});

// The global model of an asynchronous server: built as in rounds (initial
// weights from a model worker for a network), its round aggregator unused.
StatusOr<std::unique_ptr<GlobalModel>> make_async_global_model(const ExperimentConfig& cfg, const std::string& run_dir);

}  // namespace memfl
