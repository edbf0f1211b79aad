// The aggregator registry: `server_configs.aggregator` by name (APPFL's
// names), with `aggregator_kwargs`. An unknown name is refused before any
// work, listing the known ones. The server core holds whatever this returns
// behind the Aggregator interface; adding an aggregator is a class and a row
// here.
//
//   AggregatorContext ctx{layout, mode, accumulation, &global_arena, make_state};
//   MEMFL_ASSIGN_OR_RETURN(auto agg, make_aggregator(cfg.server.aggregator, ctx));
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "aggregate/fedavg_aggregator.h"
#include "aggregate/server_optimizer.h"

namespace memfl {

struct AggregatorContext {
  const Layout* layout = nullptr;
  ClientWeightsMode weights = ClientWeightsMode::kEqual;
  Accumulation accumulation = Accumulation::kSum;
  // The global arena, when the aggregator may keep its state in it once the
  // broadcast is done (nullptr: it may not).
  Arena* in_place = nullptr;
  // A state arena of `bytes` where memory_configs.arena_backing says.
  std::function<StatusOr<Arena>(size_t bytes)> make_state_arena;
  // Server optimizers: their keys, and the file that holds the pre-round
  // global model when a round is finalized (the committed checkpoint).
  ServerOptParams server_opt;
  std::string previous_model;
};

struct AggregatorInfo {
  std::string name, description;
};
const std::vector<AggregatorInfo>& aggregators();
std::vector<std::string> aggregator_names();

StatusOr<std::unique_ptr<Aggregator>> make_aggregator(const std::string& name, const AggregatorContext& ctx);

}  // namespace memfl
