// Tokenizers, text and instruction data sets: a SentencePiece model trained
// here by Debian's spm_train on text the test writes, and spm_encode (the
// library's command line, another program) as the oracle for every id.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli_util.h"
#include "config/config.h"
#include "data/experiment_data.h"
#include "data/text_data.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace memfl {
namespace {

using testing::TempDir;

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

#if defined(MEMFL_HAVE_SENTENCEPIECE)

constexpr int kSeq = 15;  // samples of 16 tokens
constexpr int kLen = kSeq + 1;
constexpr int kBos = 1, kEos = 2, kPad = 3;  // as spm_train is told below

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// Lines of words made of syllables, seeded: enough distinct words for a BPE
// vocabulary of 120.
std::vector<std::string> make_lines(size_t n, uint64_t seed) {
  static const char* syl[] = {"ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "di", "fo", "gu"};
  std::mt19937_64 rng(seed);
  std::vector<std::string> lines;
  for (size_t i = 0; i < n; ++i) {
    std::string line;
    const size_t words = 2 + rng() % 9;
    for (size_t w = 0; w < words; ++w) {
      if (w > 0) line += ' ';
      const size_t s = 1 + rng() % 3;
      for (size_t k = 0; k < s; ++k) line += syl[rng() % 14];
    }
    lines.push_back(line);
  }
  return lines;
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

// One tokenizer for the suite: trained once, its vocabulary size read from
// the .vocab file spm_train writes beside it.
struct Spm {
  TempDir dir;
  std::string model;
  int vocab = 0;
  Spm() {
    write_text(dir.file("corpus.txt"), join_lines(make_lines(400, 7)));
    const Result r = run_shell("spm_train --input=" + dir.file("corpus.txt") + " --model_prefix=" + dir.file("tok") +
                               " --vocab_size=120 --model_type=bpe --character_coverage=1.0 --unk_id=0 --bos_id=1 "
                               "--eos_id=2 --pad_id=3");
    EXPECT_EQ(r.exit_code, 0) << "spm_train (Debian's sentencepiece package) failed:\n" << r.output;
    model = dir.file("tok.model");
    std::ifstream v(dir.file("tok.vocab"));
    for (std::string line; std::getline(v, line);) ++vocab;
  }
};

const Spm& spm() {
  static Spm s;
  return s;
}

// spm_encode --output_format=id, one vector per line of `lines`.
std::vector<std::vector<int32_t>> spm_encode(const std::vector<std::string>& lines) {
  TempDir tmp;
  write_text(tmp.file("in.txt"), join_lines(lines));
  const Result r = run_shell("spm_encode --model=" + spm().model + " --output_format=id < " + tmp.file("in.txt") +
                             " > " + tmp.file("out.txt"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::vector<int32_t>> out;
  std::ifstream in(tmp.file("out.txt"));
  for (std::string line; std::getline(in, line);) {
    std::istringstream ss(line);
    std::vector<int32_t> ids;
    for (int32_t id; ss >> id;) ids.push_back(id);
    out.push_back(ids);
  }
  EXPECT_EQ(out.size(), lines.size());
  return out;
}

std::vector<int32_t> spm_encode_one(const std::string& line) { return spm_encode({line}).at(0); }

// A llama experiment on a tokenized data set, as a file.
std::string experiment_yaml(const std::string& dataset, const std::string& path, int vocab, int clients,
                            const std::string& kwargs = "", bool tokenizer = true) {
  return fmt::format(
      "client_configs:\n"
      "  train_configs:\n    trainer: VanillaTrainer\n"
      "  model_configs:\n    model_name: llama\n"
      "    model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 4, num_kv_heads: 2, intermediate_size: 64, "
      "vocab_size: {}, seq_length: {}}}\n"
      "  data_configs:\n    dataset_name: {}\n    dataset_path: {}\n{}"
      "    dataset_kwargs: {{val_ratio: 0{}}}\n"
      "server_configs:\n  num_clients: {}\n",
      vocab, kSeq, dataset, path, tokenizer ? "    tokenizer_path: " + spm().model + "\n" : std::string(), kwargs,
      clients);
}

StatusOr<ExperimentConfig> experiment(const std::string& dataset, const std::string& path, int clients,
                                      const std::string& kwargs = "", int vocab = 0) {
  return load_config_text(experiment_yaml(dataset, path, vocab > 0 ? vocab : spm().vocab, clients, kwargs), "exp.yaml");
}

// [BOS] ids [EOS] of each document, concatenated.
std::vector<int32_t> framed_stream(const std::vector<std::vector<int32_t>>& docs) {
  std::vector<int32_t> s;
  for (const auto& d : docs) {
    s.push_back(kBos);
    s.insert(s.end(), d.begin(), d.end());
    s.push_back(kEos);
  }
  return s;
}

std::vector<int32_t> concat(const ImageDataset& a, const ImageDataset& b) {
  std::vector<int32_t> s = a.tokens;
  s.insert(s.end(), b.tokens.begin(), b.tokens.end());
  return s;
}

TEST(TextData, TheTokenizerIsTheOneSpmTrainWrote) {
  ASSERT_GT(spm().vocab, 50);
  auto tok = Tokenizer::open(spm().model, kTokenizerPathKey);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(tok->vocab_size(), spm().vocab);
  EXPECT_EQ(tok->bos_id(), kBos);
  EXPECT_EQ(tok->eos_id(), kEos);
  EXPECT_EQ(tok->pad_id(), kPad);
}

TEST(TextData, TokenIdsAreWhatSpmEncodePrints) {
  TempDir tmp;
  const auto lines = make_lines(120, 11);  // other text than the tokenizer's
  write_text(tmp.file("corpus.txt"), join_lines(lines));
  auto cfg = experiment("TextFile", tmp.file("corpus.txt"), 2);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  const std::vector<int32_t> stream = framed_stream(spm_encode(lines));
  const size_t n = stream.size() / kLen;
  ASSERT_GE(n, 20u);
  EXPECT_EQ(data->train.size() + data->test.size(), n);
  EXPECT_EQ(data->test.size(), n / 10);
  EXPECT_EQ(data->train.width, kLen);
  EXPECT_EQ(data->train.tokens.size(), data->train.size() * kLen);
  EXPECT_TRUE(data->train.pixels.empty());
  EXPECT_TRUE(data->train.loss_mask.empty()) << "packed text: every target counts";
  EXPECT_EQ(concat(data->train, data->test), std::vector<int32_t>(stream.begin(), stream.begin() + n * kLen));
  EXPECT_EQ(data->train.num_classes, 1);
  EXPECT_TRUE(std::all_of(data->train.labels.begin(), data->train.labels.end(), [](uint8_t l) { return l == 0; }));
}

TEST(TextData, PackedSamplesHaveSeqLengthPlusOneTokensAndEosWhereEachDocumentEnds) {
  TempDir tmp;
  const auto lines = make_lines(60, 13);
  write_text(tmp.file("corpus.txt"), join_lines(lines));
  auto cfg = experiment("TextFile", tmp.file("corpus.txt"), 1);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  // By hand: document k takes 1 + |ids_k| + 1 positions, its EOS the last.
  std::set<size_t> eos_by_hand;
  size_t at = 0;
  for (const auto& ids : spm_encode(lines)) {
    at += ids.size() + 2;
    eos_by_hand.insert(at - 1);
  }
  const size_t n = at / kLen;  // whole samples; the rest is dropped
  const std::vector<int32_t> all = concat(data->train, data->test);
  ASSERT_EQ(all.size(), n * kLen);
  std::set<size_t> eos_seen, kept;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == kEos) eos_seen.insert(i);
  }
  for (size_t p : eos_by_hand) {
    if (p < n * kLen) kept.insert(p);
  }
  EXPECT_EQ(eos_seen, kept);
  // And every document starts with BOS right after the EOS before it.
  for (size_t p : kept) {
    if (p + 1 < all.size()) {
      EXPECT_EQ(all[p + 1], kBos) << "position " << p + 1;
    }
  }
}

TEST(TextData, UnpackedDocumentsAreTruncatedOrPaddedWithThePaddingOutOfTheLoss) {
  TempDir tmp;
  const auto lines = make_lines(50, 17);
  write_text(tmp.file("corpus.txt"), join_lines(lines));
  auto cfg = experiment("TextFile", tmp.file("corpus.txt"), 1, ", packing: false");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  const auto ids = spm_encode(lines);
  ASSERT_EQ(data->train.size() + data->test.size(), lines.size());
  ASSERT_EQ(data->train.loss_mask.size(), data->train.tokens.size());
  size_t padded = 0, truncated = 0;
  for (size_t k = 0; k < data->train.size(); ++k) {
    std::vector<int32_t> want = framed_stream({ids[k]});
    const size_t real = std::min<size_t>(want.size(), kLen);
    truncated += want.size() > kLen;
    padded += want.size() < kLen;
    want.resize(kLen, kPad);
    const int32_t* got = data->train.sample_tokens(k);
    EXPECT_EQ(std::vector<int32_t>(got, got + kLen), want) << "document " << k;
    const uint8_t* m = data->train.loss_mask.data() + k * kLen;
    EXPECT_EQ(m[0], 0);
    for (size_t j = 1; j < kLen; ++j) EXPECT_EQ(m[j], j < real ? 1 : 0) << "document " << k << " position " << j;
  }
  EXPECT_GT(padded, 0u);
  EXPECT_GT(truncated, 0u);
}

TEST(TextData, AFolderGivesAGroupPerFileInNameOrderAndByGroupGivesEachToOneClient) {
  TempDir tmp;
  std::filesystem::create_directory(tmp.file("corpus"));
  const std::vector<std::string> names = {"c_news.txt", "a_code.txt", "b_chat.txt"};  // written out of order
  std::map<std::string, std::vector<std::string>> text;
  for (size_t i = 0; i < names.size(); ++i) {
    text[names[i]] = make_lines(80 + 20 * i, 100 + i);
    write_text(tmp.file("corpus/" + names[i]), join_lines(text[names[i]]));
  }
  write_text(tmp.file("corpus/notes.md"), "not a .txt file, left out\n");
  auto cfg = experiment("TextFile", tmp.file("corpus"), 3, ", partition_strategy: by_group");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  const std::vector<std::string> sorted = {"a_code.txt", "b_chat.txt", "c_news.txt"};
  EXPECT_EQ(data->train.group_names, sorted);
  EXPECT_EQ(data->train.num_classes, 3);
  // Each group's samples are its own file's stream, packed on their own;
  // the last tenth of each is held out.
  std::map<int, std::vector<int32_t>> train_of, test_of;
  for (size_t i = 0; i < data->train.size(); ++i) {
    auto& v = train_of[data->train.labels[i]];
    v.insert(v.end(), data->train.sample_tokens(i), data->train.sample_tokens(i) + kLen);
  }
  for (size_t i = 0; i < data->test.size(); ++i) {
    auto& v = test_of[data->test.labels[i]];
    v.insert(v.end(), data->test.sample_tokens(i), data->test.sample_tokens(i) + kLen);
  }
  for (int g = 0; g < 3; ++g) {
    const std::vector<int32_t> stream = framed_stream(spm_encode(text[sorted[g]]));
    const size_t n = stream.size() / kLen;
    ASSERT_EQ(train_of[g].size(), (n - n / 10) * kLen) << sorted[g];
    ASSERT_EQ(test_of[g].size(), (n / 10) * kLen) << sorted[g];
    std::vector<int32_t> got = train_of[g];
    got.insert(got.end(), test_of[g].begin(), test_of[g].end());
    EXPECT_EQ(got, std::vector<int32_t>(stream.begin(), stream.begin() + n * kLen)) << sorted[g];
  }
  // by_group over 3 clients: client c holds exactly group c's samples.
  auto parts = make_partitions(*cfg, data->train);
  ASSERT_TRUE(parts.ok()) << parts.status().to_string();
  for (int c = 0; c < 3; ++c) {
    std::vector<uint32_t> held = (*parts)[c].train;
    held.insert(held.end(), (*parts)[c].val.begin(), (*parts)[c].val.end());
    std::sort(held.begin(), held.end());
    std::vector<uint32_t> want;
    for (uint32_t i = 0; i < data->train.size(); ++i) {
      if (data->train.labels[i] == c) want.push_back(i);
    }
    EXPECT_EQ(held, want) << "client " << c;
  }
  // Over 2 clients, round-robin in name order: groups 0 and 2 to client 0.
  PartitionSpec two{PartitionStrategy::kByGroup, 2};
  auto p2 = partition_indices(data->train.labels, data->train.num_classes, two);
  ASSERT_TRUE(p2.ok());
  for (uint32_t i : (*p2)[0]) EXPECT_NE(data->train.labels[i], 1);
  for (uint32_t i : (*p2)[1]) EXPECT_EQ(data->train.labels[i], 1);
  EXPECT_EQ((*p2)[0].size() + (*p2)[1].size(), data->train.size());
  // Four clients for three groups: refused by the config (memfl validate)
  // and by the partition, naming both counts.
  auto four = experiment("TextFile", tmp.file("corpus"), 4, ", partition_strategy: by_group");
  ASSERT_FALSE(four.ok());
  EXPECT_HAS(four.status().message(), "3 group");
  EXPECT_HAS(four.status().message(), "4 clients");
  PartitionSpec spec4{PartitionStrategy::kByGroup, 4};
  auto p4 = partition_indices(data->train.labels, data->train.num_classes, spec4);
  ASSERT_FALSE(p4.ok());
  EXPECT_HAS(p4.status().message(), "3 group");
  EXPECT_HAS(p4.status().message(), "4 clients");
}

TEST(TextData, ParagraphsEndAtBlankLinesAndADocumentIsAWholeFile) {
  TempDir tmp;
  std::filesystem::create_directory(tmp.file("corpus"));
  const auto w = make_lines(6, 51);
  // a.txt: three paragraphs (a blank line, a line of spaces, CRLF endings);
  // b.txt: two.
  write_text(tmp.file("corpus/a.txt"), w[0] + "\n" + w[1] + "\n\n   \n" + w[2] + "\r\n\r\n" + w[3] + "\n");
  write_text(tmp.file("corpus/b.txt"), w[4] + "\n\n" + w[5]);
  auto cfg = load_config_text(
      experiment_yaml("TextFile", tmp.file("corpus"), spm().vocab, 1, ", packing: false, sample_by: paragraph"),
      "exp.yaml", {"client_configs.model_configs.model_kwargs.seq_length=120"});
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  // 5 paragraphs; every group under 10 samples, so one (the largest
  // group's last) is held out.
  ASSERT_EQ(data->train.size(), 4u);
  ASSERT_EQ(data->test.size(), 1u);
  EXPECT_EQ(data->test.labels[0], 0);
  const size_t len = 121;
  auto sample = [&](const ImageDataset& d, size_t k) {
    std::vector<int32_t> v(d.sample_tokens(k), d.sample_tokens(k) + len);
    v.resize(static_cast<size_t>(std::find(v.begin(), v.end(), kEos) - v.begin()) + 1);
    return v;
  };
  EXPECT_EQ(sample(data->test, 0), framed_stream({spm_encode_one(w[3])}));
  EXPECT_EQ(sample(data->train, 1), framed_stream({spm_encode_one(w[2])}));  // the CRLF paragraph
  EXPECT_EQ(sample(data->train, 3), framed_stream({spm_encode_one(w[5])}));
  // The first paragraph has two lines: one document, one BOS and one EOS.
  const auto first = sample(data->train, 0);
  EXPECT_EQ(std::count(first.begin(), first.end(), kBos), 1);
  EXPECT_GT(first.size(), spm_encode_one(w[0]).size() + spm_encode_one(w[1]).size());
  // sample_by: document — a file is one sample.
  auto whole = load_config_text(
      experiment_yaml("TextFile", tmp.file("corpus"), spm().vocab, 1, ", packing: false, sample_by: document"),
      "exp.yaml", {"client_configs.model_configs.model_kwargs.seq_length=120"});
  ASSERT_TRUE(whole.ok()) << whole.status().to_string();
  auto d2 = load_data(*whole);
  ASSERT_TRUE(d2.ok()) << d2.status().to_string();
  EXPECT_EQ(d2->train.size() + d2->test.size(), 2u);
}

// Instruction records written by the test, with and without an input.
struct Record {
  std::string instruction, input, output, topic;
};
std::vector<Record> make_records(size_t n, uint64_t seed) {
  const auto words = make_lines(4 * n, seed);
  std::vector<Record> r;
  for (size_t i = 0; i < n; ++i) {
    r.push_back({words[4 * i], i % 3 == 0 ? "" : words[4 * i + 1], words[4 * i + 2], i % 2 ? "cooking" : "math"});
  }
  return r;
}
std::string records_jsonl(const std::vector<Record>& recs) {
  std::string s;
  for (const auto& r : recs) {
    nlohmann::json j{{"instruction", r.instruction}, {"output", r.output}, {"topic", r.topic}};
    if (!r.input.empty()) j["input"] = r.input;
    s += j.dump() + "\n";
  }
  return s;
}

TEST(JsonLines, TheDefaultPromptIsStanfordAlpacas) {
  // The published template text (Taori et al. 2023, the Stanford Alpaca repository).
  EXPECT_EQ(alpaca_prompt_template(true),
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
            "### Input:\n{input}\n\n### Response:\n");
  EXPECT_EQ(alpaca_prompt_template(false),
            "Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n");
  auto p = render_prompt("Q: {instruction} / {input} {{x}}", "a", "b", "k");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(*p, "Q: a / b {x}");
  auto bad = render_prompt("Q: {question}", "a", "b", "client_configs.data_configs.dataset_kwargs.prompt_template");
  ASSERT_FALSE(bad.ok());
  EXPECT_HAS(bad.status().message(), "prompt_template");
  EXPECT_HAS(bad.status().message(), "{question");
}

TEST(JsonLines, TrainingOnTheResponseOnlyMasksExactlyThePromptsTokens) {
  TempDir tmp;
  const auto recs = make_records(30, 21);
  write_text(tmp.file("sft.jsonl"), records_jsonl(recs));
  // One-line templates, so spm_encode (which reads lines) encodes each prompt
  // as a whole.
  const std::string with = "Instruction: {instruction} Input: {input} Answer:";
  const std::string without = "Instruction: {instruction} Answer:";
  const std::string kw = ", packing: false, train_on_response_only: true, prompt_template: '" + with +
                         "', prompt_template_no_input: '" + without + "'";
  // Samples long enough for a whole record (the prompt alone is longer than 16 tokens).
  auto cfg = load_config_text(experiment_yaml("JsonLines", tmp.file("sft.jsonl"), spm().vocab, 1, kw), "exp.yaml",
                              {"client_configs.model_configs.model_kwargs.seq_length=200"});
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  const size_t len = 201;
  ASSERT_EQ(data->train.width, static_cast<int64_t>(len));
  ASSERT_EQ(data->train.size() + data->test.size(), recs.size());
  ASSERT_EQ(data->train.loss_mask.size(), data->train.tokens.size());
  for (size_t k = 0; k < data->train.size(); ++k) {
    const Record& r = recs[k];
    std::string prompt = r.input.empty() ? without : with;
    prompt.replace(prompt.find("{instruction}"), 13, r.instruction);
    if (!r.input.empty()) prompt.replace(prompt.find("{input}"), 7, r.input);
    const std::vector<int32_t> p = spm_encode_one(prompt), o = spm_encode_one(r.output);
    const int32_t* t = data->train.sample_tokens(k);
    const uint8_t* m = data->train.loss_mask.data() + k * len;
    std::vector<int32_t> want{kBos};
    want.insert(want.end(), p.begin(), p.end());
    want.insert(want.end(), o.begin(), o.end());
    want.push_back(kEos);
    ASSERT_LE(want.size(), len);
    EXPECT_EQ(std::vector<int32_t>(t, t + want.size()), want) << "record " << k;
    // Targets 1 … |prompt| (the prompt's tokens) are masked, the response
    // and EOS count, the padding does not.
    size_t masked = 0;
    for (size_t j = 1; j < want.size(); ++j) masked += m[j] == 0;
    EXPECT_EQ(masked, p.size()) << "record " << k;
    for (size_t j = p.size() + 1; j < want.size(); ++j) EXPECT_EQ(m[j], 1) << "record " << k << " position " << j;
    for (size_t j = want.size(); j < len; ++j) EXPECT_EQ(m[j], 0);
  }
  // Without train_on_response_only, only the padding is out of the loss.
  auto all = load_config_text(
      experiment_yaml("JsonLines", tmp.file("sft.jsonl"), spm().vocab, 1,
                      ", packing: false, prompt_template: '" + with + "', prompt_template_no_input: '" + without + "'"),
      "exp.yaml", {"client_configs.model_configs.model_kwargs.seq_length=200"});
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  auto d2 = load_data(*all);
  ASSERT_TRUE(d2.ok()) << d2.status().to_string();
  EXPECT_EQ(d2->train.tokens, data->train.tokens);
  for (size_t k = 0; k < d2->train.size(); ++k) {
    const int32_t* t = d2->train.sample_tokens(k);
    const size_t real = static_cast<size_t>(std::find(t + 1, t + len, kEos) - t) + 1;
    for (size_t j = 1; j < len; ++j) EXPECT_EQ(d2->train.loss_mask[k * len + j], j < real ? 1 : 0);
  }
}

TEST(JsonLines, PackedInstructionSamplesEachKeepATargetThatCounts) {
  TempDir tmp;
  auto recs = make_records(40, 23);
  for (size_t i = 0; i < recs.size(); i += 4)
    recs[i].instruction += " " + make_lines(1, 900 + i)[0] + " " + make_lines(1, 950 + i)[0];
  write_text(tmp.file("sft.jsonl"), records_jsonl(recs));
  auto cfg = experiment("JsonLines", tmp.file("sft.jsonl"), 1, ", train_on_response_only: true");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  ASSERT_EQ(data->train.loss_mask.size(), data->train.tokens.size());
  size_t masked = 0;
  for (size_t k = 0; k < data->train.size(); ++k) {
    const uint8_t* m = data->train.loss_mask.data() + k * kLen;
    EXPECT_EQ(m[0], 0);
    EXPECT_TRUE(std::any_of(m + 1, m + kLen, [](uint8_t v) { return v == 1; })) << "sample " << k;
    masked += static_cast<size_t>(std::count(m + 1, m + kLen, 0));
  }
  // Alpaca's prompt is most of each record: much of every sample is masked.
  EXPECT_GT(masked, data->train.size() * kSeq / 2);
}

TEST(JsonLines, AGroupFieldGroupsRecordsByItsValueAndPlainTextRecordsAreTokenizedAsSpmEncodeDoes) {
  TempDir tmp;
  const auto lines = make_lines(90, 31);
  std::string jsonl;
  for (size_t i = 0; i < lines.size(); ++i) {
    jsonl += nlohmann::json{{"text", lines[i]}, {"src", i % 3 == 0 ? "zeta" : "alpha"}}.dump() + "\n";
  }
  write_text(tmp.file("docs.jsonl"), jsonl);
  auto cfg = experiment("JsonLines", tmp.file("docs.jsonl"), 2,
                        ", text_field: text, group_field: src, partition_strategy: by_group");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  EXPECT_EQ(data->train.group_names, (std::vector<std::string>{"alpha", "zeta"}));
  const auto ids = spm_encode(lines);
  for (int g = 0; g < 2; ++g) {
    std::vector<std::vector<int32_t>> docs;
    for (size_t i = 0; i < lines.size(); ++i) {
      if ((i % 3 == 0) == (g == 1)) docs.push_back(ids[i]);
    }
    const std::vector<int32_t> stream = framed_stream(docs);
    const size_t n = stream.size() / kLen, n_train = n - n / 10;
    std::vector<int32_t> got;
    for (size_t i = 0; i < data->train.size(); ++i) {
      if (data->train.labels[i] == g)
        got.insert(got.end(), data->train.sample_tokens(i), data->train.sample_tokens(i) + kLen);
    }
    EXPECT_EQ(got, std::vector<int32_t>(stream.begin(), stream.begin() + n_train * kLen)) << "group " << g;
  }
  // Dirichlet splits by the same groups: every training sample to one client.
  PartitionSpec dir{PartitionStrategy::kDirichlet, 2, 0.5, 2, 9};
  auto pd = partition_indices(data->train.labels, data->train.num_classes, dir);
  ASSERT_TRUE(pd.ok()) << pd.status().to_string();
  std::vector<uint32_t> all_idx = (*pd)[0];
  all_idx.insert(all_idx.end(), (*pd)[1].begin(), (*pd)[1].end());
  std::sort(all_idx.begin(), all_idx.end());
  for (uint32_t i = 0; i < all_idx.size(); ++i) ASSERT_EQ(all_idx[i], i);
  EXPECT_EQ(all_idx.size(), data->train.size());
  // Three clients for two topics: refused naming both counts, by memfl
  // validate's data check (a config load parses no record).
  auto three = experiment("JsonLines", tmp.file("docs.jsonl"), 3,
                          ", text_field: text, group_field: src, partition_strategy: by_group");
  ASSERT_TRUE(three.ok()) << three.status().to_string();
  const Status groups = check_experiment_data(*three);
  ASSERT_FALSE(groups.ok());
  EXPECT_HAS(groups.message(), "2 group");
  EXPECT_HAS(groups.message(), "3 clients");
}

TEST(JsonLines, ABadLineIsRefusedNamingTheKeyTheFileAndItsLine) {
  TempDir tmp;
  struct Case {
    std::string lines, kwargs, key, line, what;
  };
  const std::string ok = R"({"instruction": "do", "output": "done"})";
  const std::vector<Case> cases = {
      {ok + "\n" + ok + "\n{\"instruction\": \"do\", oops}\n", "", "client_configs.data_configs.dataset_path", "line 3",
       "not JSON"},
      {ok + "\n\n" + ok + "\n[1, 2]\n", "", "client_configs.data_configs.dataset_path", "line 4", "not a record"},
      {ok + "\n" + R"({"output": "x"})" + "\n", "", "dataset_kwargs.instruction_field", "line 2",
       "no field 'instruction'"},
      {ok + "\n" + ok + "\n" + R"({"instruction": "do", "output": 7})" + "\n", "", "dataset_kwargs.output_field",
       "line 3", "not a string"},
      {R"({"text": "a"})"
       "\n"
       R"({"body": "b"})"
       "\n",
       ", text_field: text", "dataset_kwargs.text_field", "line 2", "no field 'text'"},
      {ok + "\n" + ok + "\n", ", group_field: topic", "dataset_kwargs.group_field", "line 1", "no field 'topic'"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const std::string path = tmp.file("bad" + std::to_string(i) + ".jsonl");
    write_text(path, c.lines);
    // A config load reads no record; memfl validate's data check does ...
    auto cfg = experiment("JsonLines", path, 1, c.kwargs);
    ASSERT_TRUE(cfg.ok()) << "case " << i << ": " << cfg.status().to_string();
    const Status data = check_experiment_data(*cfg);
    ASSERT_FALSE(data.ok()) << "case " << i;
    for (const std::string& s : {c.key, path, c.line, c.what}) EXPECT_HAS(data.message(), s);
    // ... and the loader itself.
    TextDataSource src{"JsonLines", path, kSeq, spm().vocab, {}, 0, 0};
    src.text.tokenizer_path = spm().model;
    if (c.kwargs == ", text_field: text") src.text.text_field = "text";
    if (c.kwargs == ", group_field: topic") src.text.group_field = "topic";
    auto d = load_tokenized_text(src);
    ASSERT_FALSE(d.ok()) << "case " << i;
    for (const std::string& s : {c.key, path, c.line, c.what}) EXPECT_HAS(d.status().message(), s);
  }
  // memfl validate says the same, and exits non-zero.
  write_text(tmp.file("exp.yaml"), experiment_yaml("JsonLines", tmp.file("bad0.jsonl"), spm().vocab, 1));
  const Result r = memfl_cli("validate " + tmp.file("exp.yaml"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_HAS(r.output, "line 3");
}

TEST(Tokenizer, AVocabularyThatDisagreesWithTheModelIsRefusedNamingBothSizes) {
  TempDir tmp;
  write_text(tmp.file("corpus.txt"), join_lines(make_lines(100, 41)));
  const int wrong = spm().vocab + 8;
  const std::string size = std::to_string(spm().vocab), other = std::to_string(wrong);
  // A config load does not open the tokenizer; memfl validate's data check does.
  auto cfg = experiment("TextFile", tmp.file("corpus.txt"), 1, "", wrong);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  const Status data = check_experiment_data(*cfg);
  ASSERT_FALSE(data.ok());
  EXPECT_HAS(data.message(), size);
  EXPECT_HAS(data.message(), other);
  EXPECT_HAS(data.message(), "client_configs.data_configs.tokenizer_path");
  EXPECT_HAS(data.message(), "vocab_size");
  // The loader checks it too (a client whose config passed elsewhere).
  TextDataSource src{"TextFile", tmp.file("corpus.txt"), kSeq, wrong, {}, 0, 0};
  src.text.tokenizer_path = spm().model;
  auto d = load_tokenized_text(src);
  ASSERT_FALSE(d.ok());
  EXPECT_HAS(d.status().message(), size);
  EXPECT_HAS(d.status().message(), other);
  // And memfl validate, before any round.
  write_text(tmp.file("exp.yaml"), experiment_yaml("TextFile", tmp.file("corpus.txt"), wrong, 1));
  const Result r = memfl_cli("validate " + tmp.file("exp.yaml"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_HAS(r.output, size);
  EXPECT_HAS(r.output, other);
  // The right size passes.
  auto right = experiment("TextFile", tmp.file("corpus.txt"), 1);
  ASSERT_TRUE(right.ok()) << right.status().to_string();
  EXPECT_TRUE(check_experiment_data(*right).ok());
}

TEST(Tokenizer, AFifoADirectoryOrAFileThatIsNotAModelIsRefusedNamingTheKey) {
  TempDir tmp;
  const std::string key = "client_configs.data_configs.tokenizer_path";
  const std::string fifo = tmp.file("tokenizer.model");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::string msg = refusal_of([&] { return Tokenizer::open(fifo, key).status(); });
  EXPECT_HAS(msg, "FIFO");
  EXPECT_HAS(msg, key);
  std::filesystem::create_directory(tmp.file("dir.model"));
  msg = refusal_of([&] { return Tokenizer::open(tmp.file("dir.model"), key).status(); });
  EXPECT_HAS(msg, "a directory");
  EXPECT_HAS(msg, key);
  write_text(tmp.file("vocab.txt"), "this is a vocabulary list, not a model\n▁the\t-1\n");
  write_text(tmp.file("empty.model"), "");
  for (const std::string& p : {tmp.file("vocab.txt"), tmp.file("empty.model")}) {
    msg = refusal_of([&] { return Tokenizer::open(p, key).status(); });
    EXPECT_HAS(msg, "not a SentencePiece model");
    EXPECT_HAS(msg, key);
    EXPECT_HAS(msg, p);
  }
  // Through the config, as memfl validate loads it: the FIFO waits for no writer.
  write_text(tmp.file("corpus.txt"), join_lines(make_lines(50, 3)));
  msg = refusal_of([&] {
    return load_config_text(experiment_yaml("TextFile", tmp.file("corpus.txt"), spm().vocab, 1), "exp.yaml",
                            {key + "=" + fifo})
        .status();
  });
  EXPECT_HAS(msg, "FIFO");
  EXPECT_HAS(msg, key);
  // A regular file that is not a model: the config loads (it opens no
  // tokenizer), memfl validate's data check refuses it.
  msg = refusal_of([&] {
    auto cfg = load_config_text(experiment_yaml("TextFile", tmp.file("corpus.txt"), spm().vocab, 1), "exp.yaml",
                                {key + "=" + tmp.file("vocab.txt")});
    return cfg.ok() ? check_experiment_data(*cfg) : Status(StatusCode::kInternal, "the config load refused it");
  });
  EXPECT_HAS(msg, "not a SentencePiece model");
  EXPECT_HAS(msg, "exp.yaml");
}

TEST(TextData, WithoutATokenizerATextFileIsStillItsBytes) {
  TempDir tmp;
  const std::string text = join_lines(make_lines(200, 5));
  write_text(tmp.file("corpus.txt"), text);
  auto cfg = load_config_text(experiment_yaml("TextFile", tmp.file("corpus.txt"), 256, 1, "", false), "exp.yaml");
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto data = load_data(*cfg);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  EXPECT_TRUE(data->train.tokens.empty());
  ASSERT_GT(data->train.size(), 0u);
  EXPECT_EQ(std::string(data->train.pixels.begin(), data->train.pixels.begin() + kLen), text.substr(0, kLen));
  // Bytes need a vocabulary of 256.
  auto small = load_config_text(experiment_yaml("TextFile", tmp.file("corpus.txt"), 100, 1, "", false), "exp.yaml");
  ASSERT_FALSE(small.ok());
  EXPECT_HAS(small.status().message(), "byte tokens");
  EXPECT_HAS(small.status().message(), "100");
}

#else  // built without libsentencepiece

TEST(Tokenizer, WithoutSentencePieceATokenizerIsRefusedSayingWhy) {
  auto t = Tokenizer::open("/nonexistent/tokenizer.model", kTokenizerPathKey);
  ASSERT_FALSE(t.ok());
  EXPECT_HAS(t.status().message(), "libsentencepiece-dev");
}

#endif

}  // namespace
}  // namespace memfl
