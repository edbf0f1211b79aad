// TextDataConfig: what client_configs.data_configs says about text and
// instruction data (the tokenizer, how documents are cut, packed and masked,
// which JSON fields hold what). It lives with the data code, not in config/,
// so that data/ reads a corpus from it without depending on the config
// parser, which in turn checks a corpus through data/: config → data, as
// config → model.
#pragma once

#include <string>

namespace memfl {

struct TextDataConfig {
  // client_configs.data_configs.tokenizer_path: a SentencePiece
  // tokenizer.model. Empty: TextFile's bytes are the tokens (vocabulary 256).
  std::string tokenizer_path;
  // TextFile with a tokenizer: what one document is — a line, a paragraph
  // (lines up to a blank line) or the whole file.
  std::string sample_by = "line";
  // true: documents concatenated (BOS … EOS each) and cut into samples of
  // seq_length + 1 tokens; false: one document per sample, truncated or
  // padded (the padding out of the loss).
  bool packing = true;
  // JsonLines: the field of a plain-text record; empty: instruction records
  // (the three fields below, through the prompt templates).
  std::string text_field;
  std::string instruction_field = "instruction";
  std::string input_field = "input";
  std::string output_field = "output";
  // {instruction} and {input} are replaced ({{ and }} are braces); empty:
  // the Alpaca template (with input; without input for records whose input
  // is empty or absent).
  std::string prompt_template;
  std::string prompt_template_no_input;
  // Instruction records: the prompt's tokens (and BOS) out of the loss.
  bool train_on_response_only = false;
  // JsonLines: a record's value of this field is its group (topic, source)
  // for partition_strategy by_group and dirichlet; empty: one group.
  std::string group_field;
};

}  // namespace memfl
