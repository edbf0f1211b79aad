#include "comm/update_report.h"

#include <cmath>

#include <fmt/format.h>

#include "comm/update_check.h"

namespace memfl {

namespace {

// Counts travel as doubles: whole numbers up to 2^53 are exact there, and a
// value is checked against that before it is cast (1e300 cast to int64_t
// is undefined behaviour).
constexpr double kMaxCount = 9007199254740992.0;  // 2^53

Status bad(std::string_view peer, int round, std::string_view name, double value, std::string_view want) {
  return Status(StatusCode::kRejected, fmt::format("round {}: the update of {} is refused: its metric {} is {}, not {}",
                                                   round, peer, name, value, want));
}

}  // namespace

std::map<std::string, double> encode_update_report(const UpdateReport& r) {
  std::map<std::string, double> m = {{"train_loss", r.train_loss},
                                     {"train_accuracy", r.train_accuracy},
                                     {"local_steps", static_cast<double>(r.local_steps)}};
  if (r.val_samples > 0) {
    m["val_samples"] = static_cast<double>(r.val_samples);
    m["val_loss"] = r.val_loss;
    m["val_accuracy"] = r.val_accuracy;
  }
  if (r.dp_steps > 0) {
    m["dp_steps"] = static_cast<double>(r.dp_steps);
    m["dp_sample_rate"] = r.dp_sample_rate;
  }
  if (r.has_epsilon) m["epsilon"] = r.epsilon;
  return m;
}

StatusOr<UpdateReport> decode_update_report(double sample_count,
                                            const std::vector<std::pair<std::string, double>>& metrics,
                                            std::string_view peer, int round) {
  UpdateReport r;
  r.sample_count = sample_count;
  auto count = [&](const std::string& name, double v, int64_t* into) -> Status {
    if (!(v >= 0 && v <= kMaxCount) || v != std::floor(v)) {
      return bad(peer, round, name, v, "a whole number from 0 to 2^53");
    }
    *into = static_cast<int64_t>(v);
    return Status::Ok();
  };
  bool has_val_loss = false, has_val_accuracy = false;
  for (const auto& [name, v] : metrics) {
    MEMFL_RETURN_IF_ERROR(check_update_metric(name, v, peer, round));
    if (name == "train_loss") {
      r.train_loss = v;
    } else if (name == "train_accuracy") {
      r.train_accuracy = v;
    } else if (name == "val_loss") {
      r.val_loss = v;
      has_val_loss = true;
    } else if (name == "val_accuracy") {
      r.val_accuracy = v;
      has_val_accuracy = true;
    } else if (name == "val_samples") {
      MEMFL_RETURN_IF_ERROR(count(name, v, &r.val_samples));
    } else if (name == "local_steps") {
      MEMFL_RETURN_IF_ERROR(count(name, v, &r.local_steps));
    } else if (name == "dp_steps") {
      MEMFL_RETURN_IF_ERROR(count(name, v, &r.dp_steps));
    } else if (name == "dp_sample_rate") {
      if (!(v >= 0 && v <= 1)) return bad(peer, round, name, v, "a rate in [0, 1]");
      r.dp_sample_rate = v;
    } else if (name == "epsilon") {
      r.has_epsilon = true;
      r.epsilon = v;
    }
  }
  // A validation is its samples and both figures; a client that names the
  // samples without the figures (or the reverse) has not reported one.
  if (r.val_samples > 0 && !(has_val_loss && has_val_accuracy)) {
    return Status(StatusCode::kRejected,
                  fmt::format("round {}: the update of {} is refused: it reports val_samples {} without val_loss and "
                              "val_accuracy",
                              round, peer, r.val_samples));
  }
  if (r.val_samples == 0) r.val_loss = r.val_accuracy = 0;
  return r;
}

ClientUpdateInfo update_info(int client, const UpdateReport& r) {
  ClientUpdateInfo info;
  info.client = client;
  info.sample_count = r.sample_count;
  info.train_loss = r.train_loss;
  info.train_accuracy = r.train_accuracy;
  info.has_validation = r.val_samples > 0;
  info.val_weight = static_cast<double>(r.val_samples);
  info.val_loss = r.val_loss;
  info.val_accuracy = r.val_accuracy;
  info.dp_steps = r.dp_steps;
  info.dp_sample_rate = r.dp_sample_rate;
  return info;
}

}  // namespace memfl
