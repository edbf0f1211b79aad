// Status and StatusOr: how memfl reports what can fail at run time (a bad
// file, a bad config key, a peer's bad bytes). Assertions are for our own
// bugs; anything a user or a peer can cause comes back as a Status whose
// message names the key, file or peer.
//
//   StatusOr<Layout> layout = read_layout(path);
//   if (!layout.ok()) return layout.status();
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

namespace memfl {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // bad config key/value or bad CLI argument
  kNotFound,            // missing file, data set or plugin
  kDataLoss,            // truncated or lying file, checksum mismatch
  kFailedPrecondition,  // operation in the wrong state
  kResourceExhausted,   // memory budget
  kInternal,
  kUnavailable,  // peer went away
  kAborted,      // round must be redone
  kRejected,     // a peer's update refused for what it holds (non-finite values, absurd weight)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;
  // Adds context in front of the message ("reading x.safetensors: ...").
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

template <typename... Args>
Status invalid_argument(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kInvalidArgument, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status not_found(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kNotFound, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status data_loss(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kDataLoss, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status failed_precondition(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kFailedPrecondition, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status resource_exhausted(fmt::format_string<Args...> f, Args&&... args) {
  return Status(StatusCode::kResourceExhausted, fmt::format(f, std::forward<Args>(args)...));
}
// A round that cannot complete and is played again (nothing committed).
template <typename... Args>
Status aborted(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kAborted, fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
Status internal_error(fmt::format_string<Args...> f, Args&&... args) {
  return {StatusCode::kInternal, fmt::format(f, std::forward<Args>(args)...)};
}

template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : v_(std::move(status)) { assert(!std::get<Status>(v_).ok()); }
  StatusOr(T value) : v_(std::move(value)) {}

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<Status, T> v_;
};

#define MEMFL_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::memfl::Status memfl_status_ = (expr);        \
    if (!memfl_status_.ok()) return memfl_status_; \
  } while (0)

#define MEMFL_CONCAT_INNER(a, b) a##b
#define MEMFL_CONCAT(a, b) MEMFL_CONCAT_INNER(a, b)
#define MEMFL_ASSIGN_OR_RETURN(lhs, expr) \
  MEMFL_ASSIGN_OR_RETURN_IMPL(MEMFL_CONCAT(memfl_statusor_, __LINE__), lhs, expr)
#define MEMFL_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

}  // namespace memfl
