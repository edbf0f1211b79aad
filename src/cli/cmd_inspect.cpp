// memfl inspect: a model preset described from its spec, a safetensors
// checkpoint's tensors, or (--write-layout) a TorchScript model's tensors
// written to a safetensors file.
#include <CLI/CLI.hpp>
#include <fmt/ranges.h>  // fmt::join (its home since fmt 11; here on 9 too)

#include <filesystem>
#include <map>
#include <memory>

#include "cli/commands.h"
#include "model/llama.h"
#include "tensor/safetensors.h"
#include "tensor/sharded_safetensors.h"
#include "train/trainer_backend.h"

namespace memfl::cli {

namespace {

struct InspectArgs {
  std::string st_path, inspect_dtype = "bf16";
  int64_t inspect_chunk = 16 << 20;
  std::string write_layout;
};

// memfl inspect MODEL: a llama preset (or "synthetic"), described from its
// spec alone — parameters, bytes per dtype, and the predicted peak per role
// from the bounds in docs/ARCHITECTURE.md with the constants measured in
// docs/BENCHMARKS.md (2-core machine, 16 MiB chunks).
int inspect_model(const std::string& name, const std::string& dtype, int64_t chunk) {
  memfl::ModelConfig m;
  m.model_name = name;
  m.dtype = dtype;
  auto layout = memfl::layout_without_network(m);
  if (!layout.ok()) return fail(layout.status());
  const double model = static_cast<double>(layout->payload_bytes());
  const double c = static_cast<double>(chunk);
  constexpr double kMiB = 1 << 20;
  const double server_base = 16.5 * kMiB, client_base = 21 * kMiB;  // measured baselines (no libtorch)
  const bool wide = dtype == "f32";
  fmt::print("{}: {} parameters ({:.2f} B), {} tensors, {} as {}\n", name, layout->num_params(),
             static_cast<double>(layout->num_params()) / 1e9, layout->size(), memfl::format_bytes(model), dtype);
  fmt::print("predicted peak per role (model M = {}, chunk {}):\n", memfl::format_bytes(model), memfl::format_bytes(c));
  auto row = [](const char* role, const char* formula, double anon, double file, double disk) {
    fmt::print("  {:<44} {:<34} anon {:>10}  file-backed {:>10}  disk {:>10}\n", role, formula,
               memfl::format_bytes(anon), memfl::format_bytes(file), memfl::format_bytes(disk));
  };
  row("server, memory, in-place (f32 / model_dtype)", "base + M + 4·chunk", server_base + model + 4 * c, 0, model);
  if (!wide) row("server, memory, f32 accumulator", "base + 3·M + 4·chunk", server_base + 3 * model + 4 * c, 0, model);
  row("server, arena_backing: file", "base + 6·chunk; disk 2·M", server_base + 6 * c, model, 2 * model);
  row("client (DummyTrainer), memory", "base + M + 2·chunk", client_base + model + 2 * c, 0, 0);
  row("client (DummyTrainer), arena_backing: file", "base + 2·chunk; disk M", client_base + 2 * c, model, model);
  const double f32_model = static_cast<double>(layout->num_params()) * 4;
  row("client training, f32 weights + Adam", "4·M(f32) + activations", client_base + 4 * f32_model, 0, 0);
  // Rates measured with 2 DummyTrainer clients (docs/BENCHMARKS.md, "LLM
  // scale"). In memory, server and clients on one 32-core host over the MPI
  // ring, a 36B model (72.7 GB): setup (first touch of every arena + the
  // seeded fill) 2.26 GB of model a second, broadcast 8.47 GB/s and upload
  // 2.92 GB/s (both clients' bytes), the commit 1.22 GB/s (the disk).
  // File-backed, on the 2-core / 24 GiB machine (llama-8b over gRPC):
  // 0.80 GB/s down, 0.28 up.
  const double mem_round = model / 2.26e9 + 2 * model / 8.47e9 + 2 * model / 2.92e9 + model / 1.22e9;
  const double file_round = 2 * model / 0.80e9 + 2 * model / 0.28e9;
  fmt::print(
      "predicted job time with 2 DummyTrainer clients, one round and its commit: {:.0f} s with every model in "
      "one many-core host's memory (MPI); {:.0f} s file-backed on a 2-core machine\n",
      mem_round, file_round);
  return 0;
}

// memfl inspect PATH: a .safetensors file, an index.json of shards, or a
// directory holding either. Reads headers only.
int inspect_checkpoint(const std::string& path) {
  auto ckpt = memfl::ShardedCheckpoint::open(path);
  if (!ckpt.ok()) return fail(ckpt.status());
  size_t params = 0, bytes = 0;
  std::map<memfl::DType, size_t> bytes_per_dtype;
  for (const auto& t : ckpt->tensors()) {
    params += t.numel();
    bytes += t.nbytes;
    bytes_per_dtype[t.dtype] += t.nbytes;
    if (ckpt->sharded()) {
      fmt::print("{:<48} {:<5} {:<20} {}\n", t.name, memfl::dtype_name(t.dtype),
                 fmt::format("[{}]", fmt::join(t.shape, ", ")),
                 std::filesystem::path(ckpt->shard_of(t)).filename().string());
    } else {
      fmt::print("{:<48} {:<5} [{}]\n", t.name, memfl::dtype_name(t.dtype), fmt::join(t.shape, ", "));
    }
  }
  fmt::print("{} tensors, {} parameters, {}\n", ckpt->tensors().size(), params,
             memfl::format_bytes(static_cast<double>(bytes)));
  std::vector<std::string> per_dtype;
  for (const auto& [dtype, n] : bytes_per_dtype) {
    per_dtype.push_back(fmt::format("{} {}", memfl::dtype_name(dtype), memfl::format_bytes(static_cast<double>(n))));
  }
  fmt::print("bytes per dtype: {}\n", fmt::join(per_dtype, ", "));
  if (ckpt->sharded()) fmt::print("{} shards, index {}\n", ckpt->shards().size(), ckpt->index_path());
  return kExitOk;
}

// memfl inspect MODEL.pt --write-layout FILE.
int write_torchscript_layout(const std::string& st_path, const std::string& write_layout) {
  // The one place a TorchScript model's layout needs libtorch: here, once,
  // so servers and DummyTrainer clients can take it from the file.
  auto backend = memfl::load_trainer_backend();
  if (!backend.ok()) return fail(backend.status());
  memfl::ModelConfig mc;
  mc.model_name = "TorchScript";
  mc.torchscript_path = st_path;
  auto replica = (*backend)->create_replica(mc, memfl::InputSpec{}, "cpu", 0);
  if (!replica.ok()) return fail(replica.status());
  const memfl::Layout& layout = (*replica)->layout();
  memfl::Status st =
      memfl::write_safetensors(write_layout, layout, (*replica)->arena(),
                               {{"format", "memfl"}, {"model_name", "TorchScript"}, {"source", st_path}});
  if (!st.ok()) return fail(st);
  fmt::print("wrote {}: {} tensors, {} parameters, layout {:016x} (from {})\n", write_layout, layout.size(),
             layout.num_params(), layout.hash(), st_path);
  return kExitOk;
}

int inspect(const InspectArgs& a) {
  if (!a.write_layout.empty()) return write_torchscript_layout(a.st_path, a.write_layout);
  if (memfl::is_llama_model(a.st_path) && !std::filesystem::exists(a.st_path)) {
    return inspect_model(a.st_path, a.inspect_dtype, a.inspect_chunk);
  }
  return inspect_checkpoint(a.st_path);
}

}  // namespace

CommandFn add_inspect(CLI::App& cmd, SharedOptions&) {
  auto a = std::make_shared<InspectArgs>();
  cmd.add_option("MODEL_OR_PATH", a->st_path,
                 "a model name (llama-tiny|llama-1b|llama-8b|llama-70b), a .safetensors file, a "
                 "model.safetensors.index.json, or a directory of either")
      ->required();
  cmd.add_option("--dtype", a->inspect_dtype, "model name: dtype of the weights (f32, bf16, f16)");
  cmd.add_option("--chunk", a->inspect_chunk, "model name: model_chunk_size in bytes for the prediction");
  cmd.add_option("--write-layout", a->write_layout,
                 "a TorchScript file (.pt): write its tensors (layout and weights) to this safetensors file, "
                 "for client_configs.model_configs.initial_model");
  return [a](int&, char**&) { return inspect(*a); };
}

}  // namespace memfl::cli
