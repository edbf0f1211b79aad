// SecAggChannel: the server's view of the clients' side of secure
// aggregation's small stages (setup, share keys, unmask). The client's side
// is written once, in SecAggClientStages (owned by the client core,
// ClientDriver); a transport carries these calls to it — the in-process
// simulator calls it directly.
//
//   SecAggClientStages stages;                      // one per client process
//   KeyAdvert a = *stages.advertise(c, round, selected, settings);
//   … share_keys, deliver_shares, then the masked upload (MaskingPlace) …
//   std::vector<RevealedShare> r = *stages.unmask(c, request);
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/status.h"
#include "secagg/secagg.h"

namespace memfl {

class SecAggChannel {
 public:
  virtual ~SecAggChannel() = default;
  // Stage 1: client `client` makes its round's keys.
  virtual StatusOr<KeyAdvert> advertise(int client, int round, const std::vector<int>& selected,
                                        const SecAggSettings& settings) = 0;
  // Stage 2: its neighbours' keys in, its sealed shares out.
  virtual StatusOr<std::vector<SealedShare>> share_keys(int client, const std::vector<KeyAdvert>& roster) = 0;
  // Returns the senders whose shares `client` could not open or check.
  virtual StatusOr<std::vector<int>> deliver_shares(int client, std::vector<SealedShare> inbox) = 0;
  // Stage 4: the shares the server asked for.
  virtual StatusOr<std::vector<RevealedShare>> unmask(int client, const UnmaskRequest& request) = 0;
  // The round is over: its keys and seeds are forgotten.
  virtual void end_round(int round) = 0;
  // `client` is out of the round's key exchange (it failed a stage, or what
  // it sent was refused): a transport ends that client's part in the round
  // so that nobody waits for its masked upload.
  virtual void drop(int /*client*/, const Status& /*why*/) {}
};

// The clients' side, for every client this process plays (thread-safe: the
// simulator's workers mask in parallel).
class SecAggClientStages final : public SecAggChannel {
 public:
  StatusOr<KeyAdvert> advertise(int client, int round, const std::vector<int>& selected,
                                const SecAggSettings& settings) override;
  StatusOr<std::vector<SealedShare>> share_keys(int client, const std::vector<KeyAdvert>& roster) override;
  StatusOr<std::vector<int>> deliver_shares(int client, std::vector<SealedShare> inbox) override;
  StatusOr<std::vector<RevealedShare>> unmask(int client, const UnmaskRequest& request) override;
  void end_round(int round) override;
  // The client's protocol state for this round (null: it took no part).
  SecAggClient* client(int client);

 private:
  std::mutex mu_;
  std::map<int, std::unique_ptr<SecAggClient>> clients_;
};

}  // namespace memfl
