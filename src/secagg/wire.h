// Secure aggregation's small stages as bytes, for transports that carry
// them between processes (gRPC, MPI). The server side is a SecAggChannel
// whose calls become one request and one reply each (RemoteSecAggChannel);
// the client side answers a request from its SecAggClientStages
// (serve_secagg_request). A transport only moves the bytes: it never looks
// inside them.
//
//   server:  RemoteSecAggChannel channel(exchange, end_round, drop);  // exchange: send, wait for the reply
//            // RoundDriver calls channel.advertise(c, …) → request → reply → KeyAdvert
//   client:  std::string reply = *serve_secagg_request(stages, request, peer, my_clients, &stage);
//
// Every field a peer sent is checked before use (lengths, counts, the
// stage, the client it names); a bad message is an error naming the peer,
// never a read past the bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/client_transport.h"
#include "common/status.h"
#include "secagg/channel.h"

namespace memfl {

// The first byte of every request and reply: a peer of another version
// (other fields in a stage, or masked frames laid out otherwise) is refused
// at its first message, naming both versions, rather than misread.
inline constexpr uint8_t kSecAggWireVersion = 2;

enum class SecAggStage : uint8_t {
  kRoundOver = 0,  // an empty request: nothing more this round
  kAdvertise = 1,
  kShareKeys = 2,
  kDeliverShares = 3,
  kUnmask = 4,
};
const char* secagg_stage_name(SecAggStage s);

// The server's side over a transport: `exchange(client, request)` delivers
// a request to the process that plays `client` and returns its reply (or
// the transport's error: a timeout, a lost connection).
class RemoteSecAggChannel final : public SecAggChannel {
 public:
  using Exchange = std::function<StatusOr<std::string>(int client, std::string request)>;
  RemoteSecAggChannel(Exchange exchange, std::function<void(int round)> on_end_round,
                      std::function<void(int client, const Status& why)> on_drop)
      : exchange_(std::move(exchange)), on_end_round_(std::move(on_end_round)), on_drop_(std::move(on_drop)) {}

  StatusOr<KeyAdvert> advertise(int client, int round, const std::vector<int>& selected,
                                const SecAggSettings& settings) override;
  StatusOr<std::vector<SealedShare>> share_keys(int client, const std::vector<KeyAdvert>& roster) override;
  StatusOr<std::vector<int>> deliver_shares(int client, std::vector<SealedShare> inbox) override;
  StatusOr<std::vector<RevealedShare>> unmask(int client, const UnmaskRequest& request) override;
  void end_round(int round) override { on_end_round_(round); }
  void drop(int client, const Status& why) override { on_drop_(client, why); }

 private:
  StatusOr<std::string> call(int client, SecAggStage stage, const std::string& request);
  Exchange exchange_;
  std::function<void(int)> on_end_round_;
  std::function<void(int, const Status&)> on_drop_;
  int round_ = -1;  // the round of the last advertise: later stages carry it
};

// The client's side: answers `request` (from `peer`, for one of the clients
// `plays` lists: those this process plays this round) with `stages` and
// returns the reply's bytes; `*stage` says which stage it was (kRoundOver,
// an empty request: the round's stages are over; the reply is empty).
// A request that does not parse is an error; a stage that fails is
// answered with its error (the server then leaves that client out).
StatusOr<std::string> serve_secagg_request(SecAggChannel& stages, std::string_view request, const std::string& peer,
                                           const std::vector<int>& plays, SecAggStage* stage);

}  // namespace memfl
