// Replays the corpora of the config, safetensors and frame fuzzers
// (fuzz/corpus_config, fuzz/corpus_safetensors, fuzz/corpus_frames: seeds and
// every input that once crashed) through
// the fuzzers' own entry code (fuzz/fuzz_entries.h). valid_* files must load;
// bad_* files must be refused with a status that says what is wrong; no file
// may crash (the ASan+UBSan build runs this too).
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz/fuzz_entries.h"

namespace memfl {
namespace {

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

// (file name, bytes) of every file in fuzz/<dir>, sorted by name.
std::vector<std::pair<std::string, std::vector<uint8_t>>> corpus(const std::string& dir) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> files;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/fuzz/" + dir)) {
    std::ifstream in(entry.path(), std::ios::binary);
    files.emplace_back(entry.path().filename().string(),
                       std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  }
  std::sort(files.begin(), files.end());
  return files;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// An error from the config loader is a bad argument and names where it came
// from: the file (fuzz.yaml) or the --set.
void expect_config_error(const StatusOr<ExperimentConfig>& c, const std::string& what) {
  ASSERT_FALSE(c.ok()) << what << " loaded";
  const Status s = c.status();
  EXPECT_FALSE(s.message().empty()) << what;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s.to_string();
  EXPECT_TRUE(s.message().find("fuzz.yaml") != std::string::npos || s.message().find("--set") != std::string::npos)
      << what << ": " << s.message();
}

TEST(FuzzCorpus, ConfigLoaderReplaysItsCorpus) {
  int valid = 0, valid_set = 0, bad = 0;
  for (const auto& [name, bytes] : corpus("corpus_config")) {
    SCOPED_TRACE(name);
    const auto out = fuzz::run_config_input(bytes.data(), bytes.size());
    // Whatever the file, every refusal says why.
    for (const auto* c : {&out.whole, &out.with_set}) {
      if (!c->ok()) {
        EXPECT_FALSE(c->status().message().empty());
      }
    }
    if (starts_with(name, "valid_set_")) {
      // First line: one --set on the rest of the file, and it takes effect.
      ASSERT_TRUE(out.with_set.ok()) << out.with_set.status().to_string();
      const auto eq = out.override_line.find('=');
      ASSERT_NE(eq, std::string::npos) << out.override_line;
      const std::string path = out.override_line.substr(0, eq);
      YAML::Node node = YAML::Load(out.with_set->resolved_yaml);
      for (size_t pos = 0; pos <= path.size();) {
        const size_t dot = std::min(path.find('.', pos), path.size());
        node.reset(node[path.substr(pos, dot - pos)]);
        pos = dot + 1;
      }
      ASSERT_TRUE(node.IsScalar()) << path << " in\n" << out.with_set->resolved_yaml;
      EXPECT_EQ(node.Scalar(), YAML::Load(out.override_line.substr(eq + 1)).Scalar()) << path;
      ++valid_set;
    } else if (starts_with(name, "valid_")) {
      ASSERT_TRUE(out.whole.ok()) << out.whole.status().to_string();
      EXPECT_FALSE(out.whole->resolved_yaml.empty());
      EXPECT_EQ(out.whole->source, "fuzz.yaml");
      ++valid;
    } else {
      ASSERT_TRUE(starts_with(name, "bad_")) << "corpus files are valid_* or bad_* (rename crash-* files)";
      expect_config_error(out.whole, "the whole file");
      expect_config_error(out.with_set, "the first line as --set");
      ++bad;
    }
  }
  EXPECT_GE(valid, 5);
  EXPECT_GE(valid_set, 1);
  EXPECT_GE(bad, 20);
}

TEST(FuzzCorpus, SafetensorsReaderReplaysItsCorpus) {
  int valid = 0, bad = 0;
  for (const auto& [name, bytes] : corpus("corpus_safetensors")) {
    SCOPED_TRACE(name);
    const auto out = fuzz::run_safetensors_input(bytes.data(), bytes.size());
    for (const Status* s : {&out.open, &out.layout, &out.load}) {
      if (!s->ok()) {
        EXPECT_FALSE(s->message().empty());
      }
    }
    if (starts_with(name, "valid_")) {
      ASSERT_TRUE(out.open.ok()) << out.open.to_string();
      ASSERT_TRUE(out.layout.ok()) << out.layout.to_string();
      ASSERT_TRUE(out.load.ok()) << out.load.to_string();
      EXPECT_TRUE(out.copied_exactly);
      // As many tensors as the header names (besides __metadata__).
      ASSERT_GE(bytes.size(), 8u);
      uint64_t header_len = 0;
      for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[static_cast<size_t>(i)];
      ASSERT_LE(header_len, bytes.size() - 8);
      const auto header =
          nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_len));
      EXPECT_EQ(out.tensors, header.size() - (header.contains("__metadata__") ? 1 : 0));
      ++valid;
    } else {
      ASSERT_TRUE(starts_with(name, "bad_")) << "corpus files are valid_* or bad_* (rename crash-* files)";
      // Refused when opened, with a message that names the file.
      ASSERT_FALSE(out.open.ok()) << "opened, with " << out.tensors << " tensors";
      EXPECT_EQ(out.open.code(), StatusCode::kDataLoss) << out.open.to_string();
      EXPECT_HAS(out.open.message(), "/proc/self/fd/");
      ++bad;
    }
  }
  EXPECT_GE(valid, 3);
  EXPECT_GE(bad, 20);
}

// valid_* frames (written by memfl's encoder against the fuzz base) rebuild
// the chunk they stand for; bad_* ones (each with one field broken) are
// refused naming the peer and the chunk's offset.
TEST(FuzzCorpus, FrameDecoderReplaysItsCorpus) {
  int valid = 0, bad = 0;
  for (const auto& [name, bytes] : corpus("corpus_frames")) {
    SCOPED_TRACE(name);
    const auto out = fuzz::run_frame_input(bytes.data(), bytes.size());
    for (const Status* s : {&out.at_start, &out.no_base}) {
      if (!s->ok()) {
        EXPECT_HAS(s->message(), "compressed frame from fuzz for the chunk at model offset 0");
      }
    }
    if (starts_with(name, "valid_")) {
      ASSERT_TRUE(out.at_start.ok()) << out.at_start.to_string();
      EXPECT_GT(out.raw_bytes, 0u);
      EXPECT_LE(out.raw_bytes, fuzz::frame_fuzz_layout().total_bytes());
      ++valid;
    } else {
      ASSERT_TRUE(starts_with(name, "bad_")) << "corpus files are valid_* or bad_* (rename crash-* files)";
      ASSERT_FALSE(out.at_start.ok());
      EXPECT_FALSE(out.no_base.ok());
      ++bad;
    }
  }
  EXPECT_GE(valid, 5);
  EXPECT_GE(bad, 6);
}

}  // namespace
}  // namespace memfl
