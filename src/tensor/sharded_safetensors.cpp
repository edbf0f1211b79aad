#include "tensor/sharded_safetensors.h"

#include <fmt/ranges.h>  // fmt::join (its home since fmt 11; here on 9 too)

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

// An index is a small JSON file; a lying or wrong one must not make us read
// gigabytes. Same bound as a safetensors header.
constexpr uintmax_t kMaxIndexBytes = 100'000'000;
constexpr std::string_view kSingleFileName = "model.safetensors";

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Which file of directory `dir` to open (see ShardedCheckpoint::open).
StatusOr<std::string> resolve_directory(const std::string& dir) {
  std::error_code ec;
  for (std::string_view name : {kSafetensorsIndexName, kSingleFileName}) {
    const fs::path p = fs::path(dir) / name;
    if (fs::is_regular_file(p, ec)) return p.string();
  }
  std::vector<std::string> indexes, files;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const std::string name = it->path().filename().string();
    if (ends_with(name, ".safetensors.index.json")) indexes.push_back(it->path().string());
    if (ends_with(name, ".safetensors")) files.push_back(it->path().string());
  }
  if (ec) return not_found("{}: cannot list: {}", dir, ec.message());
  std::sort(indexes.begin(), indexes.end());
  std::sort(files.begin(), files.end());
  if (indexes.size() == 1) return indexes[0];
  if (indexes.size() > 1) {
    return invalid_argument("{}: holds several indexes ({}) and no {}; name one", dir, fmt::join(indexes, ", "),
                            kSafetensorsIndexName);
  }
  if (files.size() == 1) return files[0];
  if (files.size() > 1) {
    return invalid_argument("{}: holds several .safetensors files ({}) and no index; name one", dir,
                            fmt::join(files, ", "));
  }
  return not_found("{}: holds no {}, no {} and no other .safetensors file", dir, kSafetensorsIndexName,
                   kSingleFileName);
}

struct IndexFile {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
  std::map<std::string, std::string> metadata;
  std::optional<uint64_t> total_size;
};

StatusOr<IndexFile> read_index(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return not_found("{}: cannot open: {}", path, ec.message());
  if (size > kMaxIndexBytes)
    return data_loss("{}: {} bytes, over the {}-byte limit for an index", path, size, kMaxIndexBytes);
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("{}: cannot open: {}", path, std::strerror(errno));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return data_loss("{}: not valid JSON: {}", path, e.what());
  }
  if (!j.is_object()) return data_loss("{}: not a JSON object", path);
  IndexFile index;
  if (j.contains("metadata") && !j["metadata"].is_null()) {
    const auto& m = j["metadata"];
    if (!m.is_object()) return data_loss("{}: metadata is not an object", path);
    for (auto it = m.begin(); it != m.end(); ++it) {
      index.metadata[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
    }
    if (m.contains("total_size")) {
      const auto& t = m["total_size"];
      if (t.is_number_unsigned()) {
        index.total_size = t.get<uint64_t>();
      } else if (t.is_number_float() && std::isfinite(t.get<double>()) && t.get<double>() >= 0) {
        index.total_size = static_cast<uint64_t>(t.get<double>());
      }
    }
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
    return data_loss("{}: has no weight_map object (not a safetensors index?)", path);
  }
  const auto& wm = j["weight_map"];
  if (wm.empty()) return data_loss("{}: weight_map is empty", path);
  for (auto it = wm.begin(); it != wm.end(); ++it) {
    if (!it.value().is_string()) return data_loss("{}: weight_map['{}'] is not a file name", path, it.key());
    std::string shard = it.value().get<std::string>();
    const fs::path p(shard);
    bool escapes = shard.empty() || p.is_absolute();
    for (const auto& part : p) escapes = escapes || part == "..";
    if (escapes) {
      return data_loss("{}: weight_map['{}'] is '{}', not a file beside the index", path, it.key(), shard);
    }
    index.weight_map[it.key()] = std::move(shard);
  }
  return index;
}

// The tensors of one opened shard, with their offsets in its data section.
std::vector<CheckpointTensor> tensors_of(const SafetensorsFile& file, size_t shard) {
  std::vector<CheckpointTensor> out;
  out.reserve(file.tensors().size());
  size_t offset = 0;  // open() checked that the tensors tile the data in this order
  for (const auto& t : file.tensors()) {
    out.push_back({t.name, t.dtype, t.shape, shard, offset, t.data.size()});
    offset += t.data.size();
  }
  return out;
}

bool same_tensor(const CheckpointTensor& a, const CheckpointTensor& b) {
  return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.data_offset == b.data_offset &&
         a.nbytes == b.nbytes;
}

Status write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return not_found("{}: cannot write: {}", tmp, std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok = (std::fflush(f) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    return internal_error("{}: write failed: {}", path, std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return internal_error("{}: rename from {} failed: {}", path, tmp, std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace

size_t CheckpointTensor::numel() const {
  size_t n = 1;
  for (auto d : shape) n *= static_cast<size_t>(d);
  return n;
}

const CheckpointTensor* ShardedCheckpoint::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

size_t ShardedCheckpoint::payload_bytes() const {
  size_t n = 0;
  for (const auto& t : tensors_) n += t.nbytes;
  return n;
}

StatusOr<ShardedCheckpoint> ShardedCheckpoint::open(const std::string& path) {
  std::string file = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    MEMFL_ASSIGN_OR_RETURN(file, resolve_directory(path));
  }
  ShardedCheckpoint ckpt;
  if (!ends_with(file, ".json")) {  // one plain safetensors file
    MEMFL_ASSIGN_OR_RETURN(auto single, SafetensorsFile::open(file));
    ckpt.shards_ = {file};
    ckpt.tensors_ = tensors_of(*single, 0);
    ckpt.metadata_ = single->metadata();
    for (size_t i = 0; i < ckpt.tensors_.size(); ++i) ckpt.by_name_.emplace(ckpt.tensors_[i].name, i);
    return ckpt;
  }

  MEMFL_ASSIGN_OR_RETURN(IndexFile index, read_index(file));
  ckpt.index_path_ = file;
  ckpt.metadata_ = index.metadata;
  ckpt.index_total_size_ = index.total_size;
  const auto write_id = index.metadata.find(std::string(kShardWriteIdKey));

  // Shards in name order (HF's zero-padded names: shard number order).
  std::set<std::string> shard_names;
  for (const auto& [tensor, shard] : index.weight_map) shard_names.insert(shard);
  std::map<std::string, size_t> shard_number;
  const fs::path dir = fs::path(file).parent_path();
  for (const auto& name : shard_names) {
    shard_number.emplace(name, ckpt.shards_.size());
    ckpt.shards_.push_back((dir / name).string());
  }

  // One shard mapped at a time: its header is checked and read, then it is
  // unmapped when `shard` goes out of scope.
  for (size_t i = 0; i < ckpt.shards_.size(); ++i) {
    const std::string& shard_path = ckpt.shards_[i];
    auto shard = SafetensorsFile::open(shard_path);
    if (!shard.ok()) return shard.status().with_context(fmt::format("shard of {}", file));
    if (write_id != index.metadata.end()) {
      auto it = (*shard)->metadata().find(std::string(kShardWriteIdKey));
      const std::string got = it == (*shard)->metadata().end() ? "(none)" : it->second;
      if (got != write_id->second) {
        return data_loss(
            "{}: {} is {} but the index {} says {}: the shards are of different writes (an interrupted save?)",
            shard_path, kShardWriteIdKey, got, file, write_id->second);
      }
    }
    for (auto& t : tensors_of(**shard, i)) {
      if (auto seen = ckpt.by_name_.find(t.name); seen != ckpt.by_name_.end()) {
        return data_loss("{}: tensor '{}' is also in {}", shard_path, t.name,
                         ckpt.shards_[ckpt.tensors_[seen->second].shard]);
      }
      ckpt.by_name_.emplace(t.name, ckpt.tensors_.size());
      ckpt.tensors_.push_back(std::move(t));
    }
  }
  for (const auto& t : ckpt.tensors_) {
    auto listed = index.weight_map.find(t.name);
    if (listed == index.weight_map.end()) {
      return data_loss("{}: tensor '{}' is in this shard but not in the index {}", ckpt.shards_[t.shard], t.name, file);
    }
    if (shard_number.at(listed->second) != t.shard) {
      return data_loss("{}: tensor '{}' is in this shard but the index {} puts it in {}", ckpt.shards_[t.shard], t.name,
                       file, listed->second);
    }
  }
  for (const auto& [tensor, shard] : index.weight_map) {
    if (ckpt.by_name_.find(tensor) == ckpt.by_name_.end()) {
      return data_loss("{}: tensor '{}' is listed for this shard in the index {} but the shard lacks it",
                       ckpt.shards_[shard_number.at(shard)], tensor, file);
    }
  }
  return ckpt;
}

StatusOr<Layout> ShardedCheckpoint::layout() const {
  LayoutBuilder b;
  for (const auto& t : tensors_) b.add(t.name, t.dtype, t.shape);
  return std::move(b).build();
}

Status ShardedCheckpoint::load_into(const Layout& layout, Arena& arena) const {
  const std::string& source = sharded() ? index_path_ : shards_.front();
  if (arena.size() < layout.total_bytes()) {
    return failed_precondition("{}: arena of {} bytes is smaller than the layout's {}", source, arena.size(),
                               layout.total_bytes());
  }
  // Every check that the headers allow, before any copy.
  std::unordered_map<std::string_view, const LayoutEntry*> entries;
  for (const auto& e : layout.entries()) entries.emplace(e.name, &e);
  for (const auto& t : tensors_) {
    auto it = entries.find(t.name);
    if (it == entries.end()) return invalid_argument("{}: tensor '{}' is not in the model", shard_of(t), t.name);
    const LayoutEntry& e = *it->second;
    if (t.dtype != e.dtype) {
      return invalid_argument("{}: tensor '{}' is {} in the file but {} in the model", shard_of(t), t.name,
                              dtype_name(t.dtype), dtype_name(e.dtype));
    }
    if (t.shape != e.shape) {
      return invalid_argument("{}: tensor '{}' has shape [{}] in the file but [{}] in the model", shard_of(t), t.name,
                              fmt::join(t.shape, ","), fmt::join(e.shape, ","));
    }
  }
  for (const auto& e : layout.entries()) {
    if (find(e.name) == nullptr) return invalid_argument("{}: tensor '{}' is missing", source, e.name);
  }

  // Shard by shard: map, check it is the shard open() saw, copy, unmap.
  auto expected = tensors_.begin();  // tensors_ is ordered by shard, then offset
  for (size_t i = 0; i < shards_.size(); ++i) {
    auto shard = SafetensorsFile::open(shards_[i]);
    if (!shard.ok())
      return sharded() ? shard.status().with_context(fmt::format("shard of {}", source)) : shard.status();
    for (const auto& t : tensors_of(**shard, i)) {
      if (expected == tensors_.end() || expected->shard != i || !same_tensor(*expected, t)) {
        return data_loss("{}: changed since the checkpoint was opened (tensor '{}')", shards_[i], t.name);
      }
      ++expected;
    }
    if (expected != tensors_.end() && expected->shard == i) {
      return data_loss("{}: changed since the checkpoint was opened (tensor '{}' is gone)", shards_[i], expected->name);
    }
    MEMFL_RETURN_IF_ERROR((*shard)->copy_into(layout, arena));
  }
  return Status::Ok();
}

Status write_sharded_safetensors(const std::string& dir, const Layout& layout, const Arena& arena,
                                 size_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  if (layout.size() == 0) return invalid_argument("{}: the layout has no tensors to write", dir);
  if (max_shard_bytes == 0) return invalid_argument("{}: max_shard_bytes must be positive", dir);
  if (arena.size() < layout.total_bytes()) {
    return failed_precondition("{}: arena of {} bytes is smaller than the layout's {}", dir, arena.size(),
                               layout.total_bytes());
  }
  // Shards as [begin, end) ranges of layout entries, greedily in layout order.
  const auto& all = layout.entries();
  std::vector<std::pair<size_t, size_t>> ranges;
  size_t begin = 0, bytes = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const size_t n = all[i].nbytes();
    if (i > begin && bytes + n > max_shard_bytes) {
      ranges.emplace_back(begin, i);
      begin = i;
      bytes = 0;
    }
    bytes += n;
  }
  ranges.emplace_back(begin, all.size());
  if (ranges.size() > 99999) {
    return invalid_argument("{}: {} shards of at most {} bytes; the file names allow 99999", dir, ranges.size(),
                            max_shard_bytes);
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return not_found("{}: cannot create: {}", dir, ec.message());

  std::random_device rd;
  const std::string write_id = fmt::format("{:08x}{:08x}", rd(), rd());
  std::map<std::string, std::string> shard_metadata = metadata;
  shard_metadata.emplace("format", "pt");
  shard_metadata[std::string(kShardWriteIdKey)] = write_id;

  nlohmann::json weight_map = nlohmann::json::object();
  std::set<std::string> written;
  for (size_t k = 0; k < ranges.size(); ++k) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, ranges.size());
    const auto [b, e] = ranges[k];
    MEMFL_RETURN_IF_ERROR(write_safetensors(
        (fs::path(dir) / name).string(), std::span<const LayoutEntry>(all).subspan(b, e - b), arena, shard_metadata));
    for (size_t i = b; i < e; ++i) weight_map[all[i].name] = name;
    written.insert(name);
  }
  nlohmann::json index_metadata = nlohmann::json::object();
  for (const auto& [k, v] : metadata) index_metadata[k] = v;
  index_metadata["total_size"] = layout.payload_bytes();
  index_metadata[std::string(kShardWriteIdKey)] = write_id;
  const nlohmann::json index = {{"metadata", index_metadata}, {"weight_map", weight_map}};
  MEMFL_RETURN_IF_ERROR(write_text_atomically((fs::path(dir) / kSafetensorsIndexName).string(), index.dump(2) + "\n"));

  // Shards of an older, larger checkpoint in the same place are now unnamed.
  static const std::regex kShardName(R"(model-\d{5}-of-\d{5}\.safetensors)");
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (std::regex_match(name, kShardName) && written.count(name) == 0) stale.push_back(it->path());
  }
  for (const auto& p : stale) fs::remove(p, ec);  // best effort: the index no longer names them
  return Status::Ok();
}

}  // namespace memfl
