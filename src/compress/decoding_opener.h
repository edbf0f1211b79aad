// The server's side of compression: a decorator of the round's update
// opener that turns each stream's frames (compress/frame.h) back into the
// model's chunks before they go on — to the value checks and the fold, which
// see raw chunks exactly as without compression. One frame and one chunk
// per stream exist at a time.
//
//   FileBaseModel base(checkpoint_path, layout);          // the round's global model
//   DecodingUpdateOpener decoded(checked, layout, &base);  // frames → chunks
//   transport.collect(round, selected, global, decoded, &up);
//
// Each frame is checked before anything is sized from it (compress/frame.h);
// a bad one fails its stream with kDataLoss naming the client and the
// chunk's offset, and the transport treats it as it treats a chunk whose
// checksum failed: that client is out of the round, the others go on.
#pragma once

#include <memory>
#include <string>

#include "comm/transport.h"
#include "compress/frame.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

// The base model in an arena the round does not overwrite (the simulator's
// global model, a bf16 model whose sum lives beside it).
class ArenaBaseModel final : public BaseModel {
 public:
  explicit ArenaBaseModel(const Arena& arena) : arena_(arena) {}
  Status read(uint64_t offset, std::span<std::byte> into) const override;

 private:
  const Arena& arena_;
};

// The base model in a safetensors file of the model's layout (the server's
// checkpoint, which holds the round's global model while the in-place sum
// overwrites the arena): read with pread, chunk by chunk, so it costs page
// cache, not the server's memory.
class FileBaseModel final : public BaseModel {
 public:
  static StatusOr<std::unique_ptr<FileBaseModel>> open(const std::string& path, const Layout& layout);
  ~FileBaseModel() override;
  Status read(uint64_t offset, std::span<std::byte> into) const override;

 private:
  FileBaseModel() = default;
  int fd_ = -1;
  std::string path_;
  const Layout* layout_ = nullptr;
  uint64_t data_offset_ = 0;
};

class DecodingUpdateOpener final : public UpdateOpener {
 public:
  // `base`: the model every update's lossy deltas are against (null: none,
  // the updates are changes already). `max_raw`: the transport's largest chunk.
  DecodingUpdateOpener(UpdateOpener& inner, const Layout& layout, const BaseModel* base,
                       uint64_t max_raw = kMaxTransferChunk)
      : inner_(inner), layout_(layout), base_(base), max_raw_(max_raw) {}
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override;

 private:
  UpdateOpener& inner_;
  const Layout& layout_;
  const BaseModel* base_;
  uint64_t max_raw_;
};

// A receiver's checked writer as a stream for decoding_stream (a client
// rebuilding a broadcast's frames into its arena): commit() is finish().
class WriterStream final : public UpdateStream {
 public:
  explicit WriterStream(ModelWriter& writer) : writer_(writer) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload payload) override { return writer_.accept(h, payload); }
  Status commit() override { return writer_.finish(); }

 private:
  ModelWriter& writer_;
};

// The same decorator around one stream (asynchronous servers open their
// spool writers themselves).
std::unique_ptr<UpdateStream> decoding_stream(std::unique_ptr<UpdateStream> inner, const Layout& layout,
                                              const BaseModel* base, std::string peer,
                                              uint64_t max_raw = kMaxTransferChunk);

}  // namespace memfl
