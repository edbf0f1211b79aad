#include "comm/grpc/wire.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

namespace memfl {

namespace {

size_t put_varint(uint8_t* out, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<uint8_t>(v);
  return n;
}

size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

void release_arena_slice(void* user_data) {
  static_cast<std::atomic<int64_t>*>(user_data)->fetch_sub(1, std::memory_order_acq_rel);
}
void no_release(void*) {}

// Reads across the pieces of a frame without gluing them together.
class Cursor {
 public:
  explicit Cursor(const std::vector<std::span<const std::byte>>& pieces) : pieces_(pieces) {}
  size_t remaining() const { return remaining_total() - consumed_; }
  bool byte(uint8_t* b) {
    while (piece_ < pieces_.size() && pos_ == pieces_[piece_].size()) {
      ++piece_;
      pos_ = 0;
    }
    if (piece_ == pieces_.size()) return false;
    *b = static_cast<uint8_t>(pieces_[piece_][pos_++]);
    ++consumed_;
    return true;
  }
  bool varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes: not a varint
  }
  bool copy(void* dst, size_t n) {
    auto* d = static_cast<uint8_t*>(dst);
    for (size_t i = 0; i < n; ++i) {
      if (!byte(d + i)) return false;
    }
    return true;
  }
  // The rest of the frame as pieces (no copy).
  std::vector<std::span<const std::byte>> rest() const {
    std::vector<std::span<const std::byte>> out;
    for (size_t p = piece_; p < pieces_.size(); ++p) {
      auto s = pieces_[p];
      if (p == piece_) s = s.subspan(pos_);
      if (!s.empty()) out.push_back(s);
    }
    return out;
  }

 private:
  size_t remaining_total() const {
    size_t n = 0;
    for (auto& p : pieces_) n += p.size();
    return n;
  }
  const std::vector<std::span<const std::byte>>& pieces_;
  size_t piece_ = 0, pos_ = 0, consumed_ = 0;
};

Status decode_pieces(DecodedFrame* out, int chunk_field, std::string_view peer,
                     google::protobuf::MessageLite* control) {
  Cursor c(out->pieces);
  const size_t total = c.remaining();
  uint64_t tag = 0;
  if (total == 0 || !c.varint(&tag)) return data_loss("message from {}: empty or unreadable", peer);
  if (tag == ((static_cast<uint64_t>(chunk_field) << 3) | 2)) {
    // Chunk { ChunkHeader header = 1; bytes data = 2; }, every length checked.
    uint64_t chunk_len = 0, hdr_tag = 0, hdr_len = 0, data_tag = 0, data_len = 0;
    if (!c.varint(&chunk_len) || chunk_len != c.remaining()) {
      return data_loss("chunk from {}: message length {} does not match the {} bytes that arrived", peer, chunk_len,
                       c.remaining());
    }
    if (!c.varint(&hdr_tag) || hdr_tag != ((1 << 3) | 2) || !c.varint(&hdr_len) || hdr_len > 64) {
      return data_loss("chunk from {}: malformed chunk header", peer);
    }
    uint8_t hdr_bytes[64];
    if (!c.copy(hdr_bytes, hdr_len)) return data_loss("chunk from {}: truncated chunk header", peer);
    wire::ChunkHeader h;
    if (!h.ParseFromArray(hdr_bytes, static_cast<int>(hdr_len))) {
      return data_loss("chunk from {}: chunk header does not parse", peer);
    }
    if (!c.varint(&data_tag) || data_tag != ((2 << 3) | 2) || !c.varint(&data_len)) {
      return data_loss("chunk from {}: malformed data field", peer);
    }
    if (data_len != c.remaining()) {
      return data_loss("chunk from {}: data field says {} bytes but {} follow", peer, data_len, c.remaining());
    }
    out->is_chunk = true;
    out->header = {h.layout_hash(), h.offset(), h.length(), h.checksum()};
    out->pieces = c.rest();
    return Status::Ok();
  }
  if (total > kMaxControlMessageBytes) {
    return data_loss("message from {}: {} bytes is too large for a control message", peer, total);
  }
  std::string flat;
  flat.reserve(total);
  for (auto p : out->pieces) flat.append(reinterpret_cast<const char*>(p.data()), p.size());
  if (!control->ParseFromString(flat)) return data_loss("message from {}: does not parse", peer);
  out->is_chunk = false;
  out->pieces.clear();
  return Status::Ok();
}

}  // namespace

Frame encode_message(const google::protobuf::MessageLite& msg) {
  std::string s = msg.SerializeAsString();
  grpc::Slice slice(s);
  return Frame{grpc::ByteBuffer(&slice, 1)};
}

Frame encode_chunk_frame(int field, const ChunkHeader& header, std::span<const std::byte> data,
                         std::atomic<int64_t>* inflight) {
  wire::ChunkHeader h;
  h.set_layout_hash(header.layout_hash);
  h.set_offset(header.offset);
  h.set_length(header.length);
  h.set_checksum(header.checksum);
  uint8_t hdr[64];
  const size_t hdr_len = h.ByteSizeLong();
  h.SerializeWithCachedSizesToArray(hdr);
  const uint64_t chunk_len = 1 + varint_size(hdr_len) + hdr_len + 1 + varint_size(data.size()) + data.size();
  uint8_t prefix[128];
  size_t n = put_varint(prefix, (static_cast<uint64_t>(field) << 3) | 2);
  n += put_varint(prefix + n, chunk_len);
  prefix[n++] = (1 << 3) | 2;
  n += put_varint(prefix + n, hdr_len);
  std::memcpy(prefix + n, hdr, hdr_len);
  n += hdr_len;
  prefix[n++] = (2 << 3) | 2;
  n += put_varint(prefix + n, data.size());
  grpc::Slice slices[2] = {
      grpc::Slice(prefix, n),
      inflight != nullptr
          ? grpc::Slice(const_cast<std::byte*>(data.data()), data.size(), &release_arena_slice, inflight)
          : grpc::Slice(const_cast<std::byte*>(data.data()), data.size(), &no_release, nullptr),
  };
  if (inflight != nullptr) inflight->fetch_add(1, std::memory_order_acq_rel);
  return Frame{grpc::ByteBuffer(slices, 2)};
}

Status decode_frame(Frame& frame, int chunk_field, std::string_view peer, DecodedFrame* out,
                    google::protobuf::MessageLite* control) {
  out->slices.clear();
  out->pieces.clear();
  grpc::Status st = frame.buffer.Dump(&out->slices);  // takes references, copies nothing
  if (!st.ok()) return data_loss("message from {}: unreadable ({})", peer, st.error_message());
  for (auto& s : out->slices) out->pieces.emplace_back(reinterpret_cast<const std::byte*>(s.begin()), s.size());
  return decode_pieces(out, chunk_field, peer, control);
}

Status decode_bytes(std::span<const uint8_t> bytes, int chunk_field, std::string_view peer, DecodedFrame* out,
                    google::protobuf::MessageLite* control) {
  out->slices.clear();
  out->pieces.clear();
  out->pieces.emplace_back(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size());
  return decode_pieces(out, chunk_field, peer, control);
}

Status read_chunk_run(const std::function<bool(Frame*)>& read, const std::function<void()>& cancel, int chunk_field,
                      std::string_view peer, const ChunkRunOptions& options,
                      const std::function<Status(const DecodedFrame&)>& on_chunk,
                      google::protobuf::MessageLite* control, bool* broke) {
  struct Item {
    bool broke = false;
    bool token = false;  // it took a token of the shared budget
    Status status;
    DecodedFrame frame;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> ready;
  bool dropping = false;          // the run failed: the reader drops what it reads
  bool reader_done = false;       // it read the run's last frame (or the stream broke)
  bool consumer_waiting = false;  // the consumer waits for a frame: reading now is not ahead
  const size_t depth = std::max<size_t>(options.read_ahead, 1);
  auto take_token = [&] {
    if (options.budget == nullptr) return true;
    int left = options.budget->load();
    while (left > 0 && !options.budget->compare_exchange_weak(left, left - 1)) {
    }
    return left > 0;
  };
  auto give_token = [&](bool token) {
    if (token && options.budget != nullptr) options.budget->fetch_add(1);
  };
  // The reader owns `control` until it is done: the run's control message
  // is parsed into it there.
  std::thread reader([&] {
    Frame frame;
    while (true) {
      bool token = false;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] {
          if (dropping) return true;
          if (ready.size() >= depth) return false;
          if (consumer_waiting && ready.empty()) return true;
          token = take_token();
          return token;
        });
      }
      Item item;
      item.token = token;
      item.broke = !read(&frame);
      if (!item.broke) item.status = decode_frame(frame, chunk_field, peer, &item.frame, control);
      const bool last = item.broke || !item.status.ok() || !item.frame.is_chunk;
      std::lock_guard lock(mu);
      if (!dropping) {
        ready.push_back(std::move(item));
      } else {
        give_token(item.token);
      }
      if (last) reader_done = true;
      cv.notify_all();
      if (last) return;
    }
  });
  Status result;
  while (true) {
    Item item;
    {
      std::unique_lock lock(mu);
      consumer_waiting = true;
      cv.notify_all();
      cv.wait(lock, [&] { return !ready.empty(); });
      consumer_waiting = false;
      item = std::move(ready.front());
      ready.pop_front();
      give_token(item.token);
      cv.notify_all();
    }
    if (item.broke) {
      *broke = true;
      result = Status(StatusCode::kUnavailable, fmt::format("{} closed the stream", peer));
      break;
    }
    if (!item.status.ok() || !item.frame.is_chunk) {
      result = item.status;
      break;
    }
    result = on_chunk(item.frame);
    if (!result.ok()) {
      std::unique_lock lock(mu);
      dropping = true;
      for (const auto& left : ready) give_token(left.token);
      ready.clear();
      cv.notify_all();
      if (!cv.wait_for(lock, options.drain, [&] { return reader_done; })) {
        lock.unlock();
        cancel();  // a peer that stalls after a refused chunk: its Read returns now
      }
      break;
    }
  }
  reader.join();
  return result;
}

int max_message_bytes(int64_t chunk_size, int64_t configured) {
  // A chunk frame is the payload plus at most ~70 bytes of framing; the
  // default 4 MiB limit fails a 4 MiB chunk (4194309 vs 4194304 bytes), so
  // the limit follows the chunk size, with headroom for control messages.
  const int64_t need = std::max<int64_t>(chunk_size + (64 << 10), static_cast<int64_t>(kMaxControlMessageBytes));
  const int64_t v = configured > 0 ? std::max(configured, need) : need;
  return static_cast<int>(std::min<int64_t>(v, INT32_MAX));
}

int stream_window_bytes(int64_t chunk_size, int chunks) {
  return static_cast<int>(std::clamp<int64_t>(chunks * (chunk_size + 1024), 1 << 20, 256 << 20));
}

}  // namespace memfl
