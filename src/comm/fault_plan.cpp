#include "comm/fault_plan.h"

#include <csignal>
#include <cstdlib>
#include <limits>
#include <string>

#include <spdlog/spdlog.h>

namespace memfl {

namespace {

class EnvFaults final : public TransferFaults {
 public:
  EnvFaults(std::string kind, int who) : kind_(std::move(kind)), who_(who) {}

  std::string token(std::string token) override { return kind_ == "wrong_token" ? token + "-wrong" : token; }
  uint64_t data_ticket(uint64_t ticket) override { return kind_ == "wrong_data_ticket" ? ticket ^ 1 : ticket; }
  void in_broadcast() override { stop_once("stop_in_broadcast"); }

  Status before_upload_chunk(size_t index, bool last, ChunkHeader* h) override {
    // MPI announces its upload once, with no header, before its chunks go.
    if (index == 1 || h == nullptr) stop_once("stop_mid_upload");
    if (kind_ == "disconnect_before_upload" && index == 0 && h != nullptr && uploads_done_ == 0) {
      return Status(StatusCode::kAborted, "injected fault: disconnected before the first chunk of its upload");
    }
    if (h == nullptr || uploads_done_ > 0 || !(index == 1 || last)) return Status::Ok();
    if (kind_ == "disconnect_mid_upload") {
      return Status(StatusCode::kAborted, "injected fault: disconnected in the middle of the upload");
    }
    if (kind_ == "bad_checksum") h->checksum ^= 1;
    if (kind_ == "wrong_layout_hash") h->layout_hash ^= 1;
    if (kind_ == "offset_past_end") h->offset = UINT64_MAX / 2;
    if (kind_ == "extra_bytes") h->length -= 1;  // more bytes follow than the header announces
    return Status::Ok();
  }

  void before_update_meta(UpdateMeta* meta) override {
    if (uploads_done_ > 0) return;
    if (kind_ == "nan_train_loss") meta->metrics["train_loss"] = std::numeric_limits<double>::quiet_NaN();
    if (kind_ == "wrong_round") meta->round += 1;
    if (kind_ == "wrong_client") meta->client += 1;  // another client's id (MPI's metadata carries it)
  }

  void after_round(int round) override {
    ++uploads_done_;
    if (kind_ == "die_after_round_1" && round == 1) std::_Exit(9);
  }

 private:
  void stop_once(const char* kind) {
    if (kind_ != kind || stopped_) return;
    stopped_ = true;
    spdlog::warn("{} {}: injected fault {}: stopping (SIGSTOP)", "process", who_, kind);
    std::raise(SIGSTOP);
  }

  std::string kind_;
  int who_;
  bool stopped_ = false;
  int uploads_done_ = 0;
};

}  // namespace

std::unique_ptr<TransferFaults> transfer_faults_from_env(int who, std::string_view who_variable) {
  const char* kind = std::getenv("MEMFL_FAULT");
  const char* target = std::getenv(std::string(who_variable).c_str());
  // A gRPC client fault names client 0 unless told otherwise; an MPI rank
  // fault names its rank always.
  const bool named = target != nullptr ? std::atoi(target) == who : who_variable == "MEMFL_FAULT_CLIENT" && who == 0;
  if (kind == nullptr || *kind == '\0' || !named) return std::make_unique<TransferFaults>();
  return std::make_unique<EnvFaults>(kind, who);
}

}  // namespace memfl
