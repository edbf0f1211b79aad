// libFuzzer target for compressed frames (compress/frame.h): whatever bytes a
// client sends as a frame, the decoder must refuse them with a status or
// rebuild at most a chunk, never crash, never read or write out of bounds
// (libzfp included: its stream is decoded from a padded buffer).
//   make fuzz        (clang, ASan+UBSan; corpus in fuzz/corpus_frames, replayed by the tests)
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)memfl::fuzz::run_frame_input(data, size);
  return 0;
}
