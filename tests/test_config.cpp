#include <gtest/gtest.h>

#include <fstream>

#include "config/config.h"
#include "default_config.h"
#include "test_util.h"

namespace memfl {
namespace {

std::string error_of(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  auto c = load_config_text(yaml, "exp.yaml", sets);
  EXPECT_FALSE(c.ok()) << yaml;
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  return c.status().message();
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

TEST(Config, EmbeddedDefaultIsTheShippedFileAndValid) {
  auto c = load_config_text(kDefaultConfigYaml, kDefaultConfigName);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->server.num_clients, 10);
  EXPECT_EQ(c->model.model_name, "CNN");
  EXPECT_EQ(c->data.dataset_name, "FashionMNIST");
  EXPECT_EQ(c->server.aggregator, "FedAvgAggregator");
  EXPECT_DOUBLE_EQ(c->train.optim.lr, 0.05);
  std::ifstream in(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/configs/fedavg_fmnist_cnn.yaml");
  std::string file((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(file, kDefaultConfigYaml);
}

// The shipped server-optimizer examples load, and say what their names
// and comments promise (APPFL's example values).
TEST(Config, TheServerOptimizerExamplesLoadWithAppflsValues) {
  struct Example {
    const char* file;
    const char* aggregator;
    double lr;
  };
  for (const Example& e : {Example{"fedavgm_fmnist_cnn.yaml", "FedAvgMAggregator", 1.0},
                           Example{"fedadam_fmnist_cnn.yaml", "FedAdamAggregator", 0.1},
                           Example{"fedyogi_fmnist_cnn.yaml", "FedYogiAggregator", 0.1},
                           Example{"fedadagrad_fmnist_cnn.yaml", "FedAdagradAggregator", 0.01}}) {
    auto c = load_config_file(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/configs/" + e.file);
    ASSERT_TRUE(c.ok()) << e.file << ": " << c.status().to_string();
    EXPECT_EQ(c->server.aggregator, e.aggregator);
    EXPECT_DOUBLE_EQ(c->server.server_learning_rate, e.lr) << e.file;
    EXPECT_DOUBLE_EQ(c->server.server_momentum_param_1, 0.9) << e.file;
    EXPECT_DOUBLE_EQ(c->server.server_adapt_param, 1e-3) << e.file;
  }
}

// The asynchronous examples load with their scheduler, rule and keys.
TEST(Config, TheAsynchronousExamplesLoad) {
  struct Example {
    const char* file;
    const char* scheduler;
    const char* aggregator;
  };
  for (const Example& e : {Example{"fedasync_fmnist_cnn.yaml", "AsyncScheduler", "FedAsyncAggregator"},
                           Example{"fedbuff_fmnist_cnn.yaml", "AsyncScheduler", "FedBuffAggregator"},
                           Example{"fedcompass_fmnist_cnn.yaml", "CompassScheduler", "FedCompassAggregator"}}) {
    auto c = load_config_file(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/configs/" + e.file);
    ASSERT_TRUE(c.ok()) << e.file << ": " << c.status().to_string();
    EXPECT_EQ(c->server.scheduler, e.scheduler) << e.file;
    EXPECT_EQ(c->server.aggregator, e.aggregator) << e.file;
    EXPECT_EQ(c->server.staleness_fn, "polynomial") << e.file;
    EXPECT_EQ(c->data.partition_strategy, "dirichlet") << e.file;
    EXPECT_EQ(c->server.client_speed_distribution, "lognormal") << e.file;
  }
}

TEST(Config, TheFedProxExampleLoadsWithItsMu) {
  auto c = load_config_file(std::string(MEMFL_SOURCE_DIR_FOR_TESTS) + "/configs/fedprox_fmnist_cnn.yaml");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->train.mu, 0.01);
  EXPECT_EQ(c->data.partition_strategy, "dirichlet");
}

// An APPFL key that names Python code is refused with what to use instead.
TEST(Config, AppflPythonPathKeysAreRefusedWithWhatToUseInstead) {
  auto c =
      load_config_text("client_configs:\n  model_configs:\n    model_path: ./resources/model/cnn.py\n", "appfl.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("model_path"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("model_name"), std::string::npos) << c.status().message();
  auto l = load_config_text("", "x.yaml", {"client_configs.train_configs.loss_fn_path=./loss.py"});
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("loss_fn_name"), std::string::npos) << l.status().message();
}

// The TCP data channel carries the model in the clear: with TLS asked for,
// the config is refused, naming both keys and what to set instead.
// APPFL writes its compressor block in the client's config, with Python's
// booleans and exponent floats: it loads as written.
TEST(Config, AppflsCompressorBlockLoadsAsWritten) {
  auto c = load_config_text(
      "client_configs:\n  comm_configs:\n    compressor_configs:\n      enable_compression: True\n"
      "      lossy_compressor: SZ2Compressor\n      lossless_compressor: blosc\n      error_bounding_mode: REL\n"
      "      error_bound: 1e-3\n      param_cutoff: 1024\n",
      "exp.yaml");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->compressor.enable_compression);
  EXPECT_EQ(c->compressor.lossy_compressor, "SZ2Compressor");
  EXPECT_EQ(c->compressor.lossless_compressor, "blosc");
  EXPECT_EQ(c->compressor.error_bounding_mode, "REL");
  EXPECT_DOUBLE_EQ(c->compressor.error_bound, 1e-3);
  EXPECT_EQ(c->compressor.param_cutoff, 1024);
  EXPECT_FALSE(c->compressor.error_feedback);
  EXPECT_EQ(c->compressor.broadcast_compression, "none");
  // An unknown codec name is refused naming the key and the choices.
  const std::string e = error_of("", {"client_configs.comm_configs.compressor_configs.lossy_compressor=SZ4"});
  EXPECT_HAS(e, "lossy_compressor");
  EXPECT_HAS(e, "ZFPCompressor");
  // A misspelt key inside the block is named with a suggestion.
  EXPECT_HAS(error_of("client_configs:\n  comm_configs:\n    compressor_configs:\n      error_bund: 1\n"),
             "did you mean 'client_configs.comm_configs.compressor_configs.error_bound'");
}

TEST(Config, CompressionThatCannotHoldItsPromiseIsRefusedNamingTheKeys) {
  const std::string k = "client_configs.comm_configs.compressor_configs.";
  const std::vector<std::string> on = {k + "enable_compression=true"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), on.begin(), on.end());
    return more;
  };
  EXPECT_HAS(error_of("", with({k + "lossy_compressor=none", k + "error_feedback=true"})),
             "error_feedback: true' needs a lossy_compressor");
  EXPECT_HAS(error_of("", with({"server_configs.aggregator_kwargs.dp_fedavg_clip_norm=1"})), "dp_fedavg_clip_norm");
  EXPECT_HAS(
      error_of("", with({"server_configs.scheduler=AsyncScheduler", "server_configs.aggregator=FedAsyncAggregator"})),
      "gradient_based: true");
  EXPECT_HAS(error_of("", with({"server_configs.memory_mode=naive"})), "memory_mode: naive");
  // A lossy broadcast needs compression on, a lossy codec, and one model
  // every client held the round before.
  EXPECT_HAS(error_of("", {k + "broadcast_compression=lossy"}),
             "broadcast_compression: lossy' needs " + k + "enable_compression: true");
  EXPECT_HAS(error_of("", with({k + "lossy_compressor=none", k + "broadcast_compression=lossy"})),
             "broadcast_compression: lossy' needs a lossy_compressor");
  EXPECT_HAS(error_of("", with({k + "broadcast_compression=lossy", "server_configs.scheduler=AsyncScheduler",
                                "server_configs.aggregator=FedAsyncAggregator",
                                "server_configs.aggregator_kwargs.gradient_based=true"})),
             "broadcast_compression: lossy' needs a synchronous aggregator");
  EXPECT_HAS(error_of("", with({k + "broadcast_compression=zstd"})), "broadcast_compression");
  // What they ask for instead loads.
  EXPECT_TRUE(
      load_config_text("", "exp.yaml",
                       with({"server_configs.scheduler=AsyncScheduler", "server_configs.aggregator=FedAsyncAggregator",
                             "server_configs.aggregator_kwargs.gradient_based=true"}))
          .ok());
  EXPECT_TRUE(
      load_config_text("", "exp.yaml",
                       with({"server_configs.aggregator_kwargs.dp_fedavg_clip_norm=1", k + "lossy_compressor=none"}))
          .ok());
  auto lossy_broadcast = load_config_text("", "exp.yaml", with({k + "broadcast_compression=lossy"}));
  ASSERT_TRUE(lossy_broadcast.ok()) << lossy_broadcast.status().message();
  EXPECT_EQ(lossy_broadcast->compressor.broadcast_compression, "lossy");
}

// Values to draw the DummyTrainer's noise from mean nothing without its σ.
TEST(Config, NoiseValuesWithoutNoiseAreRefusedNamingBothKeys) {
  const std::string t = "client_configs.train_configs.";
  const std::string e = error_of("", {t + "dummy_update_noise_values=/tmp/update.f32"});
  EXPECT_HAS(e, t + "dummy_update_noise_values");
  EXPECT_HAS(e, t + "dummy_update_noise' is 0");
  EXPECT_TRUE(
      load_config_text("", "exp.yaml", {t + "dummy_update_noise_values=/tmp/update.f32", t + "dummy_update_noise=2"})
          .ok());
}

TEST(Config, Float32OptimizerStateIsForAdamAndNamesBothKeys) {
  const std::string t = "client_configs.train_configs.";
  const std::string e = error_of("", {t + "optim=SGD", t + "optimizer_state_dtype=float32"});
  EXPECT_HAS(e, t + "optimizer_state_dtype: float32");
  EXPECT_HAS(e, t + "optim is SGD");
  auto adam = load_config_text("", "exp.yaml", {t + "optim=Adam", t + "optimizer_state_dtype=float32"});
  ASSERT_TRUE(adam.ok()) << adam.status().message();
  EXPECT_EQ(adam->train.optim.state_dtype, "float32");
  EXPECT_HAS(error_of("", {t + "optimizer_state_dtype=fp8"}), "must be one of [param, float32]");
}

TEST(Config, TheTcpDataChannelWithTlsIsRefusedNamingBothKeys) {
  const std::string tls =
      "server_configs:\n  comm_configs:\n    grpc_configs:\n      use_ssl: true\n      server_cert: s.pem\n"
      "      server_key: k.pem\n      root_cert: r.pem\n";
  const std::string e = error_of(tls, {"server_configs.comm_configs.grpc_configs.data_channel=tcp"});
  EXPECT_HAS(e, "data_channel: tcp");
  EXPECT_HAS(e, "use_ssl");
  EXPECT_HAS(e, "data_channel: grpc");
  EXPECT_TRUE(load_config_text(tls, "exp.yaml").ok()) << "TLS alone is fine";
  auto plain = load_config_text("", "exp.yaml", {"server_configs.comm_configs.grpc_configs.data_channel=tcp"});
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(plain->server.data_channel, "tcp");
  EXPECT_HAS(error_of("", {"server_configs.comm_configs.grpc_configs.data_channel=udp"}), "data_channel");
}

TEST(Config, EmptyConfigTakesDefaultsAndResolvesEveryKey) {
  auto c = load_config_text("", "empty.yaml");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->train.mode, "epoch");
  EXPECT_HAS(c->resolved_yaml, "num_global_epochs: 5");
  EXPECT_HAS(c->resolved_yaml, "client_weights_mode: equal");
  // The resolved config loads again to the same values.
  auto again = load_config_text(c->resolved_yaml, "resolved.yaml");
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->resolved_yaml, c->resolved_yaml);
}

TEST(Config, UnknownKeyNamesKeyFileLineAndSuggestion) {
  std::string e = error_of("server_configs:\n  num_clinets: 4\n");
  EXPECT_HAS(e, "exp.yaml:2");
  EXPECT_HAS(e, "unknown key 'server_configs.num_clinets'");
  EXPECT_HAS(e, "did you mean 'server_configs.num_clients'");
  // A key put in the wrong section is pointed to its place.
  e = error_of("server_configs:\n  optim: Adam\n");
  EXPECT_HAS(e, "did you mean 'client_configs.train_configs.optim'");
  EXPECT_HAS(error_of("bogus: 1\n"), "unknown key 'bogus'");
}

TEST(Config, WrongTypesAndValuesNameTheKey) {
  EXPECT_HAS(error_of("server_configs:\n  num_clients: ten\n"), "key 'server_configs.num_clients' must be a integer");
  EXPECT_HAS(error_of("server_configs:\n  num_clients: 2.5\n"), "server_configs.num_clients");
  EXPECT_HAS(error_of("server_configs:\n  num_clients: 0\n"), "must lie in [1,");
  EXPECT_HAS(error_of("client_configs:\n  train_configs:\n    optim: RMSprop\n"), "must be one of [SGD, Adam]");
  EXPECT_HAS(error_of("client_configs:\n  train_configs:\n    mode: epochs\n"), "client_configs.train_configs.mode");
  EXPECT_HAS(error_of("client_configs:\n  model_configs:\n    model_name: VGG\n"),
             "one of [CNN, MLP, ResNet18, CNN_GN, synthetic, llama-tiny");
  EXPECT_HAS(error_of("client_configs:\n  train_configs:\n    do_validation: maybe\n"), "must be a boolean");
  EXPECT_HAS(error_of("client_configs:\n  train_configs:\n    optim_args:\n      betas: [0.9]\n"), "list of 2");
  EXPECT_HAS(error_of("server_configs: 3\n"), "must be a mapping");
  EXPECT_HAS(error_of("server_configs:\n  num_clients: 4\n  clients_per_round: 5\n"),
             "'server_configs.clients_per_round' (5) exceeds server_configs.num_clients (4)");
  EXPECT_HAS(error_of("server_configs: [1, 2\n"), "exp.yaml:");
}

TEST(Config, SetOverridesWinAndAreChecked) {
  auto c = load_config_text("server_configs:\n  num_clients: 4\n", "exp.yaml",
                            {"server_configs.num_clients=7", "client_configs.train_configs.optim_args.lr=0.2",
                             "client_configs.train_configs.optim_args.betas=[0.8, 0.99]"});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->server.num_clients, 7);
  EXPECT_DOUBLE_EQ(c->train.optim.lr, 0.2);
  EXPECT_DOUBLE_EQ(c->train.optim.beta1, 0.8);
  EXPECT_HAS(error_of("", {"server_configs.num_client=3"}), "--set: unknown key 'server_configs.num_client'");
  EXPECT_HAS(error_of("", {"server_configs.num_clients"}), "expected key.path=value");
  std::string e = error_of("", {"server_configs.num_clients=-1"});
  EXPECT_HAS(e, "--set");
  EXPECT_HAS(e, "server_configs.num_clients");
}

TEST(Config, MissingFileIsNamed) {
  auto c = load_config_file("/nonexistent/exp.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_HAS(c.status().message(), "/nonexistent/exp.yaml");
}

TEST(Config, EveryKeyIsDescribed) {
  const std::string d = describe_config_keys();
  for (const char* k : {"server_configs.aggregator_kwargs.client_weights_mode", "client_configs.train_configs.mode",
                        "server_configs.comm_configs.grpc_configs.model_chunk_size"}) {
    EXPECT_HAS(d, k);
  }
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

TEST(Config, NotANumberIsRefusedWhereverAFloatIs) {
  // `.nan` is a YAML float; each of these once passed and silently broke a
  // run (every weight NaN, DP off, one sample per client).
  for (const char* key : {"dp_fedavg_noise_multiplier", "dp_fedavg_clip_norm"}) {
    const std::string e = error_of(std::string("server_configs:\n  aggregator_kwargs:\n    ") + key + ": .nan\n");
    EXPECT_HAS(e, std::string("server_configs.aggregator_kwargs.") + key);
    EXPECT_HAS(e, "not a number");
  }
  EXPECT_HAS(error_of("client_configs:\n  data_configs:\n    dataset_kwargs:\n      val_ratio: .NaN\n"), "val_ratio");
  EXPECT_HAS(error_of("", {"client_configs.train_configs.optim_args.lr=.nan"}), "optim_args.lr");
  // Finite values inside the range still pass.
  EXPECT_TRUE(
      load_config_text("server_configs:\n  aggregator_kwargs:\n    dp_fedavg_clip_norm: 0.5\n", "ok.yaml").ok());
}

TEST(Config, ARepeatedKeyIsRefusedNamingBothLines) {
  const std::string e = error_of("server_configs:\n  num_clients: 3\n  num_global_epochs: 2\n  num_clients: 7\n");
  EXPECT_HAS(e, "exp.yaml:4");
  EXPECT_HAS(e, "'server_configs.num_clients' appears twice (first at line 2)");
}

TEST(Config, AComplexKeyIsAnErrorNotAnAbort) {
  const std::string e = error_of("server_configs:\n  ? [a, b]\n  : 3\n");
  EXPECT_HAS(e, "must be a plain name, not a list");
  EXPECT_HAS(e, "server_configs");
}

TEST(Config, DummyDelaysMustBeSeconds) {
  EXPECT_HAS(error_of("client_configs:\n  train_configs:\n    dummy_delay_s: \"1.5,x\"\n"), "dummy_delay_s");
  EXPECT_HAS(error_of("client_configs:\n  train_configs:\n    dummy_delay_s: \"1,-2\"\n"), "dummy_delay_s");
  auto ok = load_config_text("client_configs:\n  train_configs:\n    dummy_delay_s: \"1.5,0.25\"\n", "ok.yaml");
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(*parse_delays(ok->train.dummy_delay_s), (std::vector<double>{1.5, 0.25}));
}

}  // namespace
}  // namespace memfl
