#include "data/text_data.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <system_error>
#include <vector>

#include "data/tokenizer.h"
#include "io/input_file.h"
#include "memory/ledger.h"

namespace memfl {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kPathKey = "client_configs.data_configs.dataset_path";
constexpr std::string_view kKwargs = "client_configs.data_configs.dataset_kwargs.";
// labels are uint8: a group is one of at most this many.
constexpr size_t kMaxGroups = 256;

std::string kwarg(std::string_view name) { return std::string(kKwargs) + std::string(name); }

bool blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; });
}

// A piece of a document's text and whether its tokens count in the loss.
struct Segment {
  std::string text;
  bool counts = true;
};

struct Document {
  std::string group;
  std::vector<Segment> segments;
};

// The documents of one source, in order.
using Documents = std::vector<Document>;

// The files of a TextFile data set: the file, or a folder's .txt files sorted
// by name (each its own group, named by its file name).
StatusOr<std::vector<std::pair<std::string, std::string>>> text_files(const std::string& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (!fs::is_directory(st)) return std::vector<std::pair<std::string, std::string>>{{path, ""}};
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (e.path().extension() != ".txt") continue;
    std::error_code ec2;
    if (e.is_directory(ec2)) continue;  // a folder named x.txt is not a document
    files.emplace_back(e.path().string(), e.path().filename().string());
  }
  if (ec) return invalid_argument("{}: '{}' cannot be listed: {}", kPathKey, path, ec.message());
  if (files.empty()) return invalid_argument("{}: the folder '{}' holds no .txt file", kPathKey, path);
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  return files;
}

void split_documents(const std::string& text, const std::string& unit, const std::string& group, Documents* out) {
  auto add = [&](std::string s) {
    if (!blank(s)) out->push_back(Document{group, {Segment{std::move(s), true}}});
  };
  if (unit == "document") {
    add(text);
    return;
  }
  std::string para;
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + at, end - at);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (unit == "line") {
      add(std::string(line));
    } else if (blank(line)) {  // paragraph: a blank line ends one
      add(std::move(para));
      para.clear();
    } else {
      if (!para.empty()) para += '\n';
      para += line;
    }
    at = end + 1;
  }
  if (unit == "paragraph") add(std::move(para));
}

// A JSON record's string field; `required` false lets an absent (or null)
// field be empty.
StatusOr<std::string> string_field(const nlohmann::json& rec, const std::string& field, std::string_view key,
                                   const std::string& file, size_t line, bool required) {
  const auto it = rec.find(field);
  if (it == rec.end() || (!required && it->is_null())) {
    if (!required) return std::string();
    return invalid_argument("{}: '{}' line {}: the record has no field '{}'", key, file, line, field);
  }
  if (!it->is_string()) {
    return invalid_argument("{}: '{}' line {}: field '{}' is {}, not a string", key, file, line, field,
                            it->type_name());
  }
  return it->get<std::string>();
}

// Every record of a JSON lines file as a document (with the rendered
// prompt for instruction records).
StatusOr<Documents> read_jsonl(const TextDataSource& src) {
  const TextDataConfig& t = src.text;
  MEMFL_ASSIGN_OR_RETURN(std::string bytes, read_input_file(src.path, kPathKey, kTextCorpusLimit));
  const bool instruction = t.text_field.empty();
  const std::string with_input =
      t.prompt_template.empty() ? std::string(alpaca_prompt_template(true)) : t.prompt_template;
  const std::string without_input =
      t.prompt_template_no_input.empty() ? std::string(alpaca_prompt_template(false)) : t.prompt_template_no_input;
  Documents docs;
  size_t at = 0, line_no = 0;
  while (at < bytes.size()) {
    size_t end = bytes.find('\n', at);
    if (end == std::string::npos) end = bytes.size();
    const std::string_view line(bytes.data() + at, end - at);
    at = end + 1;
    ++line_no;
    if (blank(line)) continue;
    nlohmann::json rec = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (rec.is_discarded()) {
      return invalid_argument("{}: '{}' line {}: not JSON", kPathKey, src.path, line_no);
    }
    if (!rec.is_object()) {
      return invalid_argument("{}: '{}' line {}: a JSON {}, not a record (an object)", kPathKey, src.path, line_no,
                              rec.type_name());
    }
    Document d;
    if (!t.group_field.empty()) {
      const auto g = rec.find(t.group_field);
      if (g == rec.end()) {
        return invalid_argument("{}: '{}' line {}: the record has no field '{}'", kwarg("group_field"), src.path,
                                line_no, t.group_field);
      }
      if (g->is_string()) {
        d.group = g->get<std::string>();
      } else if (g->is_number() || g->is_boolean()) {
        d.group = g->dump();
      } else {
        return invalid_argument("{}: '{}' line {}: field '{}' is {}, not a string or a number", kwarg("group_field"),
                                src.path, line_no, t.group_field, g->type_name());
      }
    }
    if (!instruction) {
      MEMFL_ASSIGN_OR_RETURN(std::string text,
                             string_field(rec, t.text_field, kwarg("text_field"), src.path, line_no, true));
      d.segments.push_back(Segment{std::move(text), true});
    } else {
      MEMFL_ASSIGN_OR_RETURN(
          std::string ins, string_field(rec, t.instruction_field, kwarg("instruction_field"), src.path, line_no, true));
      MEMFL_ASSIGN_OR_RETURN(std::string inp,
                             string_field(rec, t.input_field, kwarg("input_field"), src.path, line_no, false));
      MEMFL_ASSIGN_OR_RETURN(std::string out,
                             string_field(rec, t.output_field, kwarg("output_field"), src.path, line_no, true));
      const bool has_input = !blank(inp);
      MEMFL_ASSIGN_OR_RETURN(std::string prompt,
                             render_prompt(has_input ? with_input : without_input, ins, inp,
                                           kwarg(has_input ? "prompt_template" : "prompt_template_no_input")));
      d.segments.push_back(Segment{std::move(prompt), !t.train_on_response_only});
      d.segments.push_back(Segment{std::move(out), true});
    }
    docs.push_back(std::move(d));
  }
  if (docs.empty()) return invalid_argument("{}: '{}' holds no record", kPathKey, src.path);
  return docs;
}

// One group's tokens and mask, as a stream (packing) or as samples.
struct GroupSamples {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  size_t samples = 0;
};

}  // namespace

std::string_view alpaca_prompt_template(bool with_input) {
  // The prompt of Stanford Alpaca (Taori et al. 2023), as published.
  if (with_input) {
    return "Below is an instruction that describes a task, paired with an input that provides further context. "
           "Write a response that appropriately completes the request.\n\n"
           "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
  }
  return "Below is an instruction that describes a task. Write a response that appropriately completes the "
         "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";
}

StatusOr<std::string> render_prompt(std::string_view tmpl, std::string_view instruction, std::string_view input,
                                    std::string_view key) {
  std::string out;
  out.reserve(tmpl.size() + instruction.size() + input.size());
  for (size_t i = 0; i < tmpl.size(); ++i) {
    const char c = tmpl[i];
    if ((c == '{' || c == '}') && i + 1 < tmpl.size() && tmpl[i + 1] == c) {
      out += c;
      ++i;
      continue;
    }
    if (c == '}') return invalid_argument("{}: an unpaired '}}' at character {} (write }}}} for a brace)", key, i);
    if (c != '{') {
      out += c;
      continue;
    }
    const size_t close = tmpl.find('}', i);
    const std::string_view name =
        close == std::string_view::npos ? tmpl.substr(i + 1) : tmpl.substr(i + 1, close - i - 1);
    if (close == std::string_view::npos || (name != "instruction" && name != "input")) {
      return invalid_argument("{}: '{{{}' at character {} is not {{instruction}} or {{input}} (write {{{{ for a brace)",
                              key, name.substr(0, 40), i);
    }
    out += name == "instruction" ? instruction : input;
    i = close;
  }
  return out;
}

namespace {

Status check_tokenizer(const Tokenizer& tok, int64_t vocab_size) {
  if (vocab_size > 0 && tok.vocab_size() != vocab_size) {
    return invalid_argument(
        "{}: the tokenizer '{}' has a vocabulary of {} pieces but the model's vocab_size "
        "(client_configs.model_configs.model_kwargs.vocab_size or its preset) is {}",
        kTokenizerPathKey, tok.path(), tok.vocab_size(), vocab_size);
  }
  if (tok.eos_id() < 0) {
    return invalid_argument(
        "{}: the tokenizer '{}' has no end-of-sequence piece (eos_id -1); documents are separated by it "
        "(train the model with spm_train --eos_id=N)",
        kTokenizerPathKey, tok.path());
  }
  return Status::Ok();
}

// Appends one document's tokens (BOS, its segments, EOS) to a stream.
Status append_document(const Tokenizer& tok, const Document& d, std::vector<int32_t>* ids, std::vector<uint8_t>* mask) {
  const bool first_counts = d.segments.empty() || d.segments.front().counts;
  if (tok.bos_id() >= 0) {
    ids->push_back(tok.bos_id());
    mask->push_back(first_counts ? 1 : 0);
  }
  for (const Segment& s : d.segments) {
    MEMFL_ASSIGN_OR_RETURN(std::vector<int32_t> e, tok.encode(s.text));
    ids->insert(ids->end(), e.begin(), e.end());
    mask->insert(mask->end(), e.size(), s.counts ? 1 : 0);
  }
  ids->push_back(tok.eos_id());
  mask->push_back(1);
  return Status::Ok();
}

// Whether a sample of `len` mask values has a target that counts
// (position 0 is never one).
bool has_target(const uint8_t* m, size_t len) {
  return std::any_of(m + 1, m + len, [](uint8_t v) { return v != 0; });
}

}  // namespace

StatusOr<int> check_tokenized_text(const TextDataSource& src) {
  std::error_code ec;
  if (!src.text.tokenizer_path.empty() && fs::exists(fs::symlink_status(src.text.tokenizer_path, ec))) {
    MEMFL_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::open(src.text.tokenizer_path, kTokenizerPathKey));
    MEMFL_RETURN_IF_ERROR(check_tokenizer(tok, src.vocab_size));
  }
  if (src.path.empty() || !fs::exists(fs::symlink_status(src.path, ec))) return 0;
  if (src.dataset_name == "JsonLines") {
    MEMFL_ASSIGN_OR_RETURN(Documents docs, read_jsonl(src));
    std::map<std::string, int> groups;
    for (const auto& d : docs) groups[d.group] = 0;
    if (groups.size() > kMaxGroups) {
      return invalid_argument("{}: '{}' has {} groups; at most {} are supported", kwarg("group_field"), src.path,
                              groups.size(), kMaxGroups);
    }
    return static_cast<int>(groups.size());
  }
  // A TextFile's groups are its files: their kinds and count, as a config load checks them.
  return check_text_inputs(src);
}

StatusOr<int> check_text_inputs(const TextDataSource& src) {
  MEMFL_RETURN_IF_ERROR(
      check_input_file_if_present(src.text.tokenizer_path, kTokenizerPathKey, kTokenizerFileLimit));
  std::error_code ec;
  if (src.path.empty() || !fs::exists(fs::symlink_status(src.path, ec))) return 0;
  if (src.dataset_name == "JsonLines") {
    MEMFL_RETURN_IF_ERROR(check_input_file_if_present(src.path, kPathKey, kTextCorpusLimit));
    return 0;  // its groups are its records' values
  }
  MEMFL_ASSIGN_OR_RETURN(auto files, text_files(src.path));
  for (const auto& [file, name] : files) {
    MEMFL_RETURN_IF_ERROR(check_input_file_if_present(file, kPathKey, kTextCorpusLimit));
  }
  if (files.size() > kMaxGroups) {
    return invalid_argument("{}: the folder '{}' holds {} .txt files, each a group; at most {} are supported", kPathKey,
                            src.path, files.size(), kMaxGroups);
  }
  return static_cast<int>(files.size());
}

StatusOr<DatasetSplits> load_tokenized_text(const TextDataSource& src) {
  const TextDataConfig& t = src.text;
  if (t.tokenizer_path.empty()) {
    return invalid_argument("{}: dataset {} needs a tokenizer", kTokenizerPathKey, src.dataset_name);
  }
  MEMFL_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::open(t.tokenizer_path, kTokenizerPathKey));
  MEMFL_RETURN_IF_ERROR(check_tokenizer(tok, src.vocab_size));
  const size_t len = static_cast<size_t>(src.seq_length) + 1;
  const int32_t pad = tok.pad_id() >= 0 ? tok.pad_id() : tok.eos_id();

  // Documents, then each group's samples: one stream per group when packing
  // (so a sample never mixes two groups), else a sample per document.
  std::map<std::string, GroupSamples> groups;
  size_t dropped = 0, dropped_samples = 0, docs_seen = 0;
  auto take = [&](const Documents& docs) -> Status {
    for (const Document& d : docs) {
      ++docs_seen;
      GroupSamples& g = groups[d.group];
      if (t.packing) {
        MEMFL_RETURN_IF_ERROR(append_document(tok, d, &g.tokens, &g.mask));
        continue;
      }
      const size_t at = g.tokens.size();
      MEMFL_RETURN_IF_ERROR(append_document(tok, d, &g.tokens, &g.mask));
      g.tokens.resize(at + len, pad);  // truncated or padded to one sample
      g.mask.resize(at + len, 0);
      g.mask[at] = 0;
      if (!has_target(g.mask.data() + at, len)) {  // e.g. a prompt longer than the sample
        g.tokens.resize(at);
        g.mask.resize(at);
        ++dropped;
        continue;
      }
      ++g.samples;
    }
    return Status::Ok();
  };
  if (src.dataset_name == "JsonLines") {
    MEMFL_ASSIGN_OR_RETURN(Documents docs, read_jsonl(src));
    MEMFL_RETURN_IF_ERROR(take(docs));
  } else {
    MEMFL_ASSIGN_OR_RETURN(auto files, text_files(src.path));
    for (const auto& [file, name] : files) {
      MEMFL_ASSIGN_OR_RETURN(std::string text, read_input_file(file, kPathKey, kTextCorpusLimit));
      Documents docs;
      split_documents(text, t.sample_by, name, &docs);
      text = std::string();
      if (docs.empty()) groups[name];  // a source with no document: named below as empty
      MEMFL_RETURN_IF_ERROR(take(docs));
    }
  }
  if (t.packing) {
    for (auto& [name, g] : groups) {
      // Whole samples; a sample with no target that counts (all prompt,
      // under train_on_response_only) is dropped, as the contract promises.
      const size_t whole = g.tokens.size() / len;
      size_t kept = 0;
      for (size_t i = 0; i < whole; ++i) {
        g.mask[i * len] = 0;
        if (!has_target(g.mask.data() + i * len, len)) {
          ++dropped_samples;
          continue;
        }
        if (kept != i) {
          std::copy_n(g.tokens.begin() + static_cast<ptrdiff_t>(i * len), len,
                      g.tokens.begin() + static_cast<ptrdiff_t>(kept * len));
          std::copy_n(g.mask.begin() + static_cast<ptrdiff_t>(i * len), len,
                      g.mask.begin() + static_cast<ptrdiff_t>(kept * len));
        }
        ++kept;
      }
      g.samples = kept;
      g.tokens.resize(kept * len);
      g.mask.resize(kept * len);
    }
  }
  if (dropped_samples > 0) {
    spdlog::warn("{}: {} packed samples left out: all their tokens are prompt (train_on_response_only)", src.path,
                 dropped_samples);
  }
  if (dropped > 0) {
    spdlog::warn("{}: {} of {} documents left out: none of their tokens that count fit in seq_length + 1 = {}",
                 src.path, dropped, docs_seen, len);
  }
  // Groups with no sample (a source shorter than one sample) are left out.
  for (auto it = groups.begin(); it != groups.end();) {
    if (it->second.samples > 0) {
      ++it;
      continue;
    }
    spdlog::warn("{}: group '{}' gives no sample of {} tokens and is left out", src.path, it->first, len);
    it = groups.erase(it);
  }
  if (groups.size() > kMaxGroups) {
    return invalid_argument("{}: '{}' has {} groups; at most {} are supported",
                            src.dataset_name == "JsonLines" ? kwarg("group_field") : std::string(kPathKey), src.path,
                            groups.size(), kMaxGroups);
  }
  size_t total = 0, largest = 0, n_test = 0;
  for (const auto& [name, g] : groups) {
    total += g.samples;
    largest = std::max(largest, g.samples);
    n_test += g.samples / 10;
  }
  if (total < 2) {
    return invalid_argument("{}: '{}' makes {} sample(s) of {} tokens; at least 2 are needed (one held out)", kPathKey,
                            src.path, total, len);
  }
  // Every group under 10 samples: one held out, the largest group's last.
  const bool fallback = n_test == 0;

  auto split = [&](std::string name) {
    ImageDataset d;
    d.name = std::move(name);
    d.channels = d.height = 1;
    d.width = static_cast<int64_t>(len);
    d.num_classes = static_cast<int>(groups.size());
    return d;
  };
  DatasetSplits s{split(src.path), split(src.path + " (test)")};
  bool fallback_done = false;
  uint8_t gid = 0;
  for (auto& [name, g] : groups) {
    size_t test = g.samples / 10;
    if (fallback && !fallback_done && g.samples == largest) {
      test = 1;
      fallback_done = true;
    }
    const size_t train = g.samples - test;
    auto put = [&](ImageDataset& d, size_t from, size_t n) {
      d.tokens.insert(d.tokens.end(), g.tokens.begin() + static_cast<ptrdiff_t>(from * len),
                      g.tokens.begin() + static_cast<ptrdiff_t>((from + n) * len));
      d.loss_mask.insert(d.loss_mask.end(), g.mask.begin() + static_cast<ptrdiff_t>(from * len),
                         g.mask.begin() + static_cast<ptrdiff_t>((from + n) * len));
      d.labels.insert(d.labels.end(), n, gid);
    };
    put(s.test, train, test);
    if (s.train.tokens.empty()) {  // the first group (often the only one) moves in: no second copy
      g.tokens.resize(train * len);
      g.mask.resize(train * len);
      s.train.tokens = std::move(g.tokens);
      s.train.loss_mask = std::move(g.mask);
      s.train.labels.assign(train, gid);
    } else {
      put(s.train, 0, train);
    }
    s.train.group_names.push_back(name);
    s.test.group_names.push_back(name);
    g = GroupSamples();
    ++gid;
  }
  for (ImageDataset* d : {&s.train, &s.test}) {
    const size_t cap = d == &s.train ? src.max_train : src.max_test;
    if (cap > 0 && cap < d->size()) {
      d->labels.resize(cap);
      d->tokens.resize(cap * len);
      d->loss_mask.resize(cap * len);
    }
    // All targets counting: no mask (the contract's "empty = all count").
    bool all = true;
    for (size_t i = 0; i < d->loss_mask.size() && all; ++i) all = d->loss_mask[i] != 0 || i % len == 0;
    if (all) d->loss_mask = std::vector<uint8_t>();
    if (d->group_names.size() == 1 && d->group_names[0].empty()) d->group_names.clear();
    d->tokens.shrink_to_fit();
    d->loss_mask.shrink_to_fit();
  }
  Ledger::instance().add(
      MemoryCategory::kData,
      static_cast<int64_t>((s.train.tokens.size() + s.test.tokens.size()) * sizeof(int32_t) + s.train.loss_mask.size() +
                           s.test.loss_mask.size() + s.train.labels.size() + s.test.labels.size()));
  spdlog::info("{}: {} documents, {} training and {} test samples of {} tokens, {} group(s), vocabulary {}", src.path,
               docs_seen, s.train.size(), s.test.size(), len, groups.size(), tok.vocab_size());
  return s;
}

}  // namespace memfl
