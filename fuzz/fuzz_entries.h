// What the config and safetensors fuzzers do with one input, shared with the
// test that replays their corpora (tests/test_fuzz_corpus.cpp), so a corpus
// file runs through exactly the code the fuzzer ran it through.
//
//   fuzz/config_loader_fuzzer.cpp       run_config_input
//   fuzz/safetensors_header_fuzzer.cpp  run_safetensors_input
//   fuzz/frame_decoder_fuzzer.cpp       run_frame_input
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/status.h"
#include "compress/frame.h"
#include "config/config.h"
#include "tensor/arena.h"
#include "tensor/safetensors.h"

namespace memfl::fuzz {

struct ConfigOutcome {
  // The whole input as a config file.
  StatusOr<ExperimentConfig> whole;
  // Its first line (up to the first '\n') as one `--set` override, the rest
  // as the file; without a '\n', the whole input is the override and the
  // file is empty.
  std::string override_line;
  StatusOr<ExperimentConfig> with_set;
};

// Errors are expected; a crash, a hang, a leak or undefined behaviour is not.
inline ConfigOutcome run_config_input(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const size_t nl = text.find('\n');
  std::string line = text.substr(0, nl);
  const std::string rest = nl == std::string::npos ? std::string() : text.substr(nl + 1);
  ConfigOutcome out{load_config_text(text, "fuzz.yaml"), line, load_config_text(rest, "fuzz.yaml", {line})};
  // A config that loads resolves to YAML that loads again, to the same YAML.
  for (auto* c : {&out.whole, &out.with_set}) {
    if (!c->ok()) continue;
    auto again = load_config_text((*c)->resolved_yaml, "resolved.yaml");
    if (!again.ok() || again->resolved_yaml != (*c)->resolved_yaml) {
      *c = internal_error("resolved YAML does not load back to itself: {}",
                          again.ok() ? again->resolved_yaml : again.status().message());
    }
  }
  return out;
}

struct SafetensorsOutcome {
  Status open = Status::Ok();    // SafetensorsFile::open
  Status layout = Status::Ok();  // its layout() (when open succeeded)
  Status load = Status::Ok();    // load_into an arena of that layout
  size_t tensors = 0;
  // After a load: every tensor's bytes in the arena equal its bytes in the
  // file.
  bool copied_exactly = false;
};

// The input is a whole safetensors file: written to a memfd and opened by
// path (/proc/self/fd/N), as a checkpoint on disk is.
inline SafetensorsOutcome run_safetensors_input(const uint8_t* data, size_t size) {
  SafetensorsOutcome out;
  const int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) {
    out.open = internal_error("memfd_create: {}", std::strerror(errno));
    return out;
  }
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) {
      ::close(fd);
      out.open = internal_error("write to memfd: {}", std::strerror(errno));
      return out;
    }
    done += static_cast<size_t>(n);
  }
  auto file = SafetensorsFile::open("/proc/self/fd/" + std::to_string(fd));
  ::close(fd);  // the mapping (if any) outlives the descriptor
  if (!file.ok()) {
    out.open = file.status();
    return out;
  }
  out.tensors = (*file)->tensors().size();
  auto layout = (*file)->layout();
  if (!layout.ok()) {
    out.layout = layout.status();
    return out;
  }
  Arena arena(layout->total_bytes(), MemoryCategory::kModel);
  out.load = (*file)->load_into(*layout, arena);
  if (!out.load.ok()) return out;
  out.copied_exactly = true;
  for (const auto& t : (*file)->tensors()) {
    const LayoutEntry* e = layout->find(t.name);
    if (e == nullptr || e->nbytes() != t.data.size() ||
        (!t.data.empty() && std::memcmp(arena.data() + e->offset, t.data.data(), t.data.size()) != 0)) {
      out.copied_exactly = false;
    }
  }
  return out;
}

// The model every frame input is decoded into: lossy-eligible f32 and bf16
// weights around an i64 counter, with padding between them.
inline const Layout& frame_fuzz_layout() {
  static const Layout layout = [] {
    LayoutBuilder b;
    b.add("a.weight", DType::kF32, {1500}).add("n", DType::kI64, {1}).add("b.weight", DType::kBF16, {999});
    return std::move(b).build().value();
  }();
  return layout;
}

// A base model of the layout, fixed values (what the server reads deltas against).
class FuzzBase final : public BaseModel {
 public:
  Status read(uint64_t offset, std::span<std::byte> into) const override {
    for (size_t i = 0; i < into.size(); ++i) into[i] = static_cast<std::byte>((offset + i) * 37 % 251);
    return Status::Ok();
  }
};

struct FrameOutcome {
  Status at_start = Status::Ok();  // the input as the frame of the chunk at offset 0, against the base
  Status no_base = Status::Ok();   // the same against no base
  uint64_t raw_bytes = 0;          // what the first decode rebuilt
};

// Errors are expected; a crash, a read out of bounds or an allocation sized
// by the input beyond the chunk limit is not.
inline FrameOutcome run_frame_input(const uint8_t* data, size_t size) {
  const Layout& layout = frame_fuzz_layout();
  static const FuzzBase base;
  const std::span<const std::byte> frame(reinterpret_cast<const std::byte*>(data), size);
  FrameOutcome out;
  FrameDecoder with_base(layout, &base, "fuzz");
  auto raw = with_base.decode(0, Payload(&frame, 1));
  out.at_start = raw.status();
  if (raw.ok()) out.raw_bytes = raw->size();
  FrameDecoder without(layout, nullptr, "fuzz");
  out.no_base = without.decode(0, Payload(&frame, 1)).status();
  return out;
}

}  // namespace memfl::fuzz
