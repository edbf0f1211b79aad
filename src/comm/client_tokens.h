// Who a gRPC client is. A client declares its id at Register; what makes the
// declaration true is a credential only that client holds. With
// server_configs.comm_configs.grpc_configs.client_tokens_file each id has a
// token of its own, so holding one client's token does not let anyone
// register as another (a shared auth_token does, and the server warns).
//
// The file: one `<client_id> <token>` per line, `#` starts a comment.
//
//   0 3f9c2a...   # client 0
//   1 b81e77...
//
// The server reads all of it; a client reads only its own line (a client
// machine's file may hold that line alone).
//
//   MEMFL_ASSIGN_OR_RETURN(ClientTokens tokens, load_client_tokens(path, num_clients));
//   if (!tokens.matches(id, presented)) refuse(...);
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace memfl {

inline constexpr std::string_view kClientTokensFileKey = "server_configs.comm_configs.grpc_configs.client_tokens_file";

// A client id as written by memfl's clients: decimal, no sign, no leading
// zero, no spaces, within 0..num_clients-1. `01`, `+1` and ` 1` are not 1:
// accepting them would let one client appear under several spellings in
// logs and refusals while the server counts it once. nullopt if malformed
// or out of range.
std::optional<int> parse_client_id(std::string_view text, int num_clients);

// A peer's text for a log line: at most 64 bytes, bytes outside printable
// ASCII as \xNN, so a declared id cannot forge log lines or flood them.
std::string printable_peer_text(std::string_view text);

// Tokens shorter than this are refused: a token is a password a remote
// peer may guess at every Register.
inline constexpr size_t kMinClientTokenBytes = 16;

// Equal without an early exit, so the time a comparison takes does not say
// how many leading bytes of a guess were right.
bool tokens_equal(std::string_view a, std::string_view b);

class ClientTokens {
 public:
  ClientTokens() = default;
  explicit ClientTokens(std::vector<std::string> by_id) : by_id_(std::move(by_id)) {}
  // True if `id` has a token and `presented` is it.
  bool matches(int id, std::string_view presented) const;
  // The token of `id` ("" if the file gives it none).
  const std::string& token(int id) const;
  // Ids 0..num_clients-1 the file gives no token (they cannot register).
  std::vector<int> missing() const;
  bool empty() const { return by_id_.empty(); }

 private:
  std::vector<std::string> by_id_;  // "" = no token
};

// Reads and checks a tokens file (a regular file of at most 4 MiB): every id
// parses strictly and lies within 0..num_clients-1, no id appears twice,
// every token has at least kMinClientTokenBytes printable, non-space bytes.
// Errors name `key`, the file and the line. `warnings` (optional) gets what
// is allowed but unwise: a file others may read.
[[nodiscard]] StatusOr<ClientTokens> load_client_tokens(const std::string& path, std::string_view key, int num_clients,
                                                        std::vector<std::string>* warnings = nullptr);

// A client's own token from such a file (only its line need be there).
[[nodiscard]] StatusOr<std::string> load_own_client_token(const std::string& path, std::string_view key, int client_id);

}  // namespace memfl
