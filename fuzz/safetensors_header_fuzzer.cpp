// libFuzzer target for the safetensors reader: a checkpoint is input (a
// peer's, a download's), so whatever its 8-byte length and JSON header say,
// SafetensorsFile::open must check it against the file and answer with a
// status, never read past the mapping, crash or leak. A file it accepts must
// give a layout and load into an arena of that layout byte for byte.
//   make fuzz        (clang, ASan+UBSan; corpus in fuzz/corpus_safetensors, replayed by the tests)
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto out = memfl::fuzz::run_safetensors_input(data, size);
  for (const auto* s : {&out.open, &out.layout, &out.load}) {
    if (!s->ok() && s->message().empty()) {
      std::fprintf(stderr, "safetensors fuzzer: an error without a message (%s)\n", s->to_string().c_str());
      std::abort();
    }
  }
  // The file's own layout must take its tensors, and take them exactly.
  if (out.open.ok() && out.layout.ok() && (!out.load.ok() || !out.copied_exactly)) {
    std::fprintf(stderr, "safetensors fuzzer: an accepted file does not load into its own layout: %s\n",
                 out.load.to_string().c_str());
    std::abort();
  }
  return 0;
}
