// Files a user names that are not what they should be (a FIFO, a directory,
// /dev/zero, a file too large for what it is): refused with a message that
// says what the path is, never waited on or read without end.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "cli_util.h"
#include "comm/client_tokens.h"
#include "config/config.h"
#include "data/dataset.h"
#include "default_config.h"
#include "io/input_file.h"
#include "io/run_dir.h"
#include "server/server_state.h"
#include "test_util.h"

namespace memfl {
namespace {

using testing::TempDir;

std::string make_fifo(const TempDir& tmp, const std::string& name) {
  const std::string p = tmp.file(name);
  EXPECT_EQ(mkfifo(p.c_str(), 0600), 0);
  return p;
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

TEST(InputFiles, AConfigThatIsAFifoIsRefusedWithoutWaitingForAWriter) {
  TempDir tmp;
  const std::string fifo = make_fifo(tmp, "config.yaml");
  const std::string msg = refusal_of([&] { return load_config_file(fifo).status(); });
  EXPECT_HAS(msg, "FIFO");
  EXPECT_HAS(msg, fifo);
  EXPECT_HAS(msg, "config file");
}

TEST(InputFiles, TheCliRefusesAFifoAsConfigAndSaysWhatItIs) {
  TempDir tmp;
  const std::string fifo = make_fifo(tmp, "config.yaml");
  // timeout: a CLI that waits on the FIFO exits 124 here instead of hanging.
  const Result r = run_shell("timeout 60 " + std::string(MEMFL_BINARY) + " validate " + fifo);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "memfl validate waited on the FIFO: " << r.output;
  EXPECT_HAS(r.output, "FIFO");
}

TEST(InputFiles, DevZeroAsConfigIsRefusedAsACharacterDevice) {
  const std::string msg = refusal_of([] { return load_config_file("/dev/zero").status(); });
  EXPECT_HAS(msg, "character device");
  EXPECT_HAS(msg, "/dev/zero");
}

TEST(InputFiles, ADirectoryAsConfigIsRefusedInsteadOfRunningTheDefault) {
  TempDir tmp;
  auto c = load_config_file(tmp.path.string());
  ASSERT_FALSE(c.ok()) << "a directory loaded as the default experiment";
  EXPECT_HAS(c.status().message(), "directory");
}

TEST(InputFiles, AConfigLargerThanAConfigCanBeIsRefusedBeforeItIsRead) {
  TempDir tmp;
  const std::string big = tmp.file("big.yaml");
  {
    std::ofstream out(big);
    out << "server_configs:\n  num_clients: 3\n";
  }
  std::filesystem::resize_file(big, 64 << 20);  // sparse: costs no disk
  auto c = load_config_file(big);
  ASSERT_FALSE(c.ok());
  EXPECT_HAS(c.status().message(), "64.0 MiB");
  EXPECT_HAS(c.status().message(), "4.0 MiB");
}

TEST(InputFiles, AnIdxFileThatIsAFifoIsRefusedNamingTheKey) {
  TempDir tmp;
  const std::string fifo = make_fifo(tmp, "train-images-idx3-ubyte");
  std::vector<int64_t> dims;
  const std::string msg = refusal_of([&] { return read_idx_file(fifo, 3, &dims).status(); });
  EXPECT_HAS(msg, "FIFO");
  EXPECT_HAS(msg, "client_configs.data_configs.dataset_path");
}

TEST(InputFiles, AFashionMnistDirectoryHoldingAFifoNamesTheFifoNotAMissingFile) {
  TempDir tmp;
  make_fifo(tmp, "train-images-idx3-ubyte");
  make_fifo(tmp, "train-labels-idx1-ubyte");
  const std::string msg = refusal_of([&] { return load_fashion_mnist(tmp.path.string(), 0, 0).status(); });
  EXPECT_HAS(msg, "FIFO");
}

TEST(InputFiles, ADataDirectoryThatIsAFifoOrAFileIsNotCalledMissing) {
  TempDir tmp;
  const std::string fifo = make_fifo(tmp, "data");
  auto a = load_fashion_mnist(fifo, 0, 0);
  ASSERT_FALSE(a.ok());
  EXPECT_HAS(a.status().message(), "FIFO");
  EXPECT_EQ(a.status().message().find("does not exist"), std::string::npos) << a.status().message();
  const std::string file = tmp.file("plain");
  std::ofstream(file) << "x";
  auto b = load_fashion_mnist(file, 0, 0);
  ASSERT_FALSE(b.ok());
  EXPECT_HAS(b.status().message(), "regular file, not a directory");
  auto c = load_fashion_mnist(tmp.file("absent"), 0, 0);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_HAS(c.status().message(), "does not exist");
}

TEST(InputFiles, ATextFileThatIsAFifoOrADirectoryIsRefusedNamingTheKey) {
  TempDir tmp;
  const std::string fifo = make_fifo(tmp, "corpus.txt");
  std::string msg = refusal_of([&] { return load_text_tokens(fifo, 16).status(); });
  EXPECT_HAS(msg, "FIFO");
  EXPECT_HAS(msg, "client_configs.data_configs.dataset_path");
  msg = refusal_of([&] { return load_text_tokens(tmp.path.string(), 16).status(); });
  EXPECT_HAS(msg, "a directory");
  EXPECT_HAS(msg, "client_configs.data_configs.dataset_path");
}

TEST(InputFiles, ATorchScriptPathThatIsAFifoIsRefusedByTheConfig) {
  TempDir tmp;
  const std::string fifo = make_fifo(tmp, "model.pt");
  auto c = load_config_text(
      kDefaultConfigYaml, "exp.yaml",
      {"client_configs.model_configs.model_name=TorchScript", "client_configs.model_configs.torchscript_path=" + fifo});
  ASSERT_FALSE(c.ok());
  EXPECT_HAS(c.status().message(), "client_configs.model_configs.torchscript_path");
  EXPECT_HAS(c.status().message(), "FIFO");
  // A path that is not on this machine (a server checking its clients'
  // config) is left to the process that loads it.
  auto d = load_config_text(kDefaultConfigYaml, "exp.yaml",
                            {"client_configs.model_configs.model_name=TorchScript",
                             "client_configs.model_configs.torchscript_path=" + tmp.file("absent.pt")});
  EXPECT_TRUE(d.ok()) << d.status().to_string();
}

TEST(InputFiles, ARegularFileIsReadWholeAndAnEmptyPathIsRefused) {
  TempDir tmp;
  const std::string p = tmp.file("a.txt");
  std::string text(10000, 'q');
  std::ofstream(p) << text;
  auto r = read_input_file(p, "test", 1 << 20);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, text);
  EXPECT_FALSE(read_input_file(p, "test", 9999).ok());
  EXPECT_FALSE(read_input_file("", "test", 1 << 20).ok());
}

// A synthetic model trained by DummyTrainer: `memfl run` without libtorch.
std::string write_run_config(const TempDir& tmp) {
  const std::string path = tmp.file("run.yaml");
  std::ofstream(path) << "client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: 0.001\n"
                         "  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: 1001\n"
                         "server_configs:\n  num_clients: 2\n  num_global_epochs: 2\n";
  return path;
}

TEST(RunDirLock, ASecondHolderIsRefusedNamingThePidUntilTheFirstLetsGo) {
  TempDir tmp;
  {
    auto first = RunDirLock::acquire(tmp.path.string());
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    auto second = RunDirLock::acquire(tmp.path.string());
    ASSERT_FALSE(second.ok());
    EXPECT_HAS(second.status().message(), "in use by process " + std::to_string(getpid()));
  }
  EXPECT_TRUE(RunDirLock::acquire(tmp.path.string()).ok()) << "released with its holder";
}

TEST(Resume, ASecondProcessOnARunDirectoryIsRefusedNamingTheHolder) {
  TempDir tmp;
  const std::string cfg = write_run_config(tmp);
  Result first = memfl_cli("run " + cfg + " -q --out " + tmp.file("r"));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string metrics = testing::read_file(tmp.file("r/metrics.csv"));
  auto held = RunDirLock::acquire(tmp.file("r"));  // as a running resume would
  ASSERT_TRUE(held.ok()) << held.status().to_string();
  Result second = memfl_cli("run -q --resume " + tmp.file("r") + " --set server_configs.num_global_epochs=3");
  EXPECT_NE(second.exit_code, 0) << second.output;
  EXPECT_HAS(second.output, "in use by process " + std::to_string(getpid()));
  EXPECT_EQ(testing::read_file(tmp.file("r/metrics.csv")), metrics) << "the refused process wrote to the run";
}

TEST(Resume, AStateDirectoryOfAnotherRunIsRefusedNamingTheKey) {
  TempDir tmp;
  const std::string cfg = write_run_config(tmp);
  ASSERT_EQ(memfl_cli("run " + cfg + " -q --out " + tmp.file("a")).exit_code, 0);
  Result b = memfl_cli("run " + cfg + " -q --set server_configs.seed=7 --out " + tmp.file("b"));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  // b's config.yaml with a's committed state: the same layout, another seed.
  std::filesystem::remove_all(tmp.file("b/state"));
  std::filesystem::copy(tmp.file("a/state"), tmp.file("b/state"), std::filesystem::copy_options::recursive);
  Result resumed = memfl_cli("run -q --resume " + tmp.file("b") + " --set server_configs.num_global_epochs=3");
  EXPECT_NE(resumed.exit_code, 0) << resumed.output;
  EXPECT_HAS(resumed.output, "another experiment");
  EXPECT_HAS(resumed.output, "server_configs.seed");
  // Its own state resumes.
  Result own = memfl_cli("run -q --resume " + tmp.file("a") + " --set server_configs.num_global_epochs=3");
  EXPECT_EQ(own.exit_code, 0) << own.output;
}

// Keep 2 commits, 1000-byte model: the peak is 3 files. Resumed, the 3
// are on disk (two commits and the restored global model, no longer a
// link of either), and the next round's checkpoint is a fourth file.
TEST(Resume, TheNextCheckpointNeedsAWholeModelFreeEvenWithThePeakOnDisk) {
  TempDir tmp;
  EXPECT_FALSE(check_checkpoint_disk(tmp.path.string(), {2, 1, false}, 1000, 3000, 999).ok());
  EXPECT_TRUE(check_checkpoint_disk(tmp.path.string(), {2, 1, false}, 1000, 3000, 1000).ok());
}

// REL bounds the error by error_bound x the tensor's range; from 0.5 up the
// range's midpoint alone meets it, so nothing of a change need survive.
TEST(SilentSettings, ARelativeErrorBoundThatKeepsNothingIsRefused) {
  const std::vector<std::string> lossy = {
      "client_configs.comm_configs.compressor_configs.enable_compression=true",
      "client_configs.comm_configs.compressor_configs.lossy_compressor=SZ2Compressor",
      "client_configs.comm_configs.compressor_configs.error_bounding_mode=REL"};
  for (const char* bound : {"0.5", "5"}) {
    auto sets = lossy;
    sets.push_back(std::string("client_configs.comm_configs.compressor_configs.error_bound=") + bound);
    auto c = load_config_text(kDefaultConfigYaml, "exp.yaml", sets);
    ASSERT_FALSE(c.ok()) << "REL bound " << bound << " accepted";
    EXPECT_HAS(c.status().message(), "client_configs.comm_configs.compressor_configs.error_bound");
  }
  auto sets = lossy;
  sets.push_back("client_configs.comm_configs.compressor_configs.error_bound=0.1");
  EXPECT_TRUE(load_config_text(kDefaultConfigYaml, "exp.yaml", sets).ok());
  // ABS 5 is a bound in the values' own units: it may be what the user means.
  EXPECT_TRUE(
      load_config_text(kDefaultConfigYaml, "exp.yaml",
                       {lossy[0], lossy[1], "client_configs.comm_configs.compressor_configs.error_bounding_mode=ABS",
                        "client_configs.comm_configs.compressor_configs.error_bound=5"})
          .ok());
}

}  // namespace
}  // namespace memfl

namespace memfl {
namespace {

// Only the spelling memfl's clients send names an id: the aliases of 1 that
// std::stoi accepts are refused, so one client has one name.
TEST(ClientIds, OnlyPlainDecimalIdsParse) {
  EXPECT_EQ(parse_client_id("0", 3), 0);
  EXPECT_EQ(parse_client_id("1", 3), 1);
  EXPECT_EQ(parse_client_id("2", 3), 2);
  EXPECT_EQ(parse_client_id("12", 13), 12);
  for (const char* alias : {"01", "+1", " 1", "1 ", "1\n", "0x1", "1.0", "-0", "", "3", "99999999999", "1e0"}) {
    EXPECT_FALSE(parse_client_id(alias, 3).has_value()) << "'" << alias << "'";
  }
}

TEST(ClientTokens, EachIdHasItsOwnTokenAndOthersDoNotMatch) {
  testing::TempDir tmp;
  const std::string path = tmp.file("tokens");
  std::ofstream(path) << "# tokens\n\n2 cccccccccccccccc\n0   aaaaaaaaaaaaaaaa  # zero\n";
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  std::vector<std::string> warnings;
  auto t = load_client_tokens(path, kClientTokensFileKey, 3, &warnings);
  ASSERT_TRUE(t.ok()) << t.status().message();
  EXPECT_TRUE(warnings.empty());
  EXPECT_TRUE(t->matches(0, "aaaaaaaaaaaaaaaa"));
  EXPECT_TRUE(t->matches(2, "cccccccccccccccc"));
  EXPECT_FALSE(t->matches(0, "cccccccccccccccc")) << "client 2's token is not client 0's";
  EXPECT_FALSE(t->matches(2, "aaaaaaaaaaaaaaaa"));
  EXPECT_FALSE(t->matches(1, "")) << "an id without a line has no token, not an empty one";
  EXPECT_FALSE(t->matches(0, "aaaaaaaaaaaaaaa")) << "a prefix is not the token";
  EXPECT_EQ(t->missing(), std::vector<int>{1});
  auto own = load_own_client_token(path, kClientTokensFileKey, 2);
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(*own, "cccccccccccccccc");
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  ASSERT_TRUE(load_client_tokens(path, kClientTokensFileKey, 3, &warnings).ok());
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("chmod 600"), std::string::npos) << warnings[0];
}

TEST(ClientTokens, BadFilesAreRefusedNamingTheKeyAndTheLine) {
  testing::TempDir tmp;
  const std::string path = tmp.file("tokens");
  auto refused = [&](const std::string& text, int clients) {
    std::ofstream(path, std::ios::trunc) << text;
    auto t = load_client_tokens(path, kClientTokensFileKey, clients);
    EXPECT_FALSE(t.ok()) << text;
    return t.ok() ? std::string() : std::string(t.status().message());
  };
  std::string m = refused("0 aaaaaaaaaaaaaaaa\n01 bbbbbbbbbbbbbbbb\n", 3);
  EXPECT_NE(m.find("client_tokens_file"), std::string::npos) << m;
  EXPECT_NE(m.find("line 2"), std::string::npos) << m;
  m = refused("0 aaaaaaaaaaaaaaaa\n0 bbbbbbbbbbbbbbbb\n", 3);
  EXPECT_NE(m.find("line 2: client 0 already has a token (line 1)"), std::string::npos) << m;
  m = refused("0 short\n", 3);
  EXPECT_NE(m.find("at least 16"), std::string::npos) << m;
  m = refused("3 aaaaaaaaaaaaaaaa\n", 3);
  EXPECT_NE(m.find("0..2"), std::string::npos) << m;
  m = refused("0 aaaaaaaaaaaaaaaa extra\n", 3);
  EXPECT_NE(m.find("found 3 field(s)"), std::string::npos) << m;
  m = refused("# nothing\n", 3);
  EXPECT_NE(m.find("gives no client a token"), std::string::npos) << m;
  EXPECT_FALSE(load_client_tokens(tmp.path.string(), kClientTokensFileKey, 3).ok())
      << "a directory is not a tokens file";
}

TEST(ClientTokens, ComparisonIsExactAndPeerTextIsEscaped) {
  EXPECT_TRUE(tokens_equal("abcdefgh", "abcdefgh"));
  EXPECT_FALSE(tokens_equal("abcdefgh", "abcdefgx"));
  EXPECT_FALSE(tokens_equal("abcdefgh", "abcdefg"));
  EXPECT_EQ(printable_peer_text("a\nb\\"), "a\\x0ab\\x5c");
  EXPECT_EQ(printable_peer_text(std::string(100, 'x')).size(), 64u + std::string("... (100 bytes)").size());
}

}  // namespace
}  // namespace memfl
