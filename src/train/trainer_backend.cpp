#include "train/trainer_backend.h"

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

namespace memfl {

StatusOr<TrainerBackend*> load_trainer_backend() {
  static std::mutex mu;
  static TrainerBackend* backend = nullptr;
  std::lock_guard lock(mu);
  if (backend != nullptr) return backend;
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates;
  if (const char* dir = std::getenv("MEMFL_PLUGIN_DIR")) candidates.push_back(fs::path(dir) / "libmemfl_torch.so");
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back(exe.parent_path() / "libmemfl_torch.so");
  std::string tried;
  for (const auto& p : candidates) {
    if (!fs::exists(p)) {
      tried += " " + p.string() + " (missing)";
      continue;
    }
    void* handle = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      tried += fmt::format(" {} ({})", p.string(), dlerror());
      continue;
    }
    auto* factory = reinterpret_cast<TrainerBackend* (*)()>(dlsym(handle, "memfl_trainer_backend"));
    if (factory == nullptr) {
      tried += " " + p.string() + " (no memfl_trainer_backend symbol)";
      continue;
    }
    backend = factory();
    return backend;
  }
  return not_found(
      "the libtorch trainer plugin libmemfl_torch.so could not be loaded; tried:{} — build it with "
      "`make build` (needs libtorch-dev) or set MEMFL_PLUGIN_DIR",
      tried);
}

}  // namespace memfl
