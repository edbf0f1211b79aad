// memfl command line. Exit codes (also in `memfl --help`):
//   0 success, 1 the run failed, 2 bad usage or config, 3 missing data set,
//   file or plugin.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <spdlog/spdlog.h>

#include "config/config.h"
#include "default_config.h"
#include "roles/run_dir.h"
#include "roles/simulation.h"
#include "tensor/safetensors.h"

namespace {

constexpr int kExitOk = 0;
constexpr int kExitRunFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitMissing = 3;

int exit_code_for(const memfl::Status& s) {
  switch (s.code()) {
    case memfl::StatusCode::kOk: return kExitOk;
    case memfl::StatusCode::kInvalidArgument: return kExitUsage;
    case memfl::StatusCode::kNotFound: return kExitMissing;
    default: return kExitRunFailed;
  }
}

int fail(const memfl::Status& s) {
  fmt::print(stderr, "memfl: error: {}\n", s.message());
  return exit_code_for(s);
}

memfl::StatusOr<memfl::ExperimentConfig> load(const std::string& path, const std::vector<std::string>& sets) {
  if (path.empty()) return memfl::load_config_text(memfl::kDefaultConfigYaml, memfl::kDefaultConfigName, sets);
  return memfl::load_config_file(path, sets);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"memfl — memory-efficient federated learning\n\n"
               "Exit codes: 0 success, 1 run failed, 2 bad usage or config, 3 missing data set, file or plugin."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "memfl 0.1.0");

  std::string config_path, out_dir;
  std::vector<std::string> sets;
  bool quiet = false;

  auto* run = app.add_subcommand("run", "Run an in-process federated simulation (server + virtual clients)");
  run->add_option("CONFIG", config_path, "YAML config (default: the embedded configs/fedavg_fmnist_cnn.yaml)");
  run->add_option("--out", out_dir, "run directory (default: <logging_output_dirname>/<timestamp>-<pid>)");
  run->add_option("--set", sets, "override a config key: --set server_configs.num_global_epochs=2 (repeatable)");
  run->add_flag("-q,--quiet", quiet, "no per-round progress lines");

  auto* validate = app.add_subcommand("validate", "Check a config and print it with every default resolved");
  validate->add_option("CONFIG", config_path, "YAML config (default: the embedded default)");
  validate->add_option("--set", sets, "override a config key (repeatable)");

  app.add_subcommand("config-keys", "List every config key with its type, default and meaning");
  app.add_subcommand("list-models", "List the models of the registry");

  std::string st_path;
  auto* inspect = app.add_subcommand("inspect", "Print the tensors of a safetensors file");
  inspect->add_option("FILE", st_path, "a .safetensors file")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitUsage;
  }

  if (app.got_subcommand("config-keys")) {
    fmt::print("{}", memfl::describe_config_keys());
    return kExitOk;
  }
  if (app.got_subcommand("list-models")) {
    for (const auto& n : memfl::known_model_names()) fmt::print("{}\n", n);
    return kExitOk;
  }
  if (app.got_subcommand("inspect")) {
    auto file = memfl::SafetensorsFile::open(st_path);
    if (!file.ok()) return fail(file.status());
    size_t params = 0, bytes = 0;
    for (const auto& t : (*file)->tensors()) {
      size_t n = 1;
      for (auto d : t.shape) n *= static_cast<size_t>(d);
      params += n;
      bytes += t.data.size();
      fmt::print("{:<48} {:<5} [{}]\n", t.name, memfl::dtype_name(t.dtype), fmt::join(t.shape, ", "));
    }
    fmt::print("{} tensors, {} parameters, {}\n", (*file)->tensors().size(), params,
               memfl::format_bytes(static_cast<double>(bytes)));
    return kExitOk;
  }
  if (app.got_subcommand("validate")) {
    auto cfg = load(config_path, sets);
    if (!cfg.ok()) return fail(cfg.status());
    fmt::print("# {} — valid\n{}", cfg->source, cfg->resolved_yaml);
    return kExitOk;
  }

  // run
  auto cfg = load(config_path, sets);
  if (!cfg.ok()) return fail(cfg.status());
  auto dir = memfl::prepare_run_dir(out_dir, *cfg);
  if (!dir.ok()) return fail(dir.status());
  memfl::Status st = memfl::write_text_file(*dir + "/config.yaml", "# resolved from " + cfg->source + "\n" +
                                                                       cfg->resolved_yaml);
  if (!st.ok()) return fail(st);
  spdlog::set_pattern("[%H:%M:%S.%e] [%l] %v");
  spdlog::info("run directory {}", *dir);
  auto result = memfl::run_simulation(*cfg, {*dir, !quiet});
  if (!result.ok()) {
    fmt::print(stderr, "memfl: run failed; what was measured so far is in {}\n", *dir);
    return fail(result.status());
  }
  const auto& last = result->rounds.back();
  fmt::print("done: {} rounds, test accuracy {:.4f}, peak RSS {} ({:.1f}× the {} model), {:.1f} s — {}\n",
             result->rounds.size(), last.test_accuracy, memfl::format_bytes(static_cast<double>(result->peak_rss_bytes)),
             static_cast<double>(result->peak_rss_bytes) / static_cast<double>(result->model_bytes),
             memfl::format_bytes(static_cast<double>(result->model_bytes)), result->wall_seconds, *dir);
  return kExitOk;
}
