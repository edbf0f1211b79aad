#include "data/experiment_data.h"

#include "model/llama.h"

namespace memfl {

TextDataSource text_data_source(const ExperimentConfig& cfg) {
  TextDataSource src;
  src.dataset_name = cfg.data.dataset_name;
  src.path = cfg.data.dataset_path;
  src.seq_length = cfg.model.seq_length;
  if (auto spec = llama_spec_from_config(cfg.model); spec.ok()) src.vocab_size = spec->vocab_size;
  src.text = cfg.data.text;
  src.max_train = static_cast<size_t>(cfg.data.max_train_samples);
  src.max_test = static_cast<size_t>(cfg.data.max_test_samples);
  return src;
}

StatusOr<DatasetSplits> load_data(const ExperimentConfig& cfg) {
  const auto& d = cfg.data;
  if (d.dataset_name == "SyntheticTokens") {
    return make_synthetic_tokens(static_cast<size_t>(d.num_train_samples), static_cast<size_t>(d.num_test_samples),
                                 cfg.model.seq_length, cfg.server.seed);
  }
  if (d.dataset_name == "JsonLines" || (d.dataset_name == "TextFile" && !d.text.tokenizer_path.empty())) {
    return load_tokenized_text(text_data_source(cfg));
  }
  if (d.dataset_name == "TextFile") return load_text_tokens(d.dataset_path, cfg.model.seq_length);
  if (d.dataset_name == "SyntheticCIFAR10") {
    return make_synthetic_cifar10(static_cast<size_t>(d.num_train_samples), static_cast<size_t>(d.num_test_samples),
                                  cfg.server.seed);
  }
  return load_fashion_mnist(d.dataset_path, static_cast<size_t>(d.max_train_samples),
                            static_cast<size_t>(d.max_test_samples));
}

Status check_experiment_data(const ExperimentConfig& cfg) {
  const auto& d = cfg.data;
  const bool tokenized = d.dataset_name == "JsonLines" || (d.dataset_name == "TextFile" && !d.text.tokenizer_path.empty());
  if (!tokenized) return Status::Ok();
  auto groups = check_tokenized_text(text_data_source(cfg));
  if (!groups.ok()) return groups.status().with_context(cfg.source);
  if (d.partition_strategy == "by_group" && *groups > 0 && *groups < cfg.server.num_clients) {
    return invalid_argument(
        "{}: 'client_configs.data_configs.dataset_kwargs.partition_strategy: by_group' gives each client a group of "
        "its own, but the data has {} group(s) for {} clients (server_configs.num_clients)",
        cfg.source, *groups, cfg.server.num_clients);
  }
  return Status::Ok();
}

StatusOr<InputSpec> input_spec(const ExperimentConfig& cfg, const ImageDataset& train) {
  InputSpec in{train.channels, train.height, train.width, train.num_classes};
  const auto& m = cfg.model;
  const std::string prefix = "client_configs.model_configs.model_kwargs";
  if (m.num_channel != 0 && m.num_channel != in.channels) {
    return invalid_argument("{}: key '{}.num_channel' is {} but {} has {} channel(s)", cfg.source, prefix,
                            m.num_channel, train.name, in.channels);
  }
  if (m.num_pixel != 0 && (m.num_pixel != in.height || m.num_pixel != in.width)) {
    return invalid_argument("{}: key '{}.num_pixel' is {} but {} images are {}×{}", cfg.source, prefix, m.num_pixel,
                            train.name, in.height, in.width);
  }
  if (m.num_classes != 0 && m.num_classes != in.num_classes) {
    return invalid_argument("{}: key '{}.num_classes' is {} but {} has {} classes", cfg.source, prefix, m.num_classes,
                            train.name, in.num_classes);
  }
  return in;
}

StatusOr<std::vector<ClientPartition>> make_partitions(const ExperimentConfig& cfg, const ImageDataset& train) {
  PartitionStrategy strategy = PartitionStrategy::kIid;
  if (cfg.data.partition_strategy == "dirichlet") strategy = PartitionStrategy::kDirichlet;
  if (cfg.data.partition_strategy == "class_shards") strategy = PartitionStrategy::kClassShards;
  if (cfg.data.partition_strategy == "lognormal") strategy = PartitionStrategy::kLognormal;
  if (cfg.data.partition_strategy == "power_law") strategy = PartitionStrategy::kPowerLaw;
  if (cfg.data.partition_strategy == "by_group") strategy = PartitionStrategy::kByGroup;
  PartitionSpec ps{strategy,        cfg.server.num_clients, cfg.data.alpha,      cfg.data.shards_per_client,
                   cfg.server.seed, cfg.data.sigma,         cfg.data.power_law_a};
  MEMFL_ASSIGN_OR_RETURN(auto parts, partition_indices(train.labels, train.num_classes, ps));
  return split_train_val(std::move(parts), cfg.data.val_ratio, cfg.server.seed);
}

}  // namespace memfl
