#include "tensor/safetensors.h"

#include "common/parallel.h"

#include <fmt/ranges.h>  // fmt::join (its home since fmt 11; here on 9 too)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

namespace memfl {

namespace {
// Deeper than any safetensors header (3: the header, a tensor, its shape).
constexpr int kMaxHeaderDepth = 16;
}  // namespace

namespace {
// The reference implementation refuses headers above 100 MB; so do we, so a
// lying length cannot make us allocate gigabytes for JSON.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

bool mul_overflows(size_t a, size_t b, size_t* out) { return __builtin_mul_overflow(a, b, out); }
}  // namespace

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, map_size_);
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return not_found("{}: cannot stat: {}", path, std::strerror(errno));
  }
  const size_t file_size = static_cast<size_t>(st.st_size);
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  if (file_size < 8) {
    ::close(fd);
    return data_loss("{}: file is {} bytes, shorter than the 8-byte header length", path, file_size);
  }
  void* map = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return internal_error("{}: mmap failed: {}", path, std::strerror(errno));
  file->map_ = map;
  file->map_size_ = file_size;
  const auto* base = static_cast<const std::byte*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(base[i]);
  if (header_len > kMaxHeaderBytes) {
    return data_loss("{}: header length {} exceeds the {}-byte limit", path, header_len, kMaxHeaderBytes);
  }
  if (header_len > file_size - 8) {
    return data_loss("{}: header length {} runs past the end of the {}-byte file (truncated?)", path, header_len,
                     file_size);
  }
  const size_t data_start = 8 + header_len;
  const size_t data_size = file_size - data_start;
  // A safetensors header is two levels deep (tensors → their fields, and
  // __metadata__). A peer's file of nested brackets would make the parser
  // keep a frame per level — gigabytes for a large header — before failing:
  // count the nesting first (outside strings) and refuse deep headers.
  {
    int depth = 0;
    bool in_string = false;
    for (size_t i = 8; i < data_start; ++i) {
      const char c = static_cast<char>(base[i]);
      if (in_string) {
        if (c == '\\')
          ++i;
        else if (c == '"')
          in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if ((c == '{' || c == '[') && ++depth > kMaxHeaderDepth) {
        return data_loss("{}: header nests more than {} levels deep (at byte {}); not a safetensors header", path,
                         kMaxHeaderDepth, i - 8);
      } else if (c == '}' || c == ']') {
        --depth;
      }
    }
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(base + 8),
                                   reinterpret_cast<const char*>(base + data_start));
  } catch (const nlohmann::json::exception& e) {
    return data_loss("{}: header is not valid JSON: {}", path, e.what());
  }
  if (!header.is_object()) return data_loss("{}: header is not a JSON object", path);

  struct Span {
    size_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return data_loss("{}: __metadata__ is not an object", path);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) return data_loss("{}: __metadata__.{} is not a string", path, m.key());
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets")) {
      return data_loss("{}: tensor '{}' lacks dtype, shape or data_offsets", path, name);
    }
    if (!v["dtype"].is_string()) return data_loss("{}: tensor '{}' dtype is not a string", path, name);
    auto dtype = dtype_from_safetensors_name(v["dtype"].get<std::string>());
    if (!dtype) {
      return data_loss("{}: tensor '{}' has unsupported dtype '{}' (supported: F32 BF16 F16 I64 I32 U8)", path, name,
                       v["dtype"].get<std::string>());
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = *dtype;
    if (!v["shape"].is_array()) return data_loss("{}: tensor '{}' shape is not an array", path, name);
    size_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) return data_loss("{}: tensor '{}' has a non-natural dimension", path, name);
      auto dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) || mul_overflows(numel, dim, &numel)) {
        return data_loss("{}: tensor '{}' shape overflows", path, name);
      }
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return data_loss("{}: tensor '{}' data_offsets is not [begin, end]", path, name);
    }
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    size_t nbytes = 0;
    if (mul_overflows(numel, dtype_size(*dtype), &nbytes))
      return data_loss("{}: tensor '{}' size overflows", path, name);
    if (b > e) return data_loss("{}: tensor '{}' data_offsets [{}, {}] are reversed", path, name, b, e);
    if (e - b != nbytes) {
      return data_loss("{}: tensor '{}' claims {} bytes in data_offsets but shape and dtype need {}", path, name, e - b,
                       nbytes);
    }
    if (e > data_size) {
      return data_loss("{}: tensor '{}' ends at data byte {} but the file holds only {} data bytes (truncated?)", path,
                       name, e, data_size);
    }
    t.data = {base + data_start + b, nbytes};
    t.file_offset = data_start + b;
    spans.push_back({b, e, file->tensors_.size()});
    file->tensors_.push_back(std::move(t));
  }
  // The format forbids holes and overlaps: the tensors tile the data exactly.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  size_t expect = 0;
  for (const auto& s : spans) {
    if (s.begin != expect) {
      return data_loss("{}: tensor '{}' starts at data byte {} where {} was expected (hole or overlap)", path,
                       file->tensors_[s.index].name, s.begin, expect);
    }
    expect = s.end;
  }
  if (expect != data_size) {
    return data_loss("{}: tensors cover {} data bytes but the file holds {}", path, expect, data_size);
  }
  std::vector<SafetensorsTensor> ordered;
  ordered.reserve(spans.size());
  for (const auto& s : spans) ordered.push_back(std::move(file->tensors_[s.index]));
  file->tensors_ = std::move(ordered);
  return file;
}

StatusOr<Layout> SafetensorsFile::layout() const {
  LayoutBuilder b;
  for (const auto& t : tensors_) b.add(t.name, t.dtype, t.shape);
  return std::move(b).build();
}

Status SafetensorsFile::load_into(const Layout& layout, Arena& arena) const {
  if (arena.size() < layout.total_bytes()) {
    return failed_precondition("{}: arena of {} bytes is smaller than the layout's {}", path_, arena.size(),
                               layout.total_bytes());
  }
  for (const auto& t : tensors_) {
    if (layout.find(t.name) == nullptr) return invalid_argument("{}: tensor '{}' is not in the model", path_, t.name);
  }
  for (const auto& e : layout.entries()) {
    if (find(e.name) == nullptr) return invalid_argument("{}: tensor '{}' is missing", path_, e.name);
  }
  return copy_into(layout, arena);
}

Status SafetensorsFile::copy_into(const Layout& layout, Arena& arena) const {
  if (arena.size() < layout.total_bytes()) {
    return failed_precondition("{}: arena of {} bytes is smaller than the layout's {}", path_, arena.size(),
                               layout.total_bytes());
  }
  std::vector<const LayoutEntry*> targets;
  targets.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    const LayoutEntry* e = layout.find(t.name);
    if (e == nullptr) return invalid_argument("{}: tensor '{}' is not in the model", path_, t.name);
    if (t.dtype != e->dtype) {
      return invalid_argument("{}: tensor '{}' is {} in the file but {} in the model", path_, e->name,
                              dtype_name(t.dtype), dtype_name(e->dtype));
    }
    if (t.shape != e->shape) {
      return invalid_argument("{}: tensor '{}' has shape [{}] in the file but [{}] in the model", path_, e->name,
                              fmt::join(t.shape, ","), fmt::join(e->shape, ","));
    }
    targets.push_back(e);
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    std::memcpy(arena.data() + targets[i]->offset, tensors_[i].data.data(), tensors_[i].data.size());
  }
  return Status::Ok();
}

std::string safetensors_prefix(std::span<const LayoutEntry> entries, const std::map<std::string, std::string>& metadata,
                               size_t data_alignment) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t pos = 0;
  for (const auto& e : entries) {
    header[e.name] = {
        {"dtype", dtype_safetensors_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {pos, pos + e.nbytes()}}};
    pos += e.nbytes();
  }
  std::string text = header.dump();
  text.append((data_alignment - (8 + text.size()) % data_alignment) % data_alignment, ' ');
  std::string prefix(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) prefix[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return prefix + text;
}

Status write_safetensors(const std::string& path, const Layout& layout, const Arena& arena,
                         const std::map<std::string, std::string>& metadata) {
  return write_safetensors(path, std::span<const LayoutEntry>(layout.entries()), arena, metadata);
}

Status write_safetensors(const std::string& path, std::span<const LayoutEntry> entries, const Arena& arena,
                         const std::map<std::string, std::string>& metadata) {
  const std::string prefix = safetensors_prefix(entries, metadata, 8);  // keeps the data 8-byte aligned
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return not_found("{}: cannot write: {}", tmp, std::strerror(errno));
  // The file is the prefix and each tensor's bytes back to back; the arena
  // may pad between tensors. Cut into pieces of at most kPiece and written
  // with pwrite from several threads: one stream of 4 KiB page-cache copies
  // held a 141 GB checkpoint to one core's speed.
  struct Piece {
    uint64_t file_at;
    const std::byte* from;
    size_t len;
  };
  constexpr size_t kPiece = size_t{32} << 20;
  std::vector<Piece> pieces;
  uint64_t at = prefix.size();
  for (const auto& e : entries) {
    for (size_t done = 0; done < e.nbytes(); done += kPiece) {
      const size_t len = std::min(kPiece, e.nbytes() - done);
      pieces.push_back({at + done, arena.data() + e.offset + done, len});
    }
    at += e.nbytes();
  }
  auto write_all = [fd](const std::byte* p, size_t len, uint64_t off) {
    while (len > 0) {
      const ssize_t n = ::pwrite(fd, p, len, static_cast<off_t>(off));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      p += n;
      off += static_cast<uint64_t>(n);
      len -= static_cast<size_t>(n);
    }
    return true;
  };
  std::atomic<bool> ok = write_all(reinterpret_cast<const std::byte*>(prefix.data()), prefix.size(), 0);
  std::atomic<int> first_errno = 0;
  if (ok) {
    parallel_for(pieces.size(), 1, [&](size_t a, size_t b) {
      for (size_t i = a; i < b && ok; ++i) {
        if (!write_all(pieces[i].from, pieces[i].len, pieces[i].file_at)) {
          int zero = 0;
          first_errno.compare_exchange_strong(zero, errno == 0 ? EIO : errno);
          ok = false;
        }
      }
    });
  }
  // On disk before the rename: a crash leaves the old file or the new one, whole.
  if (ok && ::fsync(fd) != 0) {
    first_errno = errno;
    ok = false;
  }
  // Synced, its pages are clean: drop them from the page cache. A server
  // writes a model-sized checkpoint every round, and nothing reads it back
  // unless a run resumes; kept cached, each round's file filled memory
  // until the kernel reclaimed it (kswapd, compaction) during the next
  // round's transfers (4 GiB × 2 clients over MPI: the page cache peaked
  // 4.2 GB lower with this, docs/BENCHMARKS.md).
  if (ok) (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  if (::close(fd) != 0 && ok) {
    first_errno = errno;
    ok = false;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    return internal_error("{}: write failed: {}", path, std::strerror(first_errno.load()));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return internal_error("{}: rename from {} failed: {}", path, tmp, std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace memfl
