// libmemfl_sentencepiece.so: Debian's libsentencepiece behind a small C
// interface, loaded by data/tokenizer.cpp with dlopen(RTLD_DEEPBIND).
//
// Why a library of its own, loaded so: libsentencepiece carries its own
// copy of protobuf-lite (3.14) and exports its symbols under protobuf's
// names; in a process that also has the system's libprotobuf (gRPC's,
// 3.21), those names resolve to the system's copy and the model's parser
// aborts on the version check. RTLD_DEEPBIND makes this library and
// libsentencepiece look up their own symbols first. A process whose config
// names no tokenizer never maps either.
//
// Nothing allocated here crosses the interface: text comes in as bytes, ids
// leave through the caller's callback, errors as text into its buffer.
#include <sentencepiece_processor.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

namespace {
void put_error(char* err, size_t cap, const std::string& what) {
  if (err != nullptr && cap > 0) std::snprintf(err, cap, "%s", what.c_str());
}
}  // namespace

extern "C" {

struct memfl_spm {
  sentencepiece::SentencePieceProcessor sp;
};

__attribute__((visibility("default"))) memfl_spm* memfl_spm_load(const char* bytes, size_t n, char* err, size_t cap) {
  try {
    auto* m = new memfl_spm;
    const auto st = m->sp.LoadFromSerializedProto(std::string_view(bytes, n));
    if (!st.ok()) {
      put_error(err, cap, st.ToString());
      delete m;
      return nullptr;
    }
    return m;
  } catch (const std::exception& e) {
    put_error(err, cap, e.what());
  } catch (...) {
    put_error(err, cap, "unknown error");
  }
  return nullptr;
}

__attribute__((visibility("default"))) void memfl_spm_free(memfl_spm* m) { delete m; }

// 0: pieces, 1: bos id, 2: eos id, 3: pad id, 4: unk id.
__attribute__((visibility("default"))) int memfl_spm_info(const memfl_spm* m, int what) {
  switch (what) {
    case 0:
      return m->sp.GetPieceSize();
    case 1:
      return m->sp.bos_id();
    case 2:
      return m->sp.eos_id();
    case 3:
      return m->sp.pad_id();
    case 4:
      return m->sp.unk_id();
    default:
      return -1;
  }
}

// Encodes `text`; the ids go to sink(ctx, ids, count) once. 0 on success.
__attribute__((visibility("default"))) int memfl_spm_encode(const memfl_spm* m, const char* text, size_t n,
                                                            void (*sink)(void*, const int*, size_t), void* ctx,
                                                            char* err, size_t cap) {
  try {
    std::vector<int> ids;
    const auto st = m->sp.Encode(std::string_view(text, n), &ids);
    if (!st.ok()) {
      put_error(err, cap, st.ToString());
      return 1;
    }
    sink(ctx, ids.data(), ids.size());
    return 0;
  } catch (const std::exception& e) {
    put_error(err, cap, e.what());
  } catch (...) {
    put_error(err, cap, "unknown error");
  }
  return 1;
}

}  // extern "C"
