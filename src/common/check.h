// NT_CHECK: throws with the place and a message that says what was required and what was seen.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace nimble_train {

// A broken precondition on caller input (pybind11 raises it as ValueError in Python).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A failure of the CUDA runtime or a library underneath (RuntimeError in Python).
class RuntimeFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename Exception>
[[noreturn]] inline void fail(const char* file, int line, const char* func,
                              const std::string& message) {
  // The build maps the source directory away (-fmacro-prefix-map), so `file` reads
  // "src/optim/boundary.cpp", never the build machine's absolute path.
  throw Exception(concat(message, " [", file, ":", line, " in ", func, "]"));
}

}  // namespace detail
}  // namespace nimble_train

// NT_CHECK(cond, "bucket ", i, " must be 16-byte aligned; got offset ", off);
#define NT_CHECK(cond, ...)                                                            \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ::nimble_train::detail::fail<::nimble_train::InvalidArgument>(                   \
          __FILE__, __LINE__, __func__, ::nimble_train::detail::concat(__VA_ARGS__));  \
    }                                                                                  \
  } while (0)

// NT_FAIL(...): an unconditional runtime failure with the same formatting.
#define NT_FAIL(...)                                                                   \
  ::nimble_train::detail::fail<::nimble_train::RuntimeFailure>(                        \
      __FILE__, __LINE__, __func__, ::nimble_train::detail::concat(__VA_ARGS__))
