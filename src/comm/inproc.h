// In-process transport (the simulator, `memfl run`): K worker replicas serve
// the round's virtual clients. A free worker takes the next client, copies
// the global model into its arena (on every core: nothing crosses a trust
// boundary, so nothing is hashed), runs the client's local update there, and
// hands its arena to the aggregator at once in large chunks whose sizes,
// offsets and values are checked as any update's (open_local_update; frames,
// when the update is compressed or masked, go as on the wire) — no worker
// waits for another's turn: the aggregator
// parks an update that is early (aggregate/fedavg_aggregator.h), so the
// model is the same bit for bit for any K.
#pragma once

#include <functional>
#include <vector>

#include "comm/client_transport.h"
#include "comm/transport.h"
#include "tensor/layout.h"

namespace memfl {

class InProcessTransport final : public ServerTransport {
 public:
  // A worker: the arena a client's model lives in while it trains.
  struct Worker {
    Arena* arena = nullptr;
  };
  // Runs client `client`'s local update of `round` on worker `w`'s arena
  // (already holding the global model); fills what the update reports.
  using LocalUpdate = std::function<Status(int worker, int client, int round, ClientUpdateInfo* info)>;
  // Before a worker takes another client: false sheds the worker (memory
  // governor), whose clients the others take.
  using KeepWorker = std::function<bool(int worker)>;
  // What worker `worker` sends for `client` once its local update is done,
  // the round's model being `global`: compressed frames, say
  // (ClientDriver::upload_place). None: the worker's arena as it is.
  using Upload = std::function<StatusOr<std::unique_ptr<ModelPlace>>(int worker, int client, const Arena& global)>;

  InProcessTransport(const Layout& layout, size_t chunk, std::vector<Worker> workers, LocalUpdate local_update,
                     KeepWorker keep_worker = {}, Upload upload = {})
      : layout_(layout),
        chunk_(chunk),
        workers_(std::move(workers)),
        local_update_(std::move(local_update)),
        keep_worker_(std::move(keep_worker)),
        upload_(std::move(upload)) {}

  std::string_view name() const override { return "inproc"; }
  // Workers copy the global model while others' updates fold.
  bool broadcast_done_before_collect() const override { return false; }
  Status broadcast(int, const std::vector<int>&, const Arena&, BroadcastResult*) override { return Status::Ok(); }
  Status collect(int round, const std::vector<int>& selected, const Arena& global, UpdateOpener& aggregator,
                 CollectResult* out) override;
  void finish(int) override {}

 private:
  const Layout& layout_;
  size_t chunk_;
  std::vector<Worker> workers_;
  LocalUpdate local_update_;
  KeepWorker keep_worker_;
  Upload upload_;
};

}  // namespace memfl
