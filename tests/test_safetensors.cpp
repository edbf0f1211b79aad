#include <gtest/gtest.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "memory/sampler.h"
#include "tensor/safetensors.h"
#include "tensor/sharded_safetensors.h"
#include "test_util.h"

namespace memfl {
namespace {

using testing::TempDir;

Layout sample_layout() {
  LayoutBuilder b;
  b.add("conv.weight", DType::kF32, {4, 1, 3, 3})
      .add("conv.bias", DType::kBF16, {4})
      .add("bn.num_batches_tracked", DType::kI64, {})
      .add("mask", DType::kU8, {5})
      .add("half", DType::kF16, {3});
  return std::move(b).build().value();
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}
std::string header_of(const std::string& file) {
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  return file.substr(8, n);
}
std::string with_header(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  TempDir tmp;
  Layout l = sample_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 7);
  ASSERT_TRUE(write_safetensors(tmp.file("m.safetensors"), l, a, {{"round", "3"}}).ok());

  auto f = SafetensorsFile::open(tmp.file("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->metadata().at("round"), "3");
  auto l2 = (*f)->layout();
  ASSERT_TRUE(l2.ok());
  EXPECT_EQ(l2->hash(), l.hash());  // same order, dtypes, shapes, offsets
  Arena b(l.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE((*f)->load_into(l, b).ok());
  for (const auto& e : l.entries()) {
    EXPECT_EQ(std::memcmp(a.data() + e.offset, b.data() + e.offset, e.nbytes()), 0) << e.name;
  }
  // The header is what the ecosystem expects: 8-byte aligned, standard dtype names.
  const std::string raw = read_all(tmp.file("m.safetensors"));
  EXPECT_EQ((8 + header_of(raw).size()) % 8, 0u);
  EXPECT_NE(header_of(raw).find("\"dtype\":\"BF16\""), std::string::npos);
}

// A written model file leaves the page cache once it is synced: a server
// writes one the size of the model every round, and a cached one would fill
// memory until the kernel reclaimed it during the next round. Counted with
// mincore() over a mapping of the file (what the kernel holds in memory),
// not by the writer.
TEST(Safetensors, AWrittenModelFileIsNotLeftInThePageCache) {
  TempDir tmp;
  struct statfs fs {};
  ASSERT_EQ(::statfs(tmp.path.c_str(), &fs), 0);
  if (fs.f_type == TMPFS_MAGIC) GTEST_SKIP() << "tmpfs: its pages are the file, they cannot leave memory";
  LayoutBuilder b;
  b.add("w", DType::kF32, {16 << 20});  // 64 MiB
  const Layout l = std::move(b).build().value();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 3);
  const std::string path = tmp.file("m.safetensors");
  ASSERT_TRUE(write_safetensors(path, l, a).ok());
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  const size_t size = std::filesystem::file_size(path);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(map, MAP_FAILED);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size + page - 1) / page);
  ASSERT_EQ(::mincore(map, size, resident.data()), 0);
  ::munmap(map, size);
  const auto cached = std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
  // Written and synced but kept, all 16 384 pages would be cached.
  EXPECT_LT(cached, static_cast<long>(resident.size() / 10)) << cached << " of " << resident.size() << " pages cached";
}

TEST(Safetensors, RejectsTruncatedFile) {
  TempDir tmp;
  Layout l = sample_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(write_safetensors(tmp.file("m.safetensors"), l, a).ok());
  const std::string raw = read_all(tmp.file("m.safetensors"));
  for (size_t cut : {raw.size() - 1, raw.size() - 20, size_t{30}, size_t{5}}) {
    write_all(tmp.file("cut.safetensors"), raw.substr(0, cut));
    auto f = SafetensorsFile::open(tmp.file("cut.safetensors"));
    ASSERT_FALSE(f.ok()) << "cut at " << cut;
    EXPECT_EQ(f.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(f.status().message().find("cut.safetensors"), std::string::npos) << f.status().message();
  }
}

TEST(Safetensors, RejectsLyingHeaders) {
  TempDir tmp;
  const std::string data(16, '\1');
  struct Case {
    std::string header, expect;
  } cases[] = {
      {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", "claims 12 bytes"},
      {R"({"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", "truncated"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", "hole or overlap"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "cover 8 data bytes"},
      {R"({"w":{"dtype":"Q4","shape":[4],"data_offsets":[0,16]}})", "unsupported dtype"},
      {R"({"w":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", "non-natural"},
      {R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})", "reversed"},
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,16]}})", "overflows"},
      {R"({"w":{"dtype":"F32","shape":[4]}})", "lacks"},
      {R"({"w": nope})", "not valid JSON"},
  };
  for (const auto& c : cases) {
    write_all(tmp.file("bad.safetensors"), with_header(c.header, data));
    auto f = SafetensorsFile::open(tmp.file("bad.safetensors"));
    ASSERT_FALSE(f.ok()) << c.header;
    EXPECT_NE(f.status().message().find(c.expect), std::string::npos) << f.status().message();
  }
  // A header length larger than the file.
  std::string raw = with_header("{}", "");
  uint64_t lie = 1u << 20;
  std::memcpy(raw.data(), &lie, 8);
  write_all(tmp.file("len.safetensors"), raw);
  auto f = SafetensorsFile::open(tmp.file("len.safetensors"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("runs past the end"), std::string::npos) << f.status().message();
}

TEST(Safetensors, ADeeplyNestedHeaderIsRefusedBeforeParsing) {
  TempDir tmp;
  const std::string data(16, '\1');
  // 8 MiB of '[': before, the parser kept a frame per level (gigabytes for
  // the 98 MB file of the report) before failing.
  write_all(tmp.file("deep.safetensors"), with_header(std::string(8 << 20, '['), data));
  const int64_t before = read_peak_rss_bytes();
  auto f = SafetensorsFile::open(tmp.file("deep.safetensors"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("nests more than 16 levels"), std::string::npos) << f.status().message();
  EXPECT_NE(f.status().message().find("deep.safetensors"), std::string::npos);
  EXPECT_LT(read_peak_rss_bytes() - before, int64_t{32} << 20) << "the file is mapped, nothing is parsed";
  // Brackets inside strings are text, not nesting: a valid file whose tensor
  // name is full of them still opens.
  const std::string name = std::string(40, '[') + "w" + std::string(40, '{');
  write_all(tmp.file("names.safetensors"),
            with_header("{\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", data));
  auto ok = SafetensorsFile::open(tmp.file("names.safetensors"));
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_NE((*ok)->find(name), nullptr);
}

TEST(Safetensors, LoadIntoChecksNamesShapesAndDtypes) {
  TempDir tmp;
  Layout l = sample_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(write_safetensors(tmp.file("m.safetensors"), l, a).ok());
  auto f = SafetensorsFile::open(tmp.file("m.safetensors"));
  ASSERT_TRUE(f.ok());

  LayoutBuilder other;
  other.add("conv.weight", DType::kF32, {4, 1, 3, 3})
      .add("conv.bias", DType::kBF16, {5})
      .add("bn.num_batches_tracked", DType::kI64, {})
      .add("mask", DType::kU8, {5})
      .add("half", DType::kF16, {3});
  Layout lo = std::move(other).build().value();
  Arena b(lo.total_bytes(), MemoryCategory::kModel);
  Status s = (*f)->load_into(lo, b);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'conv.bias' has shape [4] in the file but [5]"), std::string::npos) << s.message();

  LayoutBuilder missing;
  missing.add("conv.weight", DType::kF32, {4, 1, 3, 3});
  Layout lm = std::move(missing).build().value();
  Arena c(lm.total_bytes(), MemoryCategory::kModel);
  s = (*f)->load_into(lm, c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is not in the model"), std::string::npos) << s.message();
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto f = SafetensorsFile::open("/nonexistent/x.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("/nonexistent/x.safetensors"), std::string::npos);
}

// --- sharded checkpoints (tensor/sharded_safetensors.h) ---

// f32 and bf16 tensors of varied shapes; with kShardMax, four shards, one of
// which holds only lm_head (larger than kShardMax on its own).
constexpr size_t kShardMax = 4096;
Layout llm_layout() {
  LayoutBuilder b;
  b.add("embed.weight", DType::kF32, {64, 16})                   // 4096 B
      .add("layers.0.attn.q.weight", DType::kBF16, {16, 16})     // 512
      .add("layers.0.attn.q.bias", DType::kBF16, {16})           // 32
      .add("layers.0.mlp.up.weight", DType::kF32, {32, 16})      // 2048
      .add("layers.0.mlp.down.weight", DType::kBF16, {16, 32})   // 1024
      .add("layers.0.norm.weight", DType::kF32, {16})            // 64
      .add("lm_head.weight", DType::kF32, {100, 16})             // 6400
      .add("logit_scale", DType::kF32, {})                       // 4
      .add("layers.1.attn.k.weight", DType::kBF16, {8, 2, 16});  // 512
  return std::move(b).build().value();
}

std::string shard_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

void expect_same_tensors(const Layout& l, const Arena& a, const Arena& b) {
  for (const auto& e : l.entries()) {
    EXPECT_EQ(std::memcmp(a.data() + e.offset, b.data() + e.offset, e.nbytes()), 0) << e.name;
  }
}

nlohmann::ordered_json read_json(const std::string& path) { return nlohmann::ordered_json::parse(read_all(path)); }
void write_json(const std::string& path, const nlohmann::ordered_json& j) { write_all(path, j.dump(2)); }

TEST(ShardedSafetensors, RoundTripsThroughSeveralShards) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 11);
  const std::string dir = tmp.file("ckpt");
  ASSERT_TRUE(write_sharded_safetensors(dir, l, a, kShardMax, {{"round", "5"}}).ok());

  // HF's names and index.
  for (int i = 1; i <= 4; ++i) EXPECT_TRUE(std::filesystem::exists(dir + "/" + shard_name(i, 4))) << i;
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + shard_name(5, 5)));
  auto index = read_json(dir + "/model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"].get<size_t>(), l.payload_bytes());
  EXPECT_EQ(index["weight_map"].size(), l.size());
  EXPECT_EQ(index["weight_map"]["lm_head.weight"], shard_name(3, 4));
  // Every shard within the bound unless it is one tensor larger than it.
  for (int i = 1; i <= 4; ++i) {
    auto shard = SafetensorsFile::open(dir + "/" + shard_name(i, 4));
    ASSERT_TRUE(shard.ok()) << shard.status().to_string();
    size_t bytes = 0;
    for (const auto& t : (*shard)->tensors()) bytes += t.data.size();
    EXPECT_TRUE(bytes <= kShardMax || (*shard)->tensors().size() == 1) << shard_name(i, 4) << ": " << bytes;
    EXPECT_EQ((*shard)->metadata().at("format"), "pt");  // transformers requires it
    EXPECT_EQ((*shard)->metadata().at("round"), "5");
  }

  // Open the directory or the index: the same checkpoint.
  for (const std::string& path : {dir, dir + "/model.safetensors.index.json"}) {
    auto ckpt = ShardedCheckpoint::open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
    EXPECT_TRUE(ckpt->sharded());
    EXPECT_EQ(ckpt->shards().size(), 4u);
    EXPECT_EQ(ckpt->tensors().size(), l.size());
    EXPECT_EQ(ckpt->payload_bytes(), l.payload_bytes());
    EXPECT_EQ(ckpt->index_total_size(), l.payload_bytes());
    EXPECT_EQ(ckpt->metadata().at("round"), "5");
    ASSERT_NE(ckpt->find("lm_head.weight"), nullptr);
    EXPECT_NE(ckpt->shard_of(*ckpt->find("lm_head.weight")).find(shard_name(3, 4)), std::string::npos);
    auto l2 = ckpt->layout();
    ASSERT_TRUE(l2.ok());
    EXPECT_EQ(l2->hash(), l.hash());  // shard order then offset order = the layout's order
    Arena b(l.total_bytes(), MemoryCategory::kModel);
    Status s = ckpt->load_into(l, b);
    ASSERT_TRUE(s.ok()) << s.to_string();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), l.total_bytes()), 0);
    // Neither open nor load leaves a shard mapped.
    EXPECT_EQ(read_all("/proc/self/maps").find(dir), std::string::npos);
  }

  // One big shard: still an index, and the four older shards are gone.
  ASSERT_TRUE(write_sharded_safetensors(dir, l, a, size_t{1} << 30).ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + shard_name(1, 1)));
  for (int i = 1; i <= 4; ++i) EXPECT_FALSE(std::filesystem::exists(dir + "/" + shard_name(i, 4))) << i;
  auto one = ShardedCheckpoint::open(dir);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ(one->shards().size(), 1u);
  Arena c(l.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(one->load_into(l, c).ok());
  expect_same_tensors(l, a, c);
}

// Shards written by hand: tensors in each shard in a shuffled order, the
// index's weight_map in yet another order. Loads into the original layout.
TEST(ShardedSafetensors, ShuffledShardsAndIndexLoadIdentically) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 12);
  std::vector<LayoutEntry> entries = l.entries();
  std::mt19937 rng(3);
  std::shuffle(entries.begin(), entries.end(), rng);
  const std::vector<std::vector<LayoutEntry>> shards = {{entries.begin(), entries.begin() + 3},
                                                        {entries.begin() + 3, entries.begin() + 5},
                                                        {entries.begin() + 5, entries.end()}};
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  std::vector<std::pair<std::string, std::string>> listed;
  for (size_t k = 0; k < shards.size(); ++k) {
    std::vector<LayoutEntry> in_shard = shards[k];
    std::shuffle(in_shard.begin(), in_shard.end(), rng);
    const std::string name = shard_name(static_cast<int>(k) + 1, 3);
    ASSERT_TRUE(write_safetensors(tmp.file(name), std::span<const LayoutEntry>(in_shard), a).ok());
    for (const auto& e : in_shard) listed.emplace_back(e.name, name);
    auto f = SafetensorsFile::open(tmp.file(name));
    ASSERT_TRUE(f.ok());
    EXPECT_EQ((*f)->tensors().front().name, in_shard.front().name);  // the data really is in shuffled order
  }
  std::sort(listed.begin(), listed.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  for (const auto& [tensor, shard] : listed) weight_map[tensor] = shard;
  write_json(tmp.file("model.safetensors.index.json"),
             {{"metadata", {{"total_size", l.payload_bytes()}}}, {"weight_map", weight_map}});

  auto ckpt = ShardedCheckpoint::open(tmp.path.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  EXPECT_EQ(ckpt->shards().size(), 3u);
  Arena b(l.total_bytes(), MemoryCategory::kModel);
  Status s = ckpt->load_into(l, b);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_same_tensors(l, a, b);
  // Its own layout (shard, then offset order) differs from l's order but
  // names the same tensors, and loads the same bytes.
  auto own = ckpt->layout();
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->size(), l.size());
  EXPECT_NE(own->hash(), l.hash());
  Arena c(own->total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(ckpt->load_into(*own, c).ok());
  for (const auto& e : own->entries()) {
    const LayoutEntry* orig = l.find(e.name);
    ASSERT_NE(orig, nullptr);
    EXPECT_EQ(std::memcmp(c.data() + e.offset, a.data() + orig->offset, e.nbytes()), 0) << e.name;
  }
}

TEST(Safetensors, SingleFileWithShuffledOrderLoadsIdentically) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 13);
  std::vector<LayoutEntry> entries = l.entries();
  std::reverse(entries.begin(), entries.end());
  std::swap(entries[1], entries[4]);
  ASSERT_TRUE(write_safetensors(tmp.file("m.safetensors"), std::span<const LayoutEntry>(entries), a).ok());

  auto f = SafetensorsFile::open(tmp.file("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ((*f)->tensors().front().name, entries.front().name);
  Arena b(l.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE((*f)->load_into(l, b).ok());
  expect_same_tensors(l, a, b);

  // ShardedCheckpoint takes a single file, or a directory holding one.
  for (const std::string& path : {tmp.file("m.safetensors"), tmp.path.string()}) {
    auto ckpt = ShardedCheckpoint::open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
    EXPECT_FALSE(ckpt->sharded());
    EXPECT_EQ(ckpt->shards().size(), 1u);
    Arena c(l.total_bytes(), MemoryCategory::kModel);
    Status s = ckpt->load_into(l, c);
    ASSERT_TRUE(s.ok()) << s.to_string();
    expect_same_tensors(l, a, c);
  }
}

TEST(ShardedSafetensors, TruncatedShardIsNamed) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 14);
  const std::string dir = tmp.file("ckpt");
  ASSERT_TRUE(write_sharded_safetensors(dir, l, a, kShardMax).ok());
  const std::string victim = dir + "/" + shard_name(2, 4);
  const auto size = std::filesystem::file_size(victim);

  // Truncated after open: load_into maps each shard again and notices.
  auto ckpt = ShardedCheckpoint::open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();
  std::filesystem::resize_file(victim, size - 10);
  Arena b(l.total_bytes(), MemoryCategory::kModel);
  Status s = ckpt->load_into(l, b);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find(shard_name(2, 4)), std::string::npos) << s.message();

  // Truncated before open.
  for (auto cut : {size - 1, size / 2, decltype(size){20}, decltype(size){3}}) {
    std::filesystem::resize_file(victim, cut);
    auto again = ShardedCheckpoint::open(dir);
    ASSERT_FALSE(again.ok()) << "cut at " << cut;
    EXPECT_EQ(again.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(again.status().message().find(shard_name(2, 4)), std::string::npos) << again.status().message();
  }
}

TEST(ShardedSafetensors, IndexNamingAMissingShardIsNamed) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  const std::string dir = tmp.file("ckpt");
  ASSERT_TRUE(write_sharded_safetensors(dir, l, a, kShardMax).ok());
  const std::string index_path = dir + "/model.safetensors.index.json";
  const auto index = read_json(index_path);

  std::filesystem::remove(dir + "/" + shard_name(3, 4));
  auto ckpt = ShardedCheckpoint::open(dir);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_EQ(ckpt.status().code(), StatusCode::kNotFound);
  EXPECT_NE(ckpt.status().message().find(shard_name(3, 4)), std::string::npos) << ckpt.status().message();

  ASSERT_TRUE(write_sharded_safetensors(dir, l, a, kShardMax).ok());
  auto edited = read_json(index_path);
  edited["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors";
  write_json(index_path, edited);
  ckpt = ShardedCheckpoint::open(index_path);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_NE(ckpt.status().message().find("model-00009-of-00009.safetensors"), std::string::npos)
      << ckpt.status().message();

  // A shard name that leaves the index's directory is refused outright.
  edited["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors";
  write_json(index_path, edited);
  ckpt = ShardedCheckpoint::open(index_path);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_NE(ckpt.status().message().find("not a file beside the index"), std::string::npos) << ckpt.status().message();
}

TEST(ShardedSafetensors, IndexAndShardsMustAgree) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  const std::string dir = tmp.file("ckpt");
  ASSERT_TRUE(write_sharded_safetensors(dir, l, a, kShardMax).ok());
  const std::string index_path = dir + "/model.safetensors.index.json";
  const auto index = read_json(index_path);
  auto expect_error = [&](const nlohmann::ordered_json& j, const std::string& a_part, const std::string& b_part) {
    write_json(index_path, j);
    auto ckpt = ShardedCheckpoint::open(dir);
    ASSERT_FALSE(ckpt.ok()) << j.dump();
    EXPECT_EQ(ckpt.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(ckpt.status().message().find(a_part), std::string::npos) << ckpt.status().message();
    EXPECT_NE(ckpt.status().message().find(b_part), std::string::npos) << ckpt.status().message();
  };

  // In the index, absent from its shard.
  auto j = index;
  j["weight_map"]["ghost.weight"] = shard_name(1, 4);
  expect_error(j, "'ghost.weight'", shard_name(1, 4) + ": tensor 'ghost.weight' is listed");
  // In a shard, absent from the index.
  j = index;
  j["weight_map"].erase("layers.0.norm.weight");
  expect_error(j, "'layers.0.norm.weight' is in this shard but not in the index", shard_name(2, 4));
  // In a shard, but the index puts it in another.
  j = index;
  j["weight_map"]["layers.0.norm.weight"] = shard_name(4, 4);
  expect_error(j, "puts it in " + shard_name(4, 4), shard_name(2, 4));
  // Not an index at all.
  expect_error(nlohmann::ordered_json{{"metadata", {}}}, "no weight_map", "model.safetensors.index.json");

  // The same tensor in two shards (a shard written by hand: no write id).
  Layout extra =
      std::move(LayoutBuilder().add("logit_scale", DType::kF32, {}).add("more", DType::kF32, {2})).build().value();
  Arena ea(extra.total_bytes(), MemoryCategory::kModel);
  ASSERT_TRUE(write_safetensors(dir + "/" + shard_name(1, 4), extra, ea).ok());
  j = index;
  j["metadata"].erase(std::string(kShardWriteIdKey));
  j["weight_map"].erase("embed.weight");
  for (const auto& e : extra.entries()) j["weight_map"][e.name] = shard_name(1, 4);
  expect_error(j, shard_name(4, 4) + ": tensor 'logit_scale' is also in", shard_name(1, 4));
}

TEST(ShardedSafetensors, ShardsOfAnotherWriteAreRefused) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel), b(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 15);
  testing::fill_random(l, b, 16);
  ASSERT_TRUE(write_sharded_safetensors(tmp.file("old"), l, a, kShardMax).ok());
  ASSERT_TRUE(write_sharded_safetensors(tmp.file("new"), l, b, kShardMax).ok());
  // A rewrite in place that stopped after its second shard: same names and
  // tensors, other bytes. Loading it would mix two models.
  std::filesystem::copy_file(tmp.file("new") + "/" + shard_name(2, 4), tmp.file("old") + "/" + shard_name(2, 4),
                             std::filesystem::copy_options::overwrite_existing);
  auto ckpt = ShardedCheckpoint::open(tmp.file("old"));
  ASSERT_FALSE(ckpt.ok());
  EXPECT_NE(ckpt.status().message().find("different writes"), std::string::npos) << ckpt.status().message();
  EXPECT_NE(ckpt.status().message().find(shard_name(2, 4)), std::string::npos) << ckpt.status().message();
}

TEST(ShardedSafetensors, LoadChecksTheModelBeforeCopying) {
  TempDir tmp;
  Layout l = llm_layout();
  Arena a(l.total_bytes(), MemoryCategory::kModel);
  testing::fill_random(l, a, 17);
  ASSERT_TRUE(write_sharded_safetensors(tmp.path.string(), l, a, kShardMax).ok());
  auto ckpt = ShardedCheckpoint::open(tmp.path.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().to_string();

  LayoutBuilder wrong;
  for (const auto& e : l.entries()) {
    wrong.add(e.name, e.dtype, e.name == "lm_head.weight" ? std::vector<int64_t>{100, 17} : e.shape);
  }
  Layout lw = std::move(wrong).build().value();
  Arena b(lw.total_bytes(), MemoryCategory::kModel);
  Status s = ckpt->load_into(lw, b);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(
      s.message().find(shard_name(3, 4) + ": tensor 'lm_head.weight' has shape [100,16] in the file but [100,17]"),
      std::string::npos)
      << s.message();
  for (auto byte : b.bytes()) ASSERT_EQ(byte, std::byte{0});  // nothing copied

  LayoutBuilder fewer;
  fewer.add("embed.weight", DType::kF32, {64, 16});
  Layout lf = std::move(fewer).build().value();
  Arena c(lf.total_bytes(), MemoryCategory::kModel);
  s = ckpt->load_into(lf, c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("is not in the model"), std::string::npos) << s.message();

  LayoutBuilder more;
  for (const auto& e : l.entries()) more.add(e.name, e.dtype, e.shape);
  more.add("extra.bias", DType::kF32, {3});
  Layout lm = std::move(more).build().value();
  Arena d(lm.total_bytes(), MemoryCategory::kModel);
  s = ckpt->load_into(lm, d);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("'extra.bias' is missing"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

// A full disk under file-backed arenas: an 8 MiB tmpfs (the tests run as
// root, as CI does), arenas of 64 MiB. Sparse files would map and then die
// of SIGBUS at the first page the disk cannot hold; reserved blocks fail at
// once with the file named.
TEST(FileBackedArena, AFullDiskIsAnErrorNamingTheFileNotASigbus) {
  testing::TempDir tmp;
  const std::string small = tmp.file("small");
  std::filesystem::create_directories(small);
  ASSERT_EQ(std::system(("mount -t tmpfs -o size=8m tmpfs " + small).c_str()), 0)
      << "this test mounts an 8 MiB tmpfs: it needs root, as CI has";
  struct Unmount {
    std::string dir;
    ~Unmount() { (void)std::system(("umount " + dir).c_str()); }
  } unmount{small};
  auto scratch = Arena::scratch_file(small, 64 << 20, MemoryCategory::kModel);
  ASSERT_FALSE(scratch.ok());
  EXPECT_NE(scratch.status().message().find(small), std::string::npos) << scratch.status().message();
  EXPECT_NE(scratch.status().message().find("cannot reserve"), std::string::npos) << scratch.status().message();
  const std::string file = small + "/model.bin";
  auto mapped = Arena::map_file(file, 0, 64 << 20, /*writable=*/true, MemoryCategory::kModel);
  ASSERT_FALSE(mapped.ok());
  EXPECT_NE(mapped.status().message().find(file), std::string::npos) << mapped.status().message();
  // What fits is reserved whole and can be written to its last byte.
  auto fits = Arena::scratch_file(small, 4 << 20, MemoryCategory::kModel);
  ASSERT_TRUE(fits.ok()) << fits.status().to_string();
  std::memset(fits->data(), 0x5a, fits->size());
  EXPECT_EQ(fits->data()[fits->size() - 1], std::byte{0x5a});
}

}  // namespace
}  // namespace memfl
