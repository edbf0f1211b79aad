#include "data/tokenizer.h"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

#include "io/input_file.h"

namespace memfl {

namespace {

// libmemfl_sentencepiece.so's interface (data/sentencepiece_plugin.cpp).
struct SpmApi {
  void* (*load)(const char*, size_t, char*, size_t) = nullptr;
  void (*free)(void*) = nullptr;
  int (*info)(const void*, int) = nullptr;
  int (*encode)(const void*, const char*, size_t, void (*)(void*, const int*, size_t), void*, char*, size_t) = nullptr;
};

constexpr const char* kPluginName = "libmemfl_sentencepiece.so";

// Loads the plugin once: from MEMFL_PLUGIN_DIR, beside libmemfl_core.so,
// or beside the executable.
StatusOr<const SpmApi*> spm_api() {
#if defined(MEMFL_HAVE_SENTENCEPIECE)
  static std::mutex mu;
  static SpmApi api;
  static bool loaded = false;
  std::lock_guard lock(mu);
  if (loaded) return &api;
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (const char* dir = std::getenv("MEMFL_PLUGIN_DIR")) candidates.push_back(fs::path(dir) / kPluginName);
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&have_sentencepiece), &self) != 0 && self.dli_fname != nullptr) {
    candidates.push_back(fs::path(self.dli_fname).parent_path() / kPluginName);
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path() / kPluginName);
  std::string tried;
  for (const auto& p : candidates) {
    if (!fs::exists(p, ec)) {
      tried += " " + p.string() + " (missing)";
      continue;
    }
    // RTLD_DEEPBIND: libsentencepiece's bundled protobuf must bind to itself,
    // not to the system libprotobuf gRPC brought (see the plugin's header).
    void* h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
    if (h == nullptr) {
      tried += fmt::format(" {} ({})", p.string(), dlerror());
      continue;
    }
    api.load = reinterpret_cast<decltype(api.load)>(dlsym(h, "memfl_spm_load"));
    api.free = reinterpret_cast<decltype(api.free)>(dlsym(h, "memfl_spm_free"));
    api.info = reinterpret_cast<decltype(api.info)>(dlsym(h, "memfl_spm_info"));
    api.encode = reinterpret_cast<decltype(api.encode)>(dlsym(h, "memfl_spm_encode"));
    if (!api.load || !api.free || !api.info || !api.encode) {
      tried += " " + p.string() + " (not memfl's SentencePiece plugin)";
      continue;
    }
    loaded = true;
    return &api;
  }
  return not_found(
      "the SentencePiece plugin {} could not be loaded; tried:{} — build it (`make build`) or set "
      "MEMFL_PLUGIN_DIR",
      kPluginName, tried);
#else
  return failed_precondition(
      "this memfl was built without its SentencePiece plugin (it needs libsentencepiece-dev — "
      "scripts/install-deps.sh installs it — and a build without MEMFL_SANITIZE)");
#endif
}

}  // namespace

bool have_sentencepiece() {
#if defined(MEMFL_HAVE_SENTENCEPIECE)
  return true;
#else
  return false;
#endif
}

struct Tokenizer::Impl {
  const SpmApi* api = nullptr;
  void* model = nullptr;
  int pieces = 0, bos = -1, eos = -1, pad = -1, unk = -1;
  ~Impl() {
    if (model != nullptr) api->free(model);
  }
};

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

StatusOr<Tokenizer> Tokenizer::open(const std::string& path, std::string_view key) {
  auto api = spm_api();
  if (!api.ok()) return api.status().with_context(fmt::format("{}: '{}'", key, path));
  // Read here as a regular file with a limit, then handed over as bytes:
  // the library's own Load opens by name and would wait on a FIFO.
  MEMFL_ASSIGN_OR_RETURN(std::string bytes, read_input_file(path, key, kTokenizerFileLimit));
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>();
  t.impl_->api = *api;
  t.path_ = path;
  char err[512] = {0};
  t.impl_->model = (*api)->load(bytes.data(), bytes.size(), err, sizeof err);
  if (t.impl_->model == nullptr) {
    return invalid_argument("{}: '{}' is not a SentencePiece model ({})", key, path, err);
  }
  Impl& m = *t.impl_;
  m.pieces = m.api->info(m.model, 0);
  m.bos = m.api->info(m.model, 1);
  m.eos = m.api->info(m.model, 2);
  m.pad = m.api->info(m.model, 3);
  m.unk = m.api->info(m.model, 4);
  // A protobuf parser takes many byte strings for a model with few pieces; a
  // tokenizer has at least its special pieces and a few more.
  if (m.pieces < 2) {
    return invalid_argument("{}: '{}' is not a SentencePiece model (it holds {} pieces)", key, path, m.pieces);
  }
  return t;
}

int Tokenizer::vocab_size() const { return impl_->pieces; }
int Tokenizer::bos_id() const { return impl_->bos; }
int Tokenizer::eos_id() const { return impl_->eos; }
int Tokenizer::pad_id() const { return impl_->pad; }
int Tokenizer::unk_id() const { return impl_->unk; }

StatusOr<std::vector<int32_t>> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  char err[512] = {0};
  auto sink = [](void* ctx, const int* ids, size_t n) {
    static_cast<std::vector<int32_t>*>(ctx)->assign(ids, ids + n);
  };
  if (impl_->api->encode(impl_->model, text.data(), text.size(), sink, &out, err, sizeof err) != 0) {
    return invalid_argument("tokenizer '{}': {}", path_, err);
  }
  return out;
}

}  // namespace memfl
