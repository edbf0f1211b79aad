#include "compress/decoding_opener.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tensor/safetensors.h"

namespace memfl {

Status ArenaBaseModel::read(uint64_t offset, std::span<std::byte> into) const {
  if (offset > arena_.size() || into.size() > arena_.size() - offset) {
    return internal_error("base model read of {} bytes at {} runs past its {} bytes", into.size(), offset,
                          arena_.size());
  }
  std::memcpy(into.data(), arena_.data() + offset, into.size());
  return Status::Ok();
}

StatusOr<std::unique_ptr<FileBaseModel>> FileBaseModel::open(const std::string& path, const Layout& layout) {
  std::unique_ptr<FileBaseModel> m(new FileBaseModel());
  {
    // The header says where each tensor is; its dtype and shape must be the
    // layout's (the mapping is dropped at once: only the header was read).
    MEMFL_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(path));
    for (const auto& e : layout.entries()) {
      const SafetensorsTensor* t = file->find(e.name);
      if (t == nullptr || t->dtype != e.dtype || t->shape != e.shape) {
        return failed_precondition("{}: tensor '{}' is not the model's (the base of compressed updates)", path, e.name);
      }
    }
    // Tensors are laid out in the file in layout order, back to back (what
    // write_safetensors writes): the first one's position gives the rest.
    const SafetensorsTensor* first = layout.size() > 0 ? file->find(layout.entries()[0].name) : nullptr;
    m->data_offset_ = first != nullptr ? first->file_offset : 0;
    uint64_t at = m->data_offset_;
    for (const auto& e : layout.entries()) {
      if (file->find(e.name)->file_offset != at) {
        return failed_precondition("{}: tensor '{}' is not where the model's layout puts it", path, e.name);
      }
      at += e.nbytes();
    }
  }
  m->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (m->fd_ < 0) return not_found("{}: cannot open: {}", path, std::strerror(errno));
  m->path_ = path;
  m->layout_ = &layout;
  return m;
}

FileBaseModel::~FileBaseModel() {
  if (fd_ >= 0) ::close(fd_);
}

Status FileBaseModel::read(uint64_t offset, std::span<std::byte> into) const {
  // Arena offsets to file positions: the file packs the tensors; the arena
  // pads between them (padding reads as zeros).
  const auto& entries = layout_->entries();
  const uint64_t end = offset + into.size();
  std::memset(into.data(), 0, into.size());
  uint64_t packed = 0;  // bytes of the tensors before entry e in the file
  for (const auto& e : entries) {
    if (e.end() > offset && e.offset < end) {
      const uint64_t from = std::max<uint64_t>(offset, e.offset), to = std::min<uint64_t>(end, e.end());
      const uint64_t at = data_offset_ + packed + (from - e.offset);
      size_t done = 0;
      while (done < to - from) {
        const ssize_t n =
            ::pread(fd_, into.data() + (from - offset) + done, to - from - done, static_cast<off_t>(at + done));
        if (n <= 0) {
          return data_loss("{}: cannot read the base model at {} ({})", path_, at + done,
                           n == 0 ? "end of file" : std::strerror(errno));
        }
        done += static_cast<size_t>(n);
      }
    }
    if (e.offset >= end) break;
    packed += e.nbytes();
  }
  return Status::Ok();
}

namespace {

class DecodingUpdateStream final : public UpdateStream {
 public:
  DecodingUpdateStream(std::unique_ptr<UpdateStream> inner, const Layout& layout, const BaseModel* base,
                       std::string peer, uint64_t max_raw)
      : inner_(std::move(inner)),
        layout_(layout),
        decoder_(layout, base, peer, max_raw),
        peer_(std::move(peer)),
        max_raw_(max_raw) {}
  using ChunkSink::accept;
  Status accept(const ChunkHeader& h, Payload payload) override {
    // What the transport checks of a raw chunk, for the frame: the layout,
    // the offset the stream is at, a size within the frame bound, and the
    // checksum of the bytes on the wire.
    const size_t size = payload_size(payload);
    if (h.layout_hash != layout_.hash()) {
      return data_loss("chunk from {}: layout hash {:016x} does not match the model's {:016x}", peer_, h.layout_hash,
                       layout_.hash());
    }
    if (h.offset != next_) {
      return data_loss("chunk from {}: offset {} where {} was expected (gap, overlap or repeat)", peer_, h.offset,
                       next_);
    }
    if (h.length != size || size == 0 || size > max_raw_ + kMaxFrameOverhead) {
      return data_loss("compressed frame from {} for the chunk at model offset {}: {} bytes (header: {}; at most {})",
                       peer_, h.offset, size, h.length, max_raw_ + kMaxFrameOverhead);
    }
    if (chunk_checksum(payload) != h.checksum) {
      return data_loss("compressed frame from {} for the chunk at model offset {}: checksum mismatch", peer_, h.offset);
    }
    MEMFL_ASSIGN_OR_RETURN(std::span<const std::byte> raw, decoder_.decode(h.offset, payload));
    const ChunkHeader out{h.layout_hash, h.offset, raw.size(), decoder_.raw_checksum()};
    MEMFL_RETURN_IF_ERROR(inner_->accept(out, raw));
    next_ += raw.size();
    return Status::Ok();
  }
  Status commit() override { return inner_->commit(); }

 private:
  std::unique_ptr<UpdateStream> inner_;
  const Layout& layout_;
  FrameDecoder decoder_;
  std::string peer_;
  uint64_t max_raw_;
  uint64_t next_ = 0;
};

}  // namespace

std::unique_ptr<UpdateStream> decoding_stream(std::unique_ptr<UpdateStream> inner, const Layout& layout,
                                              const BaseModel* base, std::string peer, uint64_t max_raw) {
  return std::make_unique<DecodingUpdateStream>(std::move(inner), layout, base, std::move(peer), max_raw);
}

StatusOr<std::unique_ptr<UpdateStream>> DecodingUpdateOpener::open_update(const std::string& client_id,
                                                                          double sample_count) {
  MEMFL_ASSIGN_OR_RETURN(auto inner, inner_.open_update(client_id, sample_count));
  return decoding_stream(std::move(inner), layout_, base_, client_id, max_raw_);
}

}  // namespace memfl
