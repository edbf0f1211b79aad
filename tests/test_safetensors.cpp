#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "tensor/safetensors.h"
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

}  // namespace
}  // namespace memfl
