// Data sets held once per process — images as uint8 pixels (N×C×H×W) and
// labels, token sequences for language models in the same container (see
// ImageDataset) — and virtual clients are index lists into them, so 1000
// clients cost 1000 index lists, not 1000 copies. Trainers normalise image
// batches on the fly with the data set's mean and std.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace memfl {

// Image sets: sample i is pixels[i·C·H·W, (i+1)·C·H·W), its class labels[i]
// (0 … num_classes − 1).
//
// Token sets (SyntheticTokens, TextFile, JsonLines) — what a language-model
// trainer reads:
//  - channels = height = 1 and width = L = seq_length + 1: a sample is L
//    token ids; the model's input is positions 0 … L − 2 and its target
//    positions 1 … L − 1 (the next token of each input position).
//  - `tokens` non-empty (a tokenizer was given): sample i is
//    tokens[i·L, (i+1)·L), int32 ids in [0, vocabulary) — the tokenizer's
//    vocabulary, which is checked to equal the model's vocab_size before any
//    round — and `pixels` is empty. `tokens` empty: sample i is the bytes
//    pixels[i·L, (i+1)·L), ids 0 … 255 (a vocabulary of at least 256 is
//    checked).
//  - `loss_mask` empty: every target counts. Non-empty: loss_mask.size() ==
//    tokens.size(), and target position j ≥ 1 of sample i counts in the loss
//    when loss_mask[i·L + j] == 1 and not when it is 0 (padding; a prompt
//    under train_on_response_only). loss_mask[i·L] (position 0, never a
//    target) is 0. Masked positions still hold valid ids (padding is the pad
//    id, else EOS), so embedding them is safe. Every sample has at least one
//    counted target; a per-token loss divides by the counted targets.
//  - labels[i] is the sample's group (0 … num_classes − 1), never a target:
//    the source file or the JSON field's value that partitions (by_group,
//    dirichlet) split by. num_classes is the number of groups, 1 when there
//    is none; group_names[g] names group g (a file's name, a field's value),
//    empty when the set has one unnamed group.
struct ImageDataset {
  std::string name;
  int64_t channels = 0, height = 0, width = 0;
  int num_classes = 0;
  float mean = 0.f, std = 1.f;  // for normalising pixel/255
  std::vector<uint8_t> pixels;  // size() * channels * height * width
  std::vector<uint8_t> labels;
  std::vector<int32_t> tokens;           // token sets with a tokenizer: size() * width ids (see above)
  std::vector<uint8_t> loss_mask;        // empty, or one per element of `tokens` (see above)
  std::vector<std::string> group_names;  // tokenized sets: the name of group g (see above)
  size_t size() const { return labels.size(); }
  size_t sample_bytes() const { return static_cast<size_t>(channels * height * width); }
  const uint8_t* sample(size_t i) const { return pixels.data() + i * sample_bytes(); }
  // Token sets with a tokenizer: the width (= seq_length + 1) ids of sample i.
  const int32_t* sample_tokens(size_t i) const { return tokens.data() + i * static_cast<size_t>(width); }
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

// Byte token data for language models, in the same container: each sample is
// seq_length + 1 byte-sized token ids (vocabulary 256) in `pixels` (1×1×(T+1)),
// one group (labels 0, num_classes 1). SyntheticTokens come from a seeded stochastic "grammar"
// (each token is a fixed function of the one before it with probability 0.8,
// else uniform: entropy ≈ 1.6 nats), so a model can learn it and its loss can
// fall well below log 256 ≈ 5.5; TextFile without a tokenizer cuts a file's bytes into sequences (the
// last tenth is the test split). Tokenized text and JSON lines: data/text_data.h.
DatasetSplits make_synthetic_tokens(size_t num_train, size_t num_test, int seq_length, uint64_t seed);
StatusOr<DatasetSplits> load_text_tokens(const std::string& path, int seq_length);

// Reads one IDX file (gzip or plain) of the given magic type.
StatusOr<std::vector<uint8_t>> read_idx_file(const std::string& path, int expected_dims, std::vector<int64_t>* dims);

}  // namespace memfl
