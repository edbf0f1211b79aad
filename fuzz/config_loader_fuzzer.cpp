// libFuzzer target for the config loader: whatever a config file or a --set
// holds, load_config_text must answer with a status (an error names the key
// or the line), never crash, hang or leak. The input is loaded as a whole
// file, and again with its first line as one --set override on the rest;
// a config that loads must resolve to YAML that loads back to itself.
//   make fuzz        (clang, ASan+UBSan; corpus in fuzz/corpus_config, replayed by the tests)
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <spdlog/spdlog.h>

#include "fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto out = memfl::fuzz::run_config_input(data, size);
  // Every failure says what failed.
  for (const auto* c : {&out.whole, &out.with_set}) {
    if (!c->ok() && (c->status().message().empty() || c->status().code() == memfl::StatusCode::kInternal)) {
      std::fprintf(stderr, "config fuzzer: %s\n", c->status().to_string().c_str());
      std::abort();
    }
  }
  return 0;
}
