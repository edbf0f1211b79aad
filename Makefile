# Human front end over CMake. `make demo` and `make test` set everything up
# (Debian packages through scripts/install-deps.sh) on a fresh Debian 12.
BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_FLAGS ?=
# ccache and precompiled headers: see docs/BENCHMARKS.md for what they save.
# No include_file_mtime/ctime sloppiness: with it ccache stores a header's
# hash read after the compile, so a header saved during a build gets the
# object of its old text cached under its new one (a stale object that
# ninja and every later checkout then trust).
export CCACHE_SLOPPINESS = pch_defines,time_macros
export CCACHE_DIR ?= $(HOME)/.cache/ccache
# Paths relative to the checkout, and the build directory left out of the
# hash: a fresh clone elsewhere (CI's) hits what another checkout compiled.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1

.PHONY: deps configure build python demo test test-unit test-asan bench fuzz profile-demo check-guides devkit format clean

# Debian packages, then the report's front-end libraries (pinned in
# report-assets/package-lock.json; inlined into memfl at build time).
deps:
	@bash scripts/install-deps.sh
	@if [ ! -f report-assets/node_modules/.package-lock.json ] || \
	    [ report-assets/package-lock.json -nt report-assets/node_modules/.package-lock.json ]; then \
	  echo "npm ci report-assets"; npm ci --prefix report-assets --no-audit --no-fund >/dev/null; fi

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS)

configure: deps $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# `import memfl`: the Python client, into build/python (PYTHONPATH=build/python).
python: configure
	cmake --build $(BUILD) -j $(JOBS) --target memfl_python

# The main job on its embedded default: FedAvg, 10 clients, Fashion-MNIST, CNN.
# Builds only what it runs (memfl and its trainer plugin), then writes the
# run's HTML report and prints where it is.
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target memfl
	@dir=runs/demo-$$(date +%Y%m%d-%H%M%S); \
	./$(BUILD)/memfl run --out $$dir && ./$(BUILD)/memfl report $$dir

# Both suites always run (a failure in the first does not hide the second);
# the last lines say how each ended, and the exit status is a failure if
# either failed.
test: build
	@rc_main=0; rc_asan=0; \
	(cd $(BUILD) && ctest --output-on-failure -j 1) || rc_main=$$?; \
	$(MAKE) --no-print-directory test-asan || rc_asan=$$?; \
	echo "== make test: main suite (ctest in $(BUILD)): $$( [ $$rc_main -eq 0 ] && echo passed || echo FAILED)"; \
	echo "== make test: ASan/UBSan suite (ctest in $(ASAN_BUILD)): $$( [ $$rc_asan -eq 0 ] && echo passed || echo FAILED)"; \
	[ $$rc_main -eq 0 ] && [ $$rc_asan -eq 0 ]

# ASan+UBSan build of the torch-free tests (libtorch itself is not built with
# sanitizers, so the plugin stays out of this build).
test-asan: deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMEMFL_SANITIZE=ON \
	  -DMEMFL_WITH_TORCH=OFF -DMEMFL_WITH_BENCH=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target memfl_tests memfl_secagg_tests memfl
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

bench: build
	./$(BUILD)/memfl_bench --benchmark_out=$(BUILD)/bench.json --benchmark_out_format=json
	bash bench/memory_scaling.sh $(BUILD) > $(BUILD)/bench_memory.json
	bash bench/transfer_sweep.sh $(BUILD) > $(BUILD)/bench_transfer.json
	TRANSPORT=mpi MODES=streaming SIZES="256 1024 2560 4096" bash bench/transfer_sweep.sh $(BUILD) > $(BUILD)/bench_transfer_mpi.json
	bash bench/mpi_raw.sh $(BUILD)/mpi_raw > $(BUILD)/bench_mpi_raw.json
	bash bench/profile_overhead.sh $(BUILD) 2 > $(BUILD)/bench_profile_overhead.json
	bash bench/simulation.sh $(BUILD) 100 100 1000 > $(BUILD)/bench_simulation.json
	bash bench/server_core.sh $(BUILD) > $(BUILD)/bench_server_core.jsonl
	bash bench/soak.sh $(BUILD) 200 256 > $(BUILD)/bench_soak.json
	bash bench/aggregators.sh $(BUILD) 1024 > $(BUILD)/bench_aggregators.jsonl
	AGGREGATORS=FedAdamAggregator ARENA_BACKING=file bash bench/aggregators.sh $(BUILD) 1024 > $(BUILD)/bench_aggregators_file.jsonl
	bash bench/async_memory.sh $(BUILD) > $(BUILD)/bench_async_memory.jsonl
	bash bench/async_scale.sh $(BUILD) > $(BUILD)/bench_async_scale.jsonl
	bash bench/server_sessions.sh $(BUILD) > $(BUILD)/bench_server_sessions.jsonl
	./$(BUILD)/memfl compare-algorithms configs/fedasync_fmnist_cnn.yaml --algorithms FedAvg,FedAsync,FedBuff,FedCompass \
	  --set server_configs.num_global_epochs=25 --set client_configs.data_configs.dataset_kwargs.max_test_samples=2000 \
	  --target 0.6,0.7,0.8 --out $(BUILD)/compare_algorithms
	bash bench/netem.sh $(BUILD) 64 6 > $(BUILD)/bench_netem.jsonl
	./$(BUILD)/memfl bench dp --model llama-dp-tiny --seq 64,128 --batch 2 --json $(BUILD)/bench_dp.json
	./$(BUILD)/memfl_bench_trainer 10 2 > $(BUILD)/bench_trainer.jsonl
	bash bench/blas_threads_ab.sh $(BUILD) 2 5 2 > $(BUILD)/bench_blas_threads_ab.jsonl
	bash bench/malloc_policy_ab.sh $(BUILD) 2 5 2 > $(BUILD)/bench_malloc_policy_ab.jsonl
	bash bench/sim_floor.sh $(BUILD) 100 2 1 > $(BUILD)/bench_sim_floor.jsonl
	bash bench/grpc_vs_tcp.sh $(BUILD) > $(BUILD)/bench_grpc_vs_tcp.jsonl
	bash bench/default_path.sh $(BUILD) > $(BUILD)/bench_default_path.jsonl
	python3 bench/spread.py $(BUILD)/bench_grpc_vs_tcp.jsonl clients,model_chunk_size_mib > $(BUILD)/bench_grpc_vs_tcp_spread.jsonl
	bash bench/mpi_spread.sh $(BUILD) > $(BUILD)/bench_mpi_spread.jsonl
	python3 bench/spread.py $(BUILD)/bench_mpi_spread.jsonl model_bytes,clients > $(BUILD)/bench_mpi_spread_summary.jsonl
	c++ -O2 -std=c++20 -march=x86-64-v3 bench/membw.cpp -o $(BUILD)/membw -pthread && ./$(BUILD)/membw > $(BUILD)/bench_membw.json
	c++ -O2 -std=c++20 -march=x86-64-v3 bench/transfer_work.cpp -o $(BUILD)/transfer_work -pthread && \
	  ./$(BUILD)/transfer_work 1024 3 1024 > $(BUILD)/bench_transfer_work.jsonl && ./$(BUILD)/transfer_work 4096 2 1024 >> $(BUILD)/bench_transfer_work.jsonl
	./$(BUILD)/memfl bench dp --model llama-dp-tiny --seq 64,128 --batch 2 --optimizer adam --gpus 1 --sharded \
	  --json $(BUILD)/bench_dp_sharded_1rank.json
	./$(BUILD)/memfl bench dp --model llama-dp-tiny --seq 64,128 --batch 2 --optimizer adam --gpus 2 \
	  --json $(BUILD)/bench_dp_sharded_2ranks.json
	bash bench/sharded_dp_noise.sh $(BUILD) > $(BUILD)/bench_sharded_dp_noise.json
	@echo "wrote $(BUILD)/bench.json (aggregation micro-benchmarks), $(BUILD)/bench_memory.json (in-process peak RSS vs model size and clients), $(BUILD)/bench_transfer.json (gRPC sweep)"

# What memfl saves, in one command: ResNet18 on synthetic CIFAR-10, server +
# 2 clients over gRPC, profiled, naive then streaming, and the comparison.
PROFILE_DEMO ?= runs/profile-demo
profile-demo: build
	rm -rf $(PROFILE_DEMO)
	./$(BUILD)/memfl launch configs/resnet18_synthetic_profile.yaml --clients 2 --profile -q \
	  --set server_configs.memory_mode=naive --out $(PROFILE_DEMO)/naive
	./$(BUILD)/memfl launch configs/resnet18_synthetic_profile.yaml --clients 2 --profile -q \
	  --out $(PROFILE_DEMO)/streaming
	./$(BUILD)/memfl report $(PROFILE_DEMO)/naive
	./$(BUILD)/memfl report $(PROFILE_DEMO)/streaming
	./$(BUILD)/memfl compare $(PROFILE_DEMO)/naive $(PROFILE_DEMO)/streaming --out $(PROFILE_DEMO)/compare
	@cat $(PROFILE_DEMO)/compare/comparison.txt
	@echo "open $(PROFILE_DEMO)/compare/index.html"

# Fuzz the wire decoder, the config loader, the safetensors reader and the
# compressed-frame decoder for FUZZ_SECONDS each (clang + libFuzzer,
# ASan+UBSan), each on its own corpus: fuzz/corpus, fuzz/corpus_config,
# fuzz/corpus_safetensors, fuzz/corpus_frames. Crashing inputs land in that
# corpus as crash-* (rename them bad_*, fix, commit: the tests replay them). What the fuzzers add lies in build-fuzz/corpus*.
FUZZ_SECONDS ?= 60
FUZZERS = chunk_decoder_fuzzer:corpus config_loader_fuzzer:corpus_config safetensors_header_fuzzer:corpus_safetensors \
  frame_decoder_fuzzer:corpus_frames
fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMEMFL_SANITIZE=ON \
	  -DMEMFL_FUZZ=ON -DMEMFL_WITH_TORCH=OFF -DMEMFL_WITH_TESTS=OFF -DMEMFL_WITH_BENCH=OFF
	cmake --build build-fuzz -j $(JOBS) --target $(foreach f,$(FUZZERS),$(word 1,$(subst :, ,$(f))))
	set -e; for f in $(FUZZERS); do \
	  name=$${f%%:*}; corpus=$${f#*:}; \
	  mkdir -p build-fuzz/$$corpus; \
	  echo "== $$name ($(FUZZ_SECONDS) s, fuzz/$$corpus)"; \
	  ./build-fuzz/$$name -max_total_time=$(FUZZ_SECONDS) -artifact_prefix=fuzz/$$corpus/crash- \
	    build-fuzz/$$corpus fuzz/$$corpus; \
	done

# memfl and the Debian shared libraries it needs beyond glibc and libstdc++,
# stripped, in build-devkit/ (≈ 30 MB): carried to a lent host that lacks
# them (gRPC) for bench/llm_round_kit.sh. OpenMPI's go to fallback/: the
# host's own are used where it has them.
devkit: build
	rm -rf build-devkit && mkdir -p build-devkit/lib build-devkit/fallback
	cp $(BUILD)/memfl build-devkit/ && cp $(BUILD)/libmemfl_core.so build-devkit/lib/
	strip --strip-debug build-devkit/memfl build-devkit/lib/libmemfl_core.so
	ldd $(BUILD)/memfl | awk '$$3 ~ /^\// {print $$3}' | while read -r l; do \
	  case $$(basename $$l) in \
	    libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*|libmemfl_core*) ;; \
	    libmpi*|libopen-*|libhwloc*|libevent*|libudev*|libpmix*) cp -L $$l build-devkit/fallback/ ;; \
	    *) cp -L $$l build-devkit/lib/ ;; \
	  esac; done
	@du -sh build-devkit

# Every ```sh block of docs/guide/*.md, run as written (scripts/check-guides.sh).
check-guides: build
	bash scripts/check-guides.sh

format:
	clang-format -i $$(git ls-files 'src/*.cpp' 'src/*.h' 'tests/*.cpp' 'tests/*.h' 'bench/*.cpp' 'fuzz/*.cpp' 'fuzz/*.h')

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
