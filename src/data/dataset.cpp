#include "data/dataset.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <random>

#include "io/input_file.h"
#include "memory/ledger.h"

namespace memfl {

namespace fs = std::filesystem;

StatusOr<std::vector<uint8_t>> read_idx_file(const std::string& path, int expected_dims, std::vector<int64_t>* dims) {
  // gzread reads plain files as they are, so one path handles both. Opened
  // here first, as a regular file: gzopen on a FIFO would wait for a writer.
  MEMFL_ASSIGN_OR_RETURN(InputFile in,
                         open_input_file(path, "client_configs.data_configs.dataset_path (IDX file)", kIdxFileLimit));
  const uint64_t file_size = in.size();
  gzFile f = gzdopen(in.fd(), "rb");
  if (f == nullptr) return not_found("{}: cannot open", path);
  (void)in.release();  // gzclose closes it now
  auto close = [&] { gzclose(f); };
  unsigned char magic[4];
  if (gzread(f, magic, 4) != 4) {
    close();
    return data_loss("{}: shorter than an IDX header", path);
  }
  // IDX: two zero bytes, type 0x08 (unsigned byte), number of dimensions.
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08 || magic[3] != expected_dims) {
    close();
    return data_loss("{}: not a uint8 IDX file with {} dimensions (magic {:02x}{:02x}{:02x}{:02x})", path,
                     expected_dims, magic[0], magic[1], magic[2], magic[3]);
  }
  dims->clear();
  size_t total = 1;
  for (int i = 0; i < expected_dims; ++i) {
    unsigned char b[4];
    if (gzread(f, b, 4) != 4) {
      close();
      return data_loss("{}: truncated IDX header", path);
    }
    uint32_t d = (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
    if (d == 0 || d > (1u << 28)) {
      close();
      return data_loss("{}: implausible dimension {}", path, d);
    }
    dims->push_back(d);
    total *= d;
  }
  if (total > (size_t{1} << 34)) {
    close();
    return data_loss("{}: {} bytes of data is implausible for an IDX file", path, total);
  }
  // The header is the file's word, not a fact: a plain file must hold what
  // it claims before anything is allocated, and a gzipped one gets memory
  // only as its bytes actually arrive (16 MiB at a time), so a 54-byte file
  // claiming 16 GiB costs nothing.
  if (gzdirect(f) != 0) {
    const uint64_t size = file_size;
    const size_t header = 4 + 4 * static_cast<size_t>(expected_dims);
    if (size < header + total) {
      close();
      return data_loss("{}: the header claims {} data bytes, the file holds {}", path, total, size - header);
    }
  }
  std::vector<uint8_t> data;
  size_t got = 0;
  constexpr size_t kBlock = 16 << 20;
  while (got < total) {
    const size_t want = std::min(total - got, kBlock);
    data.resize(got + want);
    int n = gzread(f, data.data() + got, static_cast<unsigned>(want));
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  data.resize(got);
  close();
  if (got != total) return data_loss("{}: expected {} data bytes, file holds {}", path, total, got);
  return data;
}

static std::string find_idx(const std::string& dir, const std::string& stem) {
  for (const std::string& suffix : {std::string(".gz"), std::string("")}) {
    fs::path p = fs::path(dir) / (stem + suffix);
    // Whatever is there is taken (read_idx_file refuses what is not a
    // regular file, naming it), so a FIFO is not reported as missing.
    std::error_code ec;
    if (fs::exists(fs::symlink_status(p, ec))) return p.string();
  }
  return {};
}

static StatusOr<ImageDataset> load_fmnist_split(const std::string& dir, const std::string& prefix, size_t max_n) {
  const std::string img_path = find_idx(dir, prefix + "-images-idx3-ubyte");
  const std::string lbl_path = find_idx(dir, prefix + "-labels-idx1-ubyte");
  if (img_path.empty() || lbl_path.empty()) {
    return not_found(
        "Fashion-MNIST file {}-{}-idx?-ubyte[.gz] not found in {} — install the Debian package "
        "dataset-fashion-mnist (scripts/install-deps.sh does) or set client_configs.data_configs.dataset_path",
        prefix, img_path.empty() ? "images" : "labels", dir);
  }
  std::vector<int64_t> idims, ldims;
  MEMFL_ASSIGN_OR_RETURN(auto pixels, read_idx_file(img_path, 3, &idims));
  MEMFL_ASSIGN_OR_RETURN(auto labels, read_idx_file(lbl_path, 1, &ldims));
  if (idims[0] != ldims[0]) {
    return data_loss("{} has {} images but {} has {} labels", img_path, idims[0], lbl_path, ldims[0]);
  }
  for (uint8_t l : labels) {
    if (l >= 10) return data_loss("{}: label {} outside 0..9", lbl_path, l);
  }
  ImageDataset ds;
  ds.name = "FashionMNIST";
  ds.channels = 1;
  ds.height = idims[1];
  ds.width = idims[2];
  ds.num_classes = 10;
  ds.mean = 0.2860f;  // Fashion-MNIST training-set pixel statistics
  ds.std = 0.3530f;
  size_t n = labels.size();
  if (max_n > 0 && max_n < n) n = max_n;
  labels.resize(n);
  pixels.resize(n * ds.sample_bytes());
  pixels.shrink_to_fit();
  ds.labels = std::move(labels);
  ds.pixels = std::move(pixels);
  return ds;
}

StatusOr<DatasetSplits> load_fashion_mnist(const std::string& dir_in, size_t max_train, size_t max_test) {
  const std::string dir = dir_in.empty() ? kFashionMnistDefaultDir : dir_in;
  if (Status st = check_input_dir(dir, "client_configs.data_configs.dataset_path (Fashion-MNIST)"); !st.ok()) {
    if (st.code() != StatusCode::kNotFound) return st;
    return not_found(
        "Fashion-MNIST directory {} does not exist — install the Debian package dataset-fashion-mnist "
        "(scripts/install-deps.sh does) or set client_configs.data_configs.dataset_path",
        dir);
  }
  DatasetSplits s;
  MEMFL_ASSIGN_OR_RETURN(s.train, load_fmnist_split(dir, "train", max_train));
  MEMFL_ASSIGN_OR_RETURN(s.test, load_fmnist_split(dir, "t10k", max_test));
  Ledger::instance().add(MemoryCategory::kData, static_cast<int64_t>(s.train.pixels.size() + s.train.labels.size() +
                                                                     s.test.pixels.size() + s.test.labels.size()));
  return s;
}

static ImageDataset synth_split(size_t n, uint64_t seed, const std::vector<float>& class_means) {
  ImageDataset ds;
  ds.name = "SyntheticCIFAR10";
  ds.channels = 3;
  ds.height = 32;
  ds.width = 32;
  ds.num_classes = 10;
  ds.mean = 0.5f;
  ds.std = 0.25f;
  const size_t sb = ds.sample_bytes();
  ds.pixels.resize(n * sb);
  ds.labels.resize(n);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> cls(0, 9);
  std::normal_distribution<float> noise(0.f, 40.f);
  for (size_t i = 0; i < n; ++i) {
    int c = cls(rng);
    ds.labels[i] = static_cast<uint8_t>(c);
    for (size_t j = 0; j < sb; ++j) {
      float v = class_means[c * sb + j] + noise(rng);
      ds.pixels[i * sb + j] = static_cast<uint8_t>(std::clamp(v, 0.f, 255.f));
    }
  }
  return ds;
}

DatasetSplits make_synthetic_cifar10(size_t num_train, size_t num_test, uint64_t seed) {
  const size_t sb = 3 * 32 * 32;
  std::vector<float> means(10 * sb);
  std::mt19937_64 rng(seed ^ 0x5eedc1fa5ULL);
  std::uniform_real_distribution<float> u(64.f, 192.f);
  for (auto& m : means) m = u(rng);
  DatasetSplits s{synth_split(num_train, seed + 1, means), synth_split(num_test, seed + 2, means)};
  Ledger::instance().add(MemoryCategory::kData, static_cast<int64_t>(s.train.pixels.size() + s.test.pixels.size()));
  return s;
}

namespace {
ImageDataset token_split(std::string name, size_t n, int seq_length) {
  ImageDataset d;
  d.name = std::move(name);
  d.channels = 1;
  d.height = 1;
  d.width = seq_length + 1;
  d.num_classes = 1;  // labels are groups, and byte tokens have one
  d.pixels.resize(n * static_cast<size_t>(seq_length + 1));
  d.labels.assign(n, 0);
  return d;
}
}  // namespace

DatasetSplits make_synthetic_tokens(size_t num_train, size_t num_test, int seq_length, uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x70c3e5ULL);
  std::vector<uint8_t> rule(256);  // the likely next token after each token
  for (auto& r : rule) r = static_cast<uint8_t>(rng());
  auto fill = [&](ImageDataset& d, uint64_t s) {
    std::mt19937_64 g(s);
    std::uniform_real_distribution<double> u(0, 1);
    const size_t len = d.sample_bytes();
    for (size_t i = 0; i < d.size(); ++i) {
      uint8_t* t = d.pixels.data() + i * len;
      t[0] = static_cast<uint8_t>(g());
      for (size_t j = 1; j < len; ++j) t[j] = u(g) < 0.8 ? rule[t[j - 1]] : static_cast<uint8_t>(g());
    }
  };
  DatasetSplits s{token_split("SyntheticTokens", num_train, seq_length),
                  token_split("SyntheticTokens (test)", num_test, seq_length)};
  fill(s.train, seed + 1);
  fill(s.test, seed + 2);
  Ledger::instance().add(MemoryCategory::kData, static_cast<int64_t>(s.train.pixels.size() + s.test.pixels.size()));
  return s;
}

StatusOr<DatasetSplits> load_text_tokens(const std::string& path, int seq_length) {
  MEMFL_ASSIGN_OR_RETURN(std::string bytes, read_input_file(path, "client_configs.data_configs.dataset_path (TextFile)",
                                                            kTextCorpusLimit));
  const size_t len = static_cast<size_t>(seq_length) + 1;
  const size_t n = bytes.size() / len;
  if (n < 10) {
    return invalid_argument("{}: {} bytes make {} sequences of {} tokens; at least 10 are needed", path, bytes.size(),
                            n, len);
  }
  const size_t n_test = std::max<size_t>(1, n / 10);
  DatasetSplits s{token_split(path, n - n_test, seq_length), token_split(path + " (test)", n_test, seq_length)};
  std::memcpy(s.train.pixels.data(), bytes.data(), (n - n_test) * len);
  std::memcpy(s.test.pixels.data(), bytes.data() + (n - n_test) * len, n_test * len);
  Ledger::instance().add(MemoryCategory::kData, static_cast<int64_t>(s.train.pixels.size() + s.test.pixels.size()));
  return s;
}

}  // namespace memfl
