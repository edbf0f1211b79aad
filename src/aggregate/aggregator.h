// Aggregator: combines client updates into the next global model while the
// bytes arrive. The server never holds a client's model: each upload is an
// UpdateStream whose chunks are folded into the aggregator's running state
// and then dropped.
//
//   aggregator.begin_round(round);
//   auto update = aggregator.open_update("client_3", /*sample_count=*/6000);
//   stream_arena(layout, client_arena, chunk_size, **update);   // chunks fold in
//   MEMFL_RETURN_IF_ERROR((*update)->commit());
//   MEMFL_RETURN_IF_ERROR(aggregator.finalize(global_arena));
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/chunk.h"
#include "comm/transport.h"
#include "tensor/arena.h"
#include "tensor/layout.h"

namespace memfl {

class Aggregator : public UpdateOpener {
 public:
  virtual ~Aggregator() = default;
  virtual std::string_view name() const = 0;
  // Starts collecting updates for `round`; clears what the last round left.
  // `fold_order` lists the clients expected, in the order their updates
  // combine (so the result does not depend on the order they arrive in);
  // empty: the order they are opened in.
  virtual Status begin_round(int round, std::vector<std::string> fold_order = {}) = 0;
  // `client_id` will send nothing this round (dropped, timed out): updates
  // after it in fold order need not wait for it.
  virtual Status withdraw(const std::string& client_id) = 0;
  // Writes the aggregate of the committed updates into `global`. Fails,
  // leaving `global` untouched, when no update committed or when a stream
  // broke after some of its bytes were counted (the round must be redone).
  virtual Status finalize(Arena& global) = 0;
  // Updates committed this round.
  virtual int num_committed() const = 0;
  // Bytes the aggregator holds between rounds (for the memory bound).
  virtual size_t state_bytes() const = 0;
  // Bytes save_state writes for each commit (a server optimizer's moments;
  // 0 for an aggregator with no state between rounds): the disk check
  // counts them.
  virtual uint64_t saved_state_bytes() const { return 0; }
  // Anonymous bytes it may hold during a round on top of state_bytes(), in
  // a model of `model_bytes` (its stated bound; disk it spools to is not memory).
  virtual size_t working_bytes() const = 0;
  // Whether its state shares the global model's bytes (then the server holds
  // one model-sized buffer, and state_bytes() is 0).
  virtual bool sums_in_place() const = 0;
  // Points state kept in the global model's bytes at another model-sized
  // arena (a file-backed server folds each round into the next checkpoint's
  // file). Only between rounds.
  virtual Status retarget(Arena& in_place) = 0;
  // Model-sized bytes of its running state, laid out as the model, that
  // nothing reads during a round until the round's first update writes them
  // (FedAvg's own sum, not the global model's): secure aggregation sums its
  // masked words there until it hands over the one update, the mean, so the
  // server holds no second model. Empty where the state is laid out
  // otherwise or sits in the global model (see sums_in_place()).
  virtual std::span<std::byte> idle_state_bytes() { return {}; }
  // Where updates that arrive before their turn are spooled.
  virtual void set_spool_dir(std::string dir) = 0;
  // State kept between rounds (server optimizers' moments), committed with
  // the server's state after `round`: written under `state_dir`, described
  // in `record` (kept in the commit); load_state takes it back on --resume.
  // FedAvg keeps nothing.
  virtual Status save_state(const std::string& state_dir, int round, std::string* record) {
    record->clear();
    return Status::Ok();
  }
  virtual Status load_state(const std::string& state_dir, const std::string& record) { return Status::Ok(); }
};

}  // namespace memfl
