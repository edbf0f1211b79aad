#include "server/server_state.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <spdlog/spdlog.h>

#include "comm/chunk.h"
#include "io/durable_file.h"
#include "tensor/safetensors.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

std::string stem(int round) { return fmt::format("round-{:06d}", round); }

uint64_t text_checksum(const std::string& text) {
  return chunk_checksum(std::span(reinterpret_cast<const std::byte*>(text.data()), text.size()));
}

}  // namespace

bool crash_point_armed(int round, const char* point) {
  static const char* spec = std::getenv("MEMFL_CRASH_AT");
  return spec != nullptr && fmt::format("{}:{}", round, point) == spec;
}

void crash_point(int round, const char* point) {
  if (crash_point_armed(round, point)) {
    const char* spec = std::getenv("MEMFL_CRASH_AT");
    spdlog::warn("MEMFL_CRASH_AT={}: killing this process (SIGKILL)", spec);
    ::kill(::getpid(), SIGKILL);
  }
}

Status commit_state(const std::string& run_dir, const std::string& checkpoint, const Layout& layout, const Arena& model,
                    CommittedState state, int keep) {
  const fs::path dir = fs::path(run_dir) / "state";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return not_found("{}: cannot create: {}", dir.string(), ec.message());
  const std::string model_file = stem(state.round) + ".safetensors";
  const fs::path model_path = dir / model_file;
  // A hard link: the checkpoint's inode stays this commit's model even when
  // the next round renames a new checkpoint over its name.
  fs::remove(model_path, ec);
  fs::create_hard_link(checkpoint, model_path, ec);
  if (ec) {
    // A file system without hard links: copy (disk, not memory).
    fs::copy_file(checkpoint, model_path, fs::copy_options::overwrite_existing, ec);
    if (ec) return internal_error("{}: cannot link or copy {}: {}", model_path.string(), checkpoint, ec.message());
    MEMFL_RETURN_IF_ERROR(fsync_path(model_path.string(), false));
  }
  nlohmann::ordered_json j;
  j["format"] = "memfl-server-state";
  j["version"] = 1;
  j["round"] = state.round;
  j["model_file"] = model_file;
  j["model_bytes"] = layout.total_bytes();
  j["layout_hash"] = fmt::format("{:016x}", layout.hash());
  j["model_xxh3"] = fmt::format("{:016x}", chunk_checksum(model.bytes().subspan(0, layout.total_bytes())));
  j["scheduler"] = state.scheduler;
  j["aggregator"] = state.aggregator;
  j["extra"] = state.extra;
  if (!state.experiment.empty()) j["experiment"] = state.experiment;
  const std::string body = j.dump(2);
  nlohmann::ordered_json outer;
  outer["body_xxh3"] = fmt::format("{:016x}", text_checksum(body));
  outer["body"] = body;
  crash_point(state.round, "commit");  // model linked, state not yet written: the previous commit must win
  MEMFL_RETURN_IF_ERROR(write_text_file_durably((dir / (stem(state.round) + ".json")).string(), outer.dump(1) + "\n"));
  MEMFL_RETURN_IF_ERROR(fsync_path(dir.string(), true));
  // Keep the newest `keep` commits (this one among them: it is durable
  // now); files of older rounds go — their model, their JSON, and the
  // aggregator's state file (aggregator-round-NNNNNN.bin). Rounds are
  // counted by their JSON, not by number: with checkpoint_every > 1 the
  // committed rounds are not consecutive.
  std::vector<int> committed;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    int r = 0;
    char tail[8] = {};
    const std::string name = entry.path().filename().string();
    if (std::sscanf(name.c_str(), "round-%d.%7s", &r, tail) == 2 && std::string(tail) == "json") committed.push_back(r);
  }
  std::sort(committed.rbegin(), committed.rend());
  if (static_cast<int>(committed.size()) > keep) {
    const int oldest_kept = committed[static_cast<size_t>(keep) - 1];
    std::vector<fs::path> drop;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      const size_t at = name.find("round-");
      int r = 0;
      if ((at == 0 || name.rfind("aggregator-round-", 0) == 0) &&
          std::sscanf(name.c_str() + at, "round-%d.", &r) == 1 && r < oldest_kept) {
        drop.push_back(entry.path());
      }
    }
    for (const auto& path : drop) fs::remove(path, ec);
  }
  return Status::Ok();
}

uint64_t checkpoint_bytes_on_disk(const std::string& run_dir) {
  std::vector<fs::path> files = {fs::path(run_dir) / "global_model.safetensors",
                                 fs::path(run_dir) / "global_model.safetensors.next"};
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(run_dir) / "state", ec)) {
    if (entry.path().extension() == ".safetensors" ||
        entry.path().filename().string().rfind("aggregator-round-", 0) == 0)
      files.push_back(entry.path());
  }
  std::vector<std::pair<dev_t, ino_t>> seen;
  uint64_t bytes = 0;
  for (const auto& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0) continue;
    const std::pair<dev_t, ino_t> id{st.st_dev, st.st_ino};
    if (std::find(seen.begin(), seen.end(), id) != seen.end()) continue;  // a commit's hard link
    seen.push_back(id);
    bytes += static_cast<uint64_t>(st.st_blocks) * 512;  // allocated, not apparent, size
  }
  return bytes;
}

Status check_checkpoint_disk(const std::string& run_dir, const CheckpointPolicy& policy, uint64_t model_bytes,
                             uint64_t already_on_disk, uint64_t free_bytes, int last_round, uint64_t state_bytes) {
  const uint64_t files = policy.peak_model_files(last_round);
  const uint64_t kept = std::min<uint64_t>(static_cast<uint64_t>(policy.keep), files - 1);
  // The undo checkpoint is a model alone; every commit has its state beside it.
  const uint64_t peak = model_bytes * files + state_bytes * (kept + 1);
  // The next checkpoint is a new file whatever is on disk: on resume the
  // global model is written again beside the commits it came from (it is
  // not one of their links any more), so the files there can already reach
  // the policy's peak and the next write still needs a whole model free.
  const uint64_t need = std::max(peak > already_on_disk ? peak - already_on_disk : 0, model_bytes + state_bytes);
  if (need <= free_bytes) return Status::Ok();
  return resource_exhausted(
      "{}: the checkpoint policy needs {} bytes more disk ({} bytes of model x {} checkpoint files: {} kept "
      "(server_configs.checkpoint_keep = {}) + 1 being written{}{}, less {} already there) but {} bytes are free; "
      "free space there, lower checkpoint_keep, or start the run elsewhere (--out)",
      run_dir, need, model_bytes, files, kept, policy.keep, files > kept + 1 ? " + 1 undo of an uncommitted round" : "",
      state_bytes > 0 ? fmt::format("; {} bytes of server optimizer state x {} commits", state_bytes, kept + 1) : "",
      already_on_disk, free_bytes);
}

StatusOr<uint64_t> free_disk_bytes(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return not_found("{}: statvfs failed: {}", dir, std::strerror(errno));
  return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
}

namespace {

// Refuses a commit of another experiment than `expected`, naming up to a few
// keys that differ (the commit's JSON is checksummed: a difference is
// another run's state, not a torn file).
Status check_experiment(const fs::path& path, const nlohmann::json& j,
                        const std::map<std::string, std::string>& expected) {
  if (expected.empty()) return Status::Ok();
  const auto it = j.find("experiment");
  if (it == j.end() || !it->is_object()) {
    spdlog::warn("--resume: {} does not record its experiment (written by an older memfl); not checked", path.string());
    return Status::Ok();
  }
  std::vector<std::string> differ;
  for (const auto& [key, value] : expected) {
    const auto v = it->find(key);
    const std::string there = v != it->end() && v->is_string() ? v->get<std::string>() : std::string("(unset)");
    if (there != value) differ.push_back(fmt::format("{}: {} in the state, {} in this run", key, there, value));
  }
  for (const auto& [key, value] : it->items()) {
    if (expected.find(key) == expected.end()) differ.push_back(fmt::format("{}: only in the state", key));
  }
  if (differ.empty()) return Status::Ok();
  const size_t shown = std::min<size_t>(differ.size(), 5);
  std::string list;
  for (size_t i = 0; i < shown; ++i) list += (i ? "; " : "") + differ[i];
  if (differ.size() > shown) list += fmt::format("; and {} more", differ.size() - shown);
  return failed_precondition(
      "--resume: {} was committed by another experiment than this run's ({}); its state/ is not this run's; "
      "nothing was resumed from it",
      path.string(), list);
}

}  // namespace

StatusOr<CommittedState> load_committed_state(const std::string& run_dir, const Layout& layout, Arena& model,
                                              const std::map<std::string, std::string>& experiment) {
  const fs::path dir = fs::path(run_dir) / "state";
  std::vector<std::pair<int, fs::path>> commits;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    int r = 0;
    char tail[8] = {};
    if (std::sscanf(name.c_str(), "round-%d.%7s", &r, tail) == 2 && std::string(tail) == "json") {
      commits.emplace_back(r, entry.path());
    }
  }
  if (commits.empty()) {
    return not_found(
        "--resume {}: no committed server state in {} (a run commits after every server_configs.checkpoint_every "
        "rounds and after its last; with checkpoint_final_only only after its last)",
        run_dir, dir.string());
  }
  std::sort(commits.rbegin(), commits.rend());
  for (const auto& [r, path] : commits) {
    auto fail = [&, &path = path](const std::string& why) {
      spdlog::warn("--resume: {} is not usable ({}); trying the commit before it", path.string(), why);
    };
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    nlohmann::json outer = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (outer.is_discarded() || !outer.contains("body") || !outer["body"].is_string() || !outer.contains("body_xxh3")) {
      fail("torn or not a state file");
      continue;
    }
    const std::string body = outer["body"].get<std::string>();
    if (fmt::format("{:016x}", text_checksum(body)) != outer["body_xxh3"].get<std::string>()) {
      fail("checksum of its text does not match");
      continue;
    }
    nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    if (j.is_discarded() || j.value("round", -1) != r) {
      fail("round does not match its name");
      continue;
    }
    // Before the layout and the model: another run's state says so even
    // when its model happens to have this run's layout.
    MEMFL_RETURN_IF_ERROR(check_experiment(path, j, experiment));
    if (j.value("layout_hash", std::string()) != fmt::format("{:016x}", layout.hash())) {
      return failed_precondition("--resume: {} is a model of layout {} but this config's model has layout {:016x}",
                                 path.string(), j.value("layout_hash", std::string("?")), layout.hash());
    }
    const std::string model_path = (dir / j.value("model_file", std::string())).string();
    auto file = SafetensorsFile::open(model_path);
    if (!file.ok()) {
      fail(file.status().message());
      continue;
    }
    Status loaded = (*file)->load_into(layout, model);
    if (!loaded.ok()) {
      fail(loaded.message());
      continue;
    }
    if (fmt::format("{:016x}", chunk_checksum(model.bytes().subspan(0, layout.total_bytes()))) !=
        j.value("model_xxh3", std::string())) {
      fail(fmt::format("the bytes of {} do not match its checksum", model_path));
      continue;
    }
    CommittedState st;
    st.round = r;
    st.model_path = model_path;
    st.scheduler = j.value("scheduler", nlohmann::json::object());
    st.aggregator = j.value("aggregator", nlohmann::json::object());
    st.extra = j.value("extra", nlohmann::json::object());
    st.experiment = experiment;
    spdlog::info("--resume: continuing after round {} from {}", r, path.string());
    return st;
  }
  return data_loss("--resume {}: no commit in {} checks out (each named above)", run_dir, dir.string());
}

}  // namespace memfl
