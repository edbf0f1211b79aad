// What an experiment's config asks of its data: the data set (Fashion-MNIST,
// synthetic CIFAR-10 or tokens, a text file, tokenized text or JSON lines), the input shape a model is
// built for, and each client's partition. Every role that trains, evaluates
// or partitions goes through here — clients and servers of every transport,
// and a sharded model's ranks — so the same seed gives the same data
// everywhere. Nothing here needs libtorch.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "config/config.h"
#include "data/dataset.h"
#include "data/partition.h"
#include "data/text_data.h"

namespace memfl {

// The shape of a model's input and output, from the data set.
struct InputSpec {
  int64_t channels = 1, height = 28, width = 28;
  int num_classes = 10;
};

StatusOr<DatasetSplits> load_data(const ExperimentConfig& cfg);
// A tokenized text set's source as the config gives it (the model's
// vocabulary from its llama spec, 0 when it has none).
TextDataSource text_data_source(const ExperimentConfig& cfg);
// What loading the data would refuse, found without loading it, for `memfl
// validate`: a tokenized corpus's tokenizer (its vocabulary against the
// model's), every JSON line, and that partition_strategy by_group has a
// group for every client. A config load checks only the files' kinds and
// sizes; this reads them, where they are on this machine.
[[nodiscard]] Status check_experiment_data(const ExperimentConfig& cfg);
// model_kwargs that contradict the data set are config errors, named as such.
StatusOr<InputSpec> input_spec(const ExperimentConfig& cfg, const ImageDataset& train);
StatusOr<std::vector<ClientPartition>> make_partitions(const ExperimentConfig& cfg, const ImageDataset& train);

}  // namespace memfl
