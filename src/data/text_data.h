// Text and instruction data for language models, tokenized with a
// SentencePiece model (data/tokenizer.h) into the token container of
// ImageDataset (dataset.h says what a trainer reads):
//  - TextFile: a .txt file, or a folder of them (sorted by name; each file is
//    a source, and its group); each line, paragraph or file a document.
//  - JsonLines: a .jsonl file of plain-text records (text_field) or of
//    instruction records (Alpaca's instruction / input / output through a
//    prompt template, the prompt optionally out of the loss); group_field
//    names a record's group.
// Each document is [BOS] ids [EOS] (BOS where the tokenizer has one). With
// packing the documents of a group are concatenated and cut into samples of
// seq_length + 1 tokens (the rest of a group's stream dropped); without, a
// document is one sample, truncated or padded (the pad id, else EOS) with the
// padding out of the loss. The test split is the last tenth of each group's
// samples.
//
//   TextDataSource src{"JsonLines", "alpaca.jsonl", 128, 32000, cfg.data.text};
//   MEMFL_ASSIGN_OR_RETURN(DatasetSplits s, load_tokenized_text(src));
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "data/dataset.h"
#include "data/text_config.h"

namespace memfl {

// Where the text is and what shapes it.
struct TextDataSource {
  std::string dataset_name;  // TextFile | JsonLines
  std::string path;          // client_configs.data_configs.dataset_path
  int seq_length = 64;
  int64_t vocab_size = 0;  // the model's: the tokenizer must have as many pieces
  TextDataConfig text;
  size_t max_train = 0, max_test = 0;  // 0 = all
};

// Reads, tokenizes and packs; every refusal names the key and the file (and,
// in a JSON lines file, the line).
[[nodiscard]] StatusOr<DatasetSplits> load_tokenized_text(const TextDataSource& src);

// What loading would refuse that can be seen without tokenizing, for
// `memfl validate`: the tokenizer (a SentencePiece model of the model's
// vocabulary, with an EOS piece), the corpus's files, every JSON line and
// its fields. Paths not on this machine are left to the process that loads
// them. Gives the number of groups the data will have, 0 when it cannot be
// told here.
[[nodiscard]] StatusOr<int> check_tokenized_text(const TextDataSource& src);

// What a config load checks, reading no file's contents: the tokenizer and
// the corpus are regular files within their size limits (a FIFO, a
// directory or a device is refused, naming the key), a folder's .txt files
// too. Neither the tokenizer plugin nor a JSON line is touched: a server
// that never reads the data starts without doing the data's work. Gives a
// folder's group count (its files), 0 where it takes parsing to tell.
[[nodiscard]] StatusOr<int> check_text_inputs(const TextDataSource& src);

// The Stanford Alpaca prompt, for records with and without an input.
std::string_view alpaca_prompt_template(bool with_input);

// `tmpl` with {instruction} and {input} replaced ({{ and }} are braces);
// another {name} or an unpaired brace is refused naming `key`.
[[nodiscard]] StatusOr<std::string> render_prompt(std::string_view tmpl, std::string_view instruction,
                                                  std::string_view input, std::string_view key);

}  // namespace memfl
