// A SentencePiece tokenizer (the tokenizer.model files of Llama 1/2,
// Mistral, TinyLlama and others), read through Debian's libsentencepiece:
// text in, token ids out, and the special ids a corpus is framed with. The
// library lives in a plugin, libmemfl_sentencepiece.so, loaded on first use
// (data/sentencepiece_plugin.cpp says why).
//
//   MEMFL_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::open(path, kTokenizerPathKey));
//   MEMFL_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok.encode("Hello world"));
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace memfl {

inline constexpr const char* kTokenizerPathKey = "client_configs.data_configs.tokenizer_path";
// A tokenizer.model is a few hundred KiB to a few MiB (large vocabularies
// with byte fallback); anything past this is not one.
inline constexpr uint64_t kTokenizerFileLimit = uint64_t{64} << 20;

// Whether this build has libsentencepiece (a config naming a tokenizer is
// refused without it).
bool have_sentencepiece();

class Tokenizer {
 public:
  Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;
  ~Tokenizer();

  // Opens `path` as a regular file of at most kTokenizerFileLimit (a FIFO,
  // a directory, a device or a larger file is refused, naming `key`) and
  // loads it; a file that is not a SentencePiece model is refused naming
  // `key` and the file.
  [[nodiscard]] static StatusOr<Tokenizer> open(const std::string& path, std::string_view key);

  const std::string& path() const { return path_; }
  int vocab_size() const;
  // -1 when the model has no such piece (spm_train's --bos_id=-1 and so on).
  int bos_id() const;
  int eos_id() const;
  int pad_id() const;
  int unk_id() const;
  // The ids of `text`, as spm_encode --output_format=id prints them for one
  // line (no BOS or EOS added).
  [[nodiscard]] StatusOr<std::vector<int32_t>> encode(std::string_view text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_;
};

}  // namespace memfl
