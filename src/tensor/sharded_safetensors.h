// Sharded safetensors checkpoints, as the Hugging Face ecosystem writes large
// models: shard files `model-00001-of-00004.safetensors`, ... plus an index
// `model.safetensors.index.json`:
//
//   {"metadata": {"total_size": N}, "weight_map": {"tensor.name": "model-00001-of-00004.safetensors", ...}}
//
// ShardedCheckpoint opens a single `.safetensors` file, an index, or a
// directory holding one of them, and presents them the same way: the tensors
// (name, dtype, shape, shard) from the headers only. open() validates every
// shard's header (SafetensorsFile::open) and the index against the shards; it
// maps one shard at a time and keeps none mapped. load_into() goes shard by
// shard — map, copy its tensors into the arena, unmap — so the memory a load
// adds beyond the arena is one shard's pages, not the model's.
//
//   auto ckpt = ShardedCheckpoint::open("models/llama");  // a directory
//   auto layout = ckpt->layout();
//   Arena arena(layout->total_bytes(), MemoryCategory::kModel);
//   MEMFL_RETURN_IF_ERROR(ckpt->load_into(*layout, arena));
//
//   MEMFL_RETURN_IF_ERROR(write_sharded_safetensors("out", *layout, arena, 5ull << 30));
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

// The index file name HF uses, and the one write_sharded_safetensors writes.
inline constexpr std::string_view kSafetensorsIndexName = "model.safetensors.index.json";
// The shard metadata key (and index metadata key) that ties the shards of one
// write_sharded_safetensors call to its index, so that an interrupted rewrite
// in place (new shards beside old ones) is refused instead of loaded mixed.
inline constexpr std::string_view kShardWriteIdKey = "memfl_write_id";

struct CheckpointTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  size_t shard = 0;        // index into ShardedCheckpoint::shards()
  size_t data_offset = 0;  // where its bytes start in the shard's data section
  size_t nbytes = 0;
  size_t numel() const;
};

class ShardedCheckpoint {
 public:
  // `path`: a `.safetensors` file; a `*.index.json` file (shards are found
  // beside it); or a directory, where the first of these is taken:
  // model.safetensors.index.json, model.safetensors, the only
  // *.safetensors.index.json, the only *.safetensors.
  //
  // Errors name the file at fault: a shard that is missing, truncated or has
  // a bad header; a tensor the index lists but its shard lacks; a tensor a
  // shard holds but the index does not list (or puts in another shard); a
  // tensor in two shards; shards of another write (kShardWriteIdKey).
  static StatusOr<ShardedCheckpoint> open(const std::string& path);

  // True when opened through an index (even an index of one shard).
  bool sharded() const { return !index_path_.empty(); }
  // The index file, or empty for a single file.
  const std::string& index_path() const { return index_path_; }
  // Shard paths (the single file's path when not sharded), sorted by name:
  // for HF's zero-padded names that is shard number order.
  const std::vector<std::string>& shards() const { return shards_; }
  // Every tensor, ordered by shard and then by data offset within the shard.
  // For a checkpoint written by write_sharded_safetensors this is the order
  // of the layout it was written from.
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }
  const CheckpointTensor* find(std::string_view name) const;
  const std::string& shard_of(const CheckpointTensor& t) const { return shards_[t.shard]; }
  // The index's "metadata" object (values that are not strings as JSON text,
  // e.g. total_size), or the single file's __metadata__.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The index's metadata.total_size when it is a number. Not checked against
  // the tensors: HF's own indexes do not always agree with them (tied weights).
  std::optional<uint64_t> index_total_size() const { return index_total_size_; }
  // Bytes of tensor data, all shards.
  size_t payload_bytes() const;
  // The layout of these tensors as an arena would hold them, in tensors()
  // order. Computed from the headers; reads no tensor data.
  StatusOr<Layout> layout() const;
  // Copies every tensor of `layout` into `arena` by name, dtype and shape
  // checked. As SafetensorsFile::load_into: a tensor of the checkpoint that
  // `layout` lacks, or the reverse, is an error, and all name, dtype and shape
  // checks run (on the headers read by open) before the first byte is copied.
  // Then one shard at a time is mapped, checked again (it must not have
  // changed since open), copied and unmapped. Should a shard fail at that
  // point (truncated since open), the shards before it have been copied.
  Status load_into(const Layout& layout, Arena& arena) const;

 private:
  std::string index_path_;
  std::vector<std::string> shards_;
  std::vector<CheckpointTensor> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
  std::optional<uint64_t> index_total_size_;
};

// Writes the tensors of `layout` from `arena` into directory `dir` (created if
// needed) as shards `model-0000i-of-0000n.safetensors` plus
// `model.safetensors.index.json`, HF's layout. Tensors go to shards in layout
// order; a shard is closed when the next tensor would take its tensor bytes
// past `max_shard_bytes` (tensor data only, as HF's max_shard_size counts;
// each header adds a few hundred bytes), so a shard exceeds it only when it
// holds one tensor that alone does. One shard is still written as
// model-00001-of-00001.safetensors with an index (HF would write a plain
// model.safetensors; ShardedCheckpoint reads both).
//
// Every shard is written atomically (tmp + rename), then the index, last and
// atomically too. Each shard's __metadata__ is `metadata` plus "format": "pt"
// (unless `metadata` sets "format"; transformers refuses shards without it)
// and kShardWriteIdKey; the index's "metadata" is `metadata` plus total_size
// and kShardWriteIdKey. Older `model-*-of-*.safetensors` files in `dir` that
// the new index does not name are removed once the index is in place.
Status write_sharded_safetensors(const std::string& dir, const Layout& layout, const Arena& arena,
                                 size_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

}  // namespace memfl
