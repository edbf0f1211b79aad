// Experiment configuration in APPFL's YAML layout (client_configs.*,
// server_configs.*), checked against a schema before any work starts: an
// unknown key, a wrong type or a value out of range fails with a message that
// names the key and the file (and suggests the key that was probably meant).
//
//   auto cfg = load_config_file("configs/fedavg_fmnist_cnn.yaml", {"server_configs.num_global_epochs=2"});
//   if (!cfg.ok()) { fmt::print(stderr, "{}\n", cfg.status().message()); return 2; }
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "data/text_config.h"
#include "model/model_config.h"

namespace memfl {

struct OptimConfig {
  std::string optim = "SGD";  // SGD | Adam
  double lr = 0.01;
  double momentum = 0;
  double weight_decay = 0;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  std::string state_dtype = "param";  // Adam's moments: param (the parameters' dtype) | float32
};

// train_configs.dp: sample-level DP-SGD inside each client (Abadi et al.
// 2016): per-sample clipping to max_grad_norm, Gaussian noise of std
// noise_multiplier × max_grad_norm, Poisson-sampled batches of expected size
// train_batch_size; the RDP accountant gives each client's ε for `delta`
// over the steps it took in every round it took part in.
struct DpConfig {
  bool enabled = false;
  double noise_multiplier = 1.0;
  double max_grad_norm = 1.0;
  std::string clipping = "fused";  // naive | ghost | fused
  std::string accountant = "rdp";
  double delta = 1e-5;
};

struct TrainConfig {
  std::string trainer = "VanillaTrainer";
  std::string mode = "epoch";  // epoch | step
  int num_local_epochs = 1;
  int num_local_steps = 100;
  // FedProx (Li et al. 2020): μ of the proximal term μ/2·‖w − w_global‖²
  // added to the local loss (0 = off).
  double mu = 0;
  // Recompute each decoder block in the backward pass instead of keeping its
  // activations (Llama models): less memory for a third more compute.
  bool gradient_checkpointing = false;
  OptimConfig optim;
  int train_batch_size = 64;
  int val_batch_size = 64;
  bool train_data_shuffle = true;
  bool do_validation = true;
  std::string device = "cpu";
  int num_threads = 0;  // libtorch intra-op threads; 0 = number of cores
  int num_gpus = 1;     // ranks the client's model is sharded over: one process each
  DpConfig dp;
  // DummyTrainer: an update that differs per client and round (0: none), and
  // per-client delays ("1.5,0.5": client c takes entry c mod 2).
  double dummy_update_scale = 0;
  // DummyTrainer: σ ÷ dummy_update_scale of seeded Gaussian noise added to
  // each element's change (0: none), so a codec sees a change shaped like a
  // trained one rather than a pattern that repeats every 5 elements.
  double dummy_update_noise = 0;
  // DummyTrainer: a file of little-endian f32 values (a trained update, say)
  // the noise is drawn from instead of a normal, standardised and scaled to
  // the same σ; empty: Gaussian. A trained update's values are heavy-tailed
  // and mostly near zero, which is what sets how well a codec does.
  std::string dummy_update_noise_values;
  std::string dummy_delay_s;
};

struct DataConfig {
  // FashionMNIST | SyntheticCIFAR10 | SyntheticTokens | TextFile | JsonLines
  std::string dataset_name = "FashionMNIST";
  std::string dataset_path;  // empty = the Debian package's directory
  // iid | dirichlet | class_shards | lognormal | power_law | by_group
  std::string partition_strategy = "iid";
  double alpha = 0.5;
  int shards_per_client = 2;
  double sigma = 1.0;
  double power_law_a = 1.5;
  double val_ratio = 0.1;
  int64_t max_train_samples = 0;  // 0 = all
  int64_t max_test_samples = 0;
  int64_t num_train_samples = 5000;  // synthetic data
  int64_t num_test_samples = 1000;
  TextDataConfig text;  // tokenizer_path and the text keys of dataset_kwargs
};

struct ServerConfig {
  int num_clients = 10;
  int clients_per_round = 0;  // 0 = all
  int num_global_epochs = 5;
  std::string scheduler = "SyncScheduler";
  std::string aggregator = "FedAvgAggregator";
  std::string client_weights_mode = "equal";  // equal | sample_size
  // Server optimizers (aggregate/server_optimizer.h), APPFL's names.
  double server_learning_rate = 1.0, server_momentum_param_1 = 0.9, server_momentum_param_2 = 0.99,
         server_adapt_param = 1e-3;
  // Asynchronous FL (aggregate/async_aggregator.h, schedule/compass.h):
  // aggregator_kwargs and scheduler_kwargs as APPFL names them.
  double alpha = 0.9;
  std::string staleness_fn = "constant";  // constant | polynomial | hinge
  double staleness_a = 0.5, staleness_b = 4;
  int buffer_size = 3;  // FedBuff's K
  bool gradient_based = false;
  int max_local_steps = 100, min_local_steps = 20;
  double speed_momentum = 0.9, latest_time_factor = 1.5;
  // The simulator's client speeds: seconds per local step of client c, drawn
  // once per client from the distribution (seeded): constant (step_time),
  // lognormal (step_time · e^(sigma·z)) or uniform (step_time · U(1, max_ratio)).
  std::string client_speed_distribution = "constant";
  double client_step_time_s = 0.1, client_speed_sigma = 0.5, client_speed_max_ratio = 4;
  int async_eval_every = 0;
  // Simulator, asynchronous: stop at this virtual time (0 = when
  // num_global_epochs updates have arrived); compare-algorithms --equal-time.
  double async_virtual_seconds = 0;
  // APPFL's copies and aliases, checked against the keys above.
  std::string weights_alias;  // aggregator_kwargs.weights (FedCompass's name for client_weights_mode)
  int kwargs_num_clients = 0, scheduler_num_clients = 0;
  bool same_init_model = true;
  std::string logging_output_filename = "result";  // asynchronous: evaluate every N updates (0 = num_clients)
  bool is_async() const { return scheduler == "AsyncScheduler" || scheduler == "CompassScheduler"; }
  std::string device = "cpu";
  std::string logging_output_dirname = "runs";
  uint64_t seed = 42;
  // comm_configs.grpc_configs (APPFL's names); the chunk settings apply to
  // every transport, in-process included.
  bool use_model_chunking = true;
  int64_t model_chunk_size = 1 << 20;
  std::string server_uri = "127.0.0.1:50051";
  int64_t max_message_size = 0;  // 0 = chunk size + headroom
  bool use_ssl = false;
  std::string server_cert, server_key, root_cert;  // PEM files
  std::string auth_token;          // one token for every client (a shared secret)
  std::string client_tokens_file;  // a token per client id (comm/client_tokens.h)
  int round_timeout_s = 600;
  // Each phase has its own deadline, so a client stalled in one cannot use up
  // the time of the clients in the next (0 = round_timeout_s).
  int broadcast_timeout_s = 0;
  int upload_timeout_s = 0;
  // Times a round is played again when it could not complete; one more
  // and the run stops, so no client can keep a round repeating.
  int max_round_retries = 3;
  int broadcast_deadline_s() const { return broadcast_timeout_s > 0 ? broadcast_timeout_s : round_timeout_s; }
  int upload_deadline_s() const { return upload_timeout_s > 0 ? upload_timeout_s : round_timeout_s; }
  int connect_timeout_s = 30;
  // The largest sample count an update may be weighted by (comm/update_check.h).
  double max_num_samples = 1e12;
  // Where a model's chunks travel over gRPC: "grpc" (inside the stream),
  // "tcp" (a connection beside it, comm/grpc/data_channel.h), or "auto" (tcp
  // without TLS; with TLS, only the Unix socket for clients on the host).
  std::string data_channel = "auto";
  int data_channel_port = 0;      // 0: any free port (told to clients at Register)
  bool data_channel_unix = true;  // clients on the server's host: a Unix-domain socket
  int clients_per_rank = 1;
  bool mpi_shared_memory = true;  // MPI on one node: chunks through a shared-memory ring
  int parallel_clients = 1;       // in-process worker replicas (K); -1 = as many as memory_budget allows
  std::string memory_budget = "80%";
  std::string client_selection = "random";  // see `memfl list-methods`
  int power_of_choice_d = 0;
  double exploration = 0.2;
  double fairness_penalty = 1.0;          // MPI: virtual clients a client rank runs one after another
  std::string memory_mode = "streaming";  // streaming | naive
  // FedAvg accumulator for 16-bit models: f32 (a running sum, 2× a bf16
  // model), model_dtype (a running mean in the model's bytes, 1×), or auto.
  std::string accumulator = "auto";
  // Checkpoint policy (server/server_state.h): how many committed model
  // checkpoints stay on disk, and which rounds commit (every K-th and the
  // last; only the last with checkpoint_final_only).
  int checkpoint_keep = 2;
  int checkpoint_every = 1;
  bool checkpoint_final_only = false;
  // Client-level DP-FedAvg (aggregator_kwargs.dp_fedavg_*): clip norm C of
  // each client's update (0 = off), server noise multiplier σ, δ for ε.
  double dp_fedavg_clip_norm = 0;
  double dp_fedavg_noise_multiplier = 1.0;
  double dp_fedavg_delta = 1e-5;
  bool do_server_eval = true;
  int eval_batch_size = 64;
};

// APPFL's client_configs.comm_configs.compressor_configs, as APPFL writes
// them (compress/settings.h says what each does here), plus error_feedback.
struct CompressorConfig {
  bool enable_compression = false;
  // ZFPCompressor (libzfp); SZ2Compressor, SZ3Compressor, SZxCompressor run
  // memfl's own error-bounded quantiser (Debian has no SZ); none: lossless only.
  std::string lossy_compressor = "ZFPCompressor";
  std::string lossless_compressor = "zstd";  // zstd | gzip | zlib | lzma | blosc | none
  std::string error_bounding_mode = "REL";   // ABS: the bound; REL: bound × each tensor's value range
  double error_bound = 1e-3;
  int64_t param_cutoff = 1024;  // tensors with at most this many elements (and non-weights) go lossless
  bool error_feedback = false;  // the client adds what compression lost to its next update
  // A memfl addition: none (the global model leaves as its bytes) or lossy
  // (the change since the model a client received the round before, through
  // the lossy codec at the same bound; server and clients keep the rebuilt
  // model, so all hold the same bits — compress/broadcast_delta.h).
  std::string broadcast_compression = "none";
};

// Flower's SecAggPlusWorkflow settings, under
// server_configs.secure_aggregation (secagg/secagg.h says what each does).
struct SecAggConfig {
  bool enable = false;
  // Neighbours each client secret-shares with (itself included): at most 1
  // a proportion of the round's selected clients, above 1 a count (made odd
  // so the ring of neighbours is symmetric). 1 = every client: SecAgg.
  double num_shares = 1.0;
  // Shares needed to reconstruct a secret: at most 1 a proportion of
  // num_shares, above 1 a count.
  double reconstruction_threshold = 0.67;
  double max_weight = 1000;                  // a client's weight is min(sample count, this) / this
  double clipping_range = 8.0;               // each weighted element is clipped to ±this before quantisation
  int64_t quantization_range = 1 << 22;      // quantised values lie in [0, this)
  int64_t modulus_range = int64_t{1} << 32;  // masked sums are taken mod this (a power of two ≤ 2^32)
  double timeout = 0;  // seconds the server waits for a client's reply to a stage (0: the upload's deadline)
};

struct MemoryConfig {
  int sample_interval_ms = 5;
  bool profile = false;                  // allocation tracker (also --profile)
  int64_t profile_threshold = 64 << 10;  // allocations at or above this get a stack
  // Where model-sized arenas live: anonymous memory, or files (mmap'd; the
  // kernel pages them) so a model larger than free RAM can pass through.
  std::string arena_backing = "memory";  // memory | file
  std::string scratch_dir;               // file backing: empty = the role's run directory
};

struct SecAggParams;  // secagg/secagg.h
// The protocol's parameters as the config gives them (resolved per round
// against the clients selected: SecAggSettings::resolve).
SecAggParams secagg_params(const SecAggConfig& a);

struct ExperimentConfig {
  TrainConfig train;
  ModelConfig model;
  DataConfig data;
  ServerConfig server;
  MemoryConfig memory;
  CompressorConfig compressor;
  SecAggConfig secagg;
  std::string source;         // file name (or "embedded default")
  std::string resolved_yaml;  // every key with its effective value
  // Not a key: client processes on this host that each hold a model-sized
  // arena, set by the role that knows (`memfl launch` through `memfl server
  // --colocated-clients`, rank 0 of `memfl mpi` from the ranks on its node).
  // The accumulator's `auto` leaves room for them in the memory budget.
  int colocated_model_copies = 0;
  // Seconds the server waits for a client's reply to a secure-aggregation
  // stage: secure_aggregation.timeout, or the upload's deadline when 0.
  int secagg_deadline_s() const {
    return secagg.timeout > 0 ? static_cast<int>(std::ceil(secagg.timeout)) : server.upload_deadline_s();
  }
};

// Loads YAML text (named `source` in messages), applies `overrides`
// ("a.b.c=value", as given to --set) and validates.
StatusOr<ExperimentConfig> load_config_text(const std::string& yaml_text, const std::string& source,
                                            const std::vector<std::string>& overrides = {});
StatusOr<ExperimentConfig> load_config_file(const std::string& path, const std::vector<std::string>& overrides = {});

// Model names the trainer plugin knows (checked against the plugin in tests).
const std::vector<std::string>& known_model_names();

// One line per schema key: "path (type, default): doc" — for `memfl config-keys`.
std::string describe_config_keys();

// The first schema key whose value differs between two resolved configs
// (ExperimentConfig::resolved_yaml), as "key: A here, B there"; empty when
// they are the same experiment. MPI ranks check that they agree.
std::string first_config_difference(const std::string& resolved_here, const std::string& resolved_there);

// --resume: whether `key` may differ between the run being resumed and the
// config it is resumed with (its length, timeouts, addresses, profiling).
bool may_change_on_resume(std::string_view key);
// --resume: refuses a config that differs from the run's committed one
// (`committed_resolved`, read from `committed_path`) in any other key, naming
// each; warns for the keys that may change. Called before anything is
// written or any port opened.
Status check_resume_config(const std::string& committed_resolved, const std::string& committed_path,
                           const ExperimentConfig& now);

// What makes a run the experiment it is: every key of `cfg` that may not
// change on resume, with its value as YAML text. A run's committed state
// carries it, so a state/ of another run (another seed, another data set)
// is refused on resume even beside this run's config.yaml.
std::map<std::string, std::string> experiment_identity(const ExperimentConfig& cfg);

// `train_configs.dummy_delay_s` as numbers (an error names the key).
StatusOr<std::vector<double>> parse_delays(const std::string& text);

}  // namespace memfl
