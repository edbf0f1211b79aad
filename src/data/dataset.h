// Image classification data sets held once per process as uint8 pixels
// (N×C×H×W) and labels; virtual clients are index lists into them, so 1000
// clients cost 1000 index lists, not 1000 copies. Trainers normalise batches
// on the fly with the data set's mean and std.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace memfl {

struct ImageDataset {
  std::string name;
  int64_t channels = 0, height = 0, width = 0;
  int num_classes = 0;
  float mean = 0.f, std = 1.f;  // for normalising pixel/255
  std::vector<uint8_t> pixels;  // size() * channels * height * width
  std::vector<uint8_t> labels;
  size_t size() const { return labels.size(); }
  size_t sample_bytes() const { return static_cast<size_t>(channels * height * width); }
  const uint8_t* sample(size_t i) const { return pixels.data() + i * sample_bytes(); }
};

struct DatasetSplits {
  ImageDataset train;
  ImageDataset test;
};

// The directory the Debian package dataset-fashion-mnist installs.
inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";

// Reads Fashion-MNIST's four IDX files from `dir` (gzipped, as the Debian
// package ships them, or plain). A missing directory or file gets a message
// naming the package to install. `max_train`/`max_test` > 0 keep only the
// first that many samples (for quick tests).
StatusOr<DatasetSplits> load_fashion_mnist(const std::string& dir, size_t max_train = 0, size_t max_test = 0);

// Seeded CIFAR-10-shaped data (3×32×32, 10 classes) for memory experiments:
// each class has its own mean pattern plus noise, so a model can learn it.
DatasetSplits make_synthetic_cifar10(size_t num_train, size_t num_test, uint64_t seed);

// Token data for language models, in the same container: each sample is
// seq_length + 1 byte-sized token ids (vocabulary 256) in `pixels` (1×1×(T+1)),
// labels unused (0). SyntheticTokens come from a seeded stochastic "grammar"
// (each token is a fixed function of the one before it with probability 0.8,
// else uniform: entropy ≈ 1.6 nats), so a model can learn it and its loss can
// fall well below log 256 ≈ 5.5; TextFile cuts a file's bytes into sequences (the last tenth is the
// test split).
DatasetSplits make_synthetic_tokens(size_t num_train, size_t num_test, int seq_length, uint64_t seed);
StatusOr<DatasetSplits> load_text_tokens(const std::string& path, int seq_length);

// Reads one IDX file (gzip or plain) of the given magic type.
StatusOr<std::vector<uint8_t>> read_idx_file(const std::string& path, int expected_dims, std::vector<int64_t>* dims);

}  // namespace memfl
