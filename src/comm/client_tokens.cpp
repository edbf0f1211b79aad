#include "comm/client_tokens.h"

#include <sys/stat.h>

#include <climits>
#include <cstdint>

#include <fmt/format.h>

#include "io/input_file.h"

namespace memfl {

std::optional<int> parse_client_id(std::string_view text, int num_clients) {
  if (text.empty() || text.size() > 10) return std::nullopt;
  if (text.size() > 1 && text[0] == '0') return std::nullopt;
  int64_t v = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return std::nullopt;
    v = v * 10 + (ch - '0');
  }
  if (v >= num_clients) return std::nullopt;
  return static_cast<int>(v);
}

std::string printable_peer_text(std::string_view text) {
  constexpr size_t kMaxShown = 64;
  std::string out;
  for (size_t i = 0; i < text.size() && i < kMaxShown; ++i) {
    const auto ch = static_cast<unsigned char>(text[i]);
    if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
      out.push_back(static_cast<char>(ch));
    } else {
      out += fmt::format("\\x{:02x}", ch);
    }
  }
  if (text.size() > kMaxShown) out += fmt::format("... ({} bytes)", text.size());
  return out;
}

bool tokens_equal(std::string_view a, std::string_view b) {
  // The length is not secret (every token of a file may have its own), the
  // bytes are.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool ClientTokens::matches(int id, std::string_view presented) const {
  if (id < 0 || static_cast<size_t>(id) >= by_id_.size()) return false;
  const std::string& t = by_id_[static_cast<size_t>(id)];
  return !t.empty() && tokens_equal(t, presented);
}

const std::string& ClientTokens::token(int id) const {
  static const std::string kNone;
  if (id < 0 || static_cast<size_t>(id) >= by_id_.size()) return kNone;
  return by_id_[static_cast<size_t>(id)];
}

std::vector<int> ClientTokens::missing() const {
  std::vector<int> out;
  for (size_t i = 0; i < by_id_.size(); ++i) {
    if (by_id_[i].empty()) out.push_back(static_cast<int>(i));
  }
  return out;
}

namespace {

struct TokenLine {
  int line = 0;
  int id = -1;
  std::string token;
};

// Every `<id> <token>` line of the file, checked; ids within 0..max_ids-1.
StatusOr<std::vector<TokenLine>> parse_tokens(const std::string& text, const std::string& where, int max_ids) {
  std::vector<TokenLine> out;
  size_t pos = 0;
  int line_no = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    std::vector<std::string_view> fields;
    size_t i = 0;
    while (i < line.size()) {
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
      const size_t start = i;
      while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
      if (i > start) fields.push_back(line.substr(start, i - start));
    }
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return invalid_argument("{} line {}: expected '<client_id> <token>', found {} field(s)", where, line_no,
                              fields.size());
    }
    const auto id = parse_client_id(fields[0], max_ids);
    if (!id) {
      return invalid_argument("{} line {}: client id '{}' is not a plain decimal id in 0..{}", where, line_no,
                              fields[0], max_ids - 1);
    }
    const std::string_view token = fields[1];
    if (token.size() < kMinClientTokenBytes) {
      return invalid_argument("{} line {}: the token of client {} has {} bytes; at least {} are needed", where, line_no,
                              *id, token.size(), kMinClientTokenBytes);
    }
    for (char ch : token) {
      if (static_cast<unsigned char>(ch) < 0x21 || static_cast<unsigned char>(ch) > 0x7e) {
        return invalid_argument("{} line {}: the token of client {} has a byte that is not printable ASCII", where,
                                line_no, *id);
      }
    }
    out.push_back({line_no, *id, std::string(token)});
  }
  return out;
}

}  // namespace

StatusOr<ClientTokens> load_client_tokens(const std::string& path, std::string_view key, int num_clients,
                                          std::vector<std::string>* warnings) {
  const std::string where = fmt::format("{} '{}'", key, path);
  MEMFL_ASSIGN_OR_RETURN(std::string text, read_input_file(path, key, kConfigFileLimit));
  MEMFL_ASSIGN_OR_RETURN(auto lines, parse_tokens(text, where, num_clients));
  std::vector<std::string> by_id(static_cast<size_t>(num_clients));
  std::vector<int> line_of(static_cast<size_t>(num_clients), 0);
  for (auto& l : lines) {
    auto& seen = line_of[static_cast<size_t>(l.id)];
    if (seen != 0) {
      return invalid_argument("{} line {}: client {} already has a token (line {})", where, l.line, l.id, seen);
    }
    seen = l.line;
    by_id[static_cast<size_t>(l.id)] = std::move(l.token);
  }
  if (lines.empty()) return invalid_argument("{}: the file gives no client a token", where);
  struct stat st {};
  if (warnings != nullptr && ::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    warnings->push_back(fmt::format("{} may be read by other users (mode {:o}); chmod 600 it", where,
                                    static_cast<unsigned>(st.st_mode & 0777)));
  }
  return ClientTokens(std::move(by_id));
}

StatusOr<std::string> load_own_client_token(const std::string& path, std::string_view key, int client_id) {
  const std::string where = fmt::format("{} '{}'", key, path);
  MEMFL_ASSIGN_OR_RETURN(std::string text, read_input_file(path, key, kConfigFileLimit));
  MEMFL_ASSIGN_OR_RETURN(auto lines, parse_tokens(text, where, INT_MAX));
  for (auto& l : lines) {
    if (l.id == client_id) return std::move(l.token);
  }
  return invalid_argument("{}: no line gives client {} a token", where, client_id);
}

}  // namespace memfl
