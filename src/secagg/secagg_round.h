// The server's side of secure aggregation for one round — the seam between
// the transports and the fold, as compress/decoding_opener.h is for
// compression. It runs the key-exchange stages over a SecAggChannel, takes
// each client's masked stream as an UpdateOpener (every chunk checked, then
// added mod 2^32 into a sum of model elements + 1 words), and at the end
// reconstructs the secrets it may, unmasks the sum chunk by chunk and feeds
// the dequantised weighted mean — the only model it ever sees — to the
// aggregator as one update. So the aggregator (FedAvg, the server
// optimizers) and DP-FedAvg's noise act on the mean as without it, and no
// individual update reaches them.
//
//   auto sa = SecAggRound::start(round, selected, params, experiment, layout);
//   MEMFL_RETURN_IF_ERROR(sa.exchange_keys(channel, &failed));
//   transport.collect(round, selected, global, sa, &up);
//   MEMFL_ASSIGN_OR_RETURN(size_t n, sa.unmask_into(channel, checked, "secure_aggregate"));
#pragma once

#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "secagg/channel.h"
#include "secagg/secagg.h"
#include "tensor/layout.h"

namespace memfl {

class SecAggRound final : public UpdateOpener {
 public:
  // `sum_words`: where the masked sum of the model's words lives — memory
  // nothing reads until the aggregator writes the round's mean over it: the
  // global model's own (once broadcast) or the aggregator's idle sum
  // (Aggregator::idle_state_bytes), so the server holds no second model;
  // empty: a buffer of its own. `experiment`: the run's id
  // (secagg_experiment_id), which everything of the round is bound to.
  static StatusOr<std::unique_ptr<SecAggRound>> start(int round, std::vector<int> selected, const SecAggParams& params,
                                                      const ExperimentId& experiment, const Layout& layout,
                                                      std::span<uint32_t> sum_words = {});
  // Stages 1–2 with every selected client; a client that fails a stage is
  // out of the round (listed in `failed`; a bad message names it in the log).
  Status exchange_keys(SecAggChannel& channel, std::vector<int>* failed);
  StatusOr<std::unique_ptr<UpdateStream>> open_update(const std::string& client_id, double sample_count) override;
  // Stage 4 and the mean into `into` as one update named `name`, in chunks
  // of `chunk` bytes. Returns how many clients' updates the mean is of.
  // kAborted: the round cannot be unmasked (too few survivors or shares, an
  // upload that broke part-way) and is redone.
  StatusOr<size_t> unmask_into(SecAggChannel& channel, UpdateOpener& into, const std::string& name,
                               size_t chunk = 1 << 20);
  // What the round holds beside the global model: the masked sum (model +
  // 4 bytes) or, summing in the model's memory, 4 bytes.
  size_t sum_bytes() const { return (own_.empty() ? 1 : own_.size()) * sizeof(uint32_t); }
  // Clients whose messages were refused (a sealed share that does not
  // open, a revealed share or masked words whose tag do not check): out of
  // this round where it can still go on, and to be left out of the next
  // ones.
  const std::vector<int>& culprits() const { return culprits_; }
  // The resolved settings, the run's id and the server's key of the round.
  const SecAggSettings& settings() const { return settings_; }

 private:
  class Stream;
  SecAggRound(int round, std::vector<int> selected, SecAggSettings settings, const Layout& layout,
              std::span<uint32_t> sum_words);

  int round_;
  std::vector<int> selected_;
  SecAggSettings settings_;
  const Layout& layout_;
  std::vector<uint32_t> own_;  // the sum, when it has no place given
  std::span<uint32_t> body_;   // the sum's model words
  uint32_t weight_word_ = 0;   // summing in place: the weights' word
  std::mutex mu_;              // the server's state: streams add chunks from several threads
  std::unique_ptr<SecAggServer> server_;
  std::vector<int> out_;  // clients that failed a key-exchange stage
  std::vector<int> culprits_;
};

}  // namespace memfl
