// DISTCA_CHECK(cond) << "what and how to fix": aborts with file:line when an invariant breaks.
// For conditions a caller can cause with bad input, return a Status instead (status.h).
#pragma once

#include <sstream>

namespace distca::detail {

// Collects the streamed message and aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  template <typename T>
  CheckFailure& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & CheckFailure(...) << msg` type-check.
struct Voidify {
  void operator&(const CheckFailure&) {}
};

}  // namespace distca::detail

#define DISTCA_CHECK(cond)                      \
  (cond) ? (void)0                              \
         : ::distca::detail::Voidify() &        \
               ::distca::detail::CheckFailure(__FILE__, __LINE__, #cond)
