// Micro-benchmarks of the streaming path (`make bench`, JSON in
// build/bench.json): FedAvg folding chunks into the running sum, per dtype
// and chunk size, with and without the server's value checks
// (comm/update_check.h), and the xxh3 chunk checksum.
#include <benchmark/benchmark.h>

#include <cstring>

#include "aggregate/fedavg_aggregator.h"
#include "comm/chunk.h"
#include "comm/update_check.h"

namespace memfl {
namespace {

Layout bench_layout(DType d, size_t params) {
  LayoutBuilder b;
  // A few large tensors, like a real model's weight matrices.
  for (int i = 0; i < 4; ++i) b.add("layer" + std::to_string(i) + ".weight", d, {static_cast<int64_t>(params / 4)});
  return std::move(b).build().value();
}

// FedAvg folding one update of 16 Mi parameters, chunk by chunk; with
// `checked`, every update's sample count and values checked as its chunks
// arrive (what a server does): the difference is the check's cost per GB
// folded.
template <bool checked>
void fold_update(benchmark::State& state) {
  const auto dtype = static_cast<DType>(state.range(0));
  const size_t chunk = static_cast<size_t>(state.range(1));
  Layout layout = bench_layout(dtype, 16u << 20);  // 16 Mi parameters
  Arena model(layout.total_bytes(), MemoryCategory::kModel);
  std::memset(model.data(), 0x3c, model.size());
  FedAvgAggregator agg(layout, ClientWeightsMode::kSampleSize);
  int round = 0;
  for (auto _ : state) {
    (void)agg.begin_round(++round);
    CheckedUpdateOpener with_checks(agg, layout, round, UpdateLimits{});
    UpdateOpener& opener = checked ? static_cast<UpdateOpener&>(with_checks) : agg;
    auto up = opener.open_update("bench", 100);
    auto n = stream_arena(layout, model, chunk, **up);
    benchmark::DoNotOptimize(n);
    (void)(*up)->commit();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(layout.total_bytes()));
  state.SetLabel(std::string(dtype_name(dtype)));
}

void BM_FedAvgFold(benchmark::State& state) { fold_update<false>(state); }
BENCHMARK(BM_FedAvgFold)
    ->ArgsProduct({{static_cast<int>(DType::kF32), static_cast<int>(DType::kBF16)}, {64 << 10, 1 << 20, 4 << 20}})
    ->Unit(benchmark::kMillisecond);

void BM_FedAvgFoldChecked(benchmark::State& state) { fold_update<true>(state); }
BENCHMARK(BM_FedAvgFoldChecked)
    ->ArgsProduct({{static_cast<int>(DType::kF32), static_cast<int>(DType::kBF16)}, {1 << 20}})
    ->Unit(benchmark::kMillisecond);

// The value check alone, on a chunk already in cache.
void BM_FiniteValueCheck(benchmark::State& state) {
  const auto dtype = static_cast<DType>(state.range(0));
  Layout layout = bench_layout(dtype, 1u << 18);
  std::vector<std::byte> buf(layout.total_bytes(), std::byte{0x3c});
  for (auto _ : state) {
    FiniteValueCheck check(layout);
    benchmark::DoNotOptimize(check.check(0, std::span<const std::byte>(buf), "bench", 1));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(buf.size()));
  state.SetLabel(std::string(dtype_name(dtype)));
}
BENCHMARK(BM_FiniteValueCheck)->Arg(static_cast<int>(DType::kF32))->Arg(static_cast<int>(DType::kBF16));

void BM_ChunkChecksum(benchmark::State& state) {
  std::vector<std::byte> buf(static_cast<size_t>(state.range(0)), std::byte{7});
  for (auto _ : state) benchmark::DoNotOptimize(chunk_checksum(buf));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_ChunkChecksum)->Arg(1 << 20)->Arg(4 << 20);

}  // namespace
}  // namespace memfl

BENCHMARK_MAIN();
