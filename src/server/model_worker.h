// The server's model worker: a separate process (`memfl model-worker`) that
// holds the network, so the long-lived server process never maps libtorch
// (DESIGN invariant 2) and stays at its memory bound with evaluation on.
//
// It does two jobs for a gRPC or MPI server whose model is a network (CNN,
// ResNet18, …):
//   - the initial model: it builds the network with the run's seed — the
//     same code and seed as every client — and writes its weights to a
//     safetensors file; the server takes the layout and the bytes from there;
//   - server-side evaluation (do_server_eval): after each round the server
//     streams the global model to it in chunks, each with (layout hash,
//     offset, length, xxh3) as over the network, through a pipe; it checks
//     them into its own arena, evaluates on the test set and answers.
//
//   MEMFL_RETURN_IF_ERROR(write_initial_model(config_path, out_path));
//   MEMFL_ASSIGN_OR_RETURN(auto worker, ModelWorker::start(config_path, layout, chunk, run_dir));
//   MEMFL_ASSIGN_OR_RETURN(EvalResult ev, worker->evaluate(round, global_arena));
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "tensor/arena.h"
#include "tensor/layout.h"
#include "train/trainer_backend.h"

namespace memfl {

// Runs `memfl model-worker CONFIG --write-initial OUT` and waits for it.
Status write_initial_model(const std::string& config_path, const std::string& out_path, const std::string& log_path);

// This machine's cores (what an evaluation that has the machine to itself uses).
int machine_cores();

class ModelWorker {
 public:
  // Starts the evaluation worker for the experiment in `config_path`; its
  // log goes to `log_path`.
  static StatusOr<std::unique_ptr<ModelWorker>> start(const std::string& config_path, const Layout& layout,
                                                      size_t chunk, const std::string& log_path);
  ~ModelWorker();
  ModelWorker(const ModelWorker&) = delete;
  ModelWorker& operator=(const ModelWorker&) = delete;
  // Sends `global` and returns the worker's test loss and accuracy.
  StatusOr<EvalResult> evaluate(int round, const Arena& global);
  // The same in two halves: begin returns once the model has gone down the
  // pipe (the worker evaluates its own copy; `global` may change after), end
  // waits for the answer. One evaluation at a time. `threads` > 0: the
  // worker evaluates on that many threads from now on.
  Status begin_evaluation(int round, const Arena& global, int threads = 0);
  StatusOr<EvalResult> end_evaluation(int round);

 private:
  ModelWorker(const Layout& layout, size_t chunk) : layout_(layout), chunk_(chunk) {}
  // `s` with the tail of the worker's log (why it failed, when it did).
  Status with_log(const Status& s) const;
  const Layout& layout_;
  size_t chunk_;
  pid_t pid_ = -1;
  int to_worker_ = -1, from_worker_ = -1;
  std::string log_path_;
};

// The worker's side (`memfl model-worker`): writes the initial model when
// `write_initial` names a file, else serves evaluations on stdin/stdout
// until stdin closes.
Status run_model_worker(const std::string& config_path, const std::string& write_initial);

}  // namespace memfl
