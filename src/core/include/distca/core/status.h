// Status and Result<T>: errors a caller can handle, returned across library boundaries.
// Broken invariants are not Statuses; they abort through DISTCA_CHECK (check.h).
#pragma once

#include <string>
#include <utility>
#include <variant>

#include "distca/core/check.h"

namespace distca {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller's input is malformed or out of range
  kNotFound,         // a named file, preset or policy does not exist
  kInfeasible,       // the request is well formed but cannot be satisfied
  kInternal,         // an unexpected failure of a dependency (I/O, parser)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: <message>", or "ok".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string message) {
  return {StatusCode::kInvalidArgument, std::move(message)};
}
inline Status not_found(std::string message) { return {StatusCode::kNotFound, std::move(message)}; }
inline Status infeasible(std::string message) {
  return {StatusCode::kInfeasible, std::move(message)};
}
inline Status internal_error(std::string message) {
  return {StatusCode::kInternal, std::move(message)};
}

// Result<T> holds a T or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    DISTCA_CHECK(!std::get<Status>(v_).is_ok()) << "Result built from an ok Status has no value";
  }

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  // REQUIRES: is_ok().
  T& value() & {
    DISTCA_CHECK(is_ok()) << "value() of a failed Result: " << status().to_string();
    return std::get<T>(v_);
  }
  const T& value() const& {
    DISTCA_CHECK(is_ok()) << "value() of a failed Result: " << status().to_string();
    return std::get<T>(v_);
  }
  T&& value() && {
    DISTCA_CHECK(is_ok()) << "value() of a failed Result: " << status().to_string();
    return std::get<T>(std::move(v_));
  }

 private:
  std::variant<T, Status> v_;
};

}  // namespace distca

// Returns the Status of `expr` from the enclosing function if it is not ok.
#define DISTCA_RETURN_IF_ERROR(expr)                  \
  do {                                                \
    ::distca::Status distca_status_ = (expr);         \
    if (!distca_status_.is_ok()) return distca_status_; \
  } while (0)

#define DISTCA_CONCAT_INNER_(a, b) a##b
#define DISTCA_CONCAT_(a, b) DISTCA_CONCAT_INNER_(a, b)
// `DISTCA_ASSIGN_OR_RETURN(auto x, make_x());` — binds the value or returns the error.
#define DISTCA_ASSIGN_OR_RETURN(lhs, expr) \
  DISTCA_ASSIGN_OR_RETURN_(DISTCA_CONCAT_(distca_result_, __LINE__), lhs, expr)
#define DISTCA_ASSIGN_OR_RETURN_(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.is_ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
