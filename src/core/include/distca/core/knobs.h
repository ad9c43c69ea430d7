// Every DISTCA_* environment variable that distca, its scripts and its tests read, in one table
// (knobs.cc), each with its default and a one-line meaning; `distca --help-env` prints it and the
// Python package reads it (distca.knobs).
//
// - C++ reads a knob through knob(name), which refuses (DISTCA_CHECK) a name not in the table, so
//   a new getenv of a DISTCA_* variable cannot bypass the table.
// - A DISTCA_* variable set in the environment that the table does not know is one warning line
//   (unknown_knobs_warning) from the distca command and from the Python package, with the nearest
//   known name when one is close: a typo in a variable is otherwise silently ignored.
// - tests/knobs/knobs.cmake checks that every DISTCA_* name in the sources is in the table (or is a
//   C/C++ macro or a CMake variable), that every entry is used where it says, and that
//   --help-env lists every entry.
// Not here: C/C++ macros (DISTCA_CHECK, DISTCA_HAVE_CUDA) and CMake options (DISTCA_WITH_CUDA),
// which configure the build, not a run; and foreign variables distca reads (OPENBLAS_CORETYPE,
// OMPI_COMM_WORLD_RANK, RANK), which are not ours to document.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace distca {

// Who uses a knob (reads it; for hosts.env's, writes it for the others to read): a bit each.
enum KnobUser : unsigned {
  kUsedByCpp = 1u << 0,      // the C++ library and the distca command (src/, bench/)
  kUsedByPython = 1u << 1,   // the Python package and its benches (python/distca, python/bench)
  kUsedByScripts = 1u << 2,  // scripts/
  kUsedByTests = 1u << 3,    // the test suites (tests/, python/tests)
};

struct Knob {
  const char* name;          // DISTCA_...
  const char* default_text;  // what an unset variable means; "unset" where absence is the default
  const char* meaning;       // one sentence: what it sets and its values
  unsigned users;            // KnobUser bits
};

// The table, in the order --help-env prints it.
std::span<const Knob> knobs();

// The entry named `name`, or nullptr.
const Knob* find_knob(std::string_view name);

// The knob's value in the environment, or nullptr where it is unset.
// REQUIRES: `name` is in the table (a DISTCA_CHECK: add the knob to knobs.cc first).
const char* knob(std::string_view name);

// {"C++", "Python", "scripts", "tests"}: the users, as --help-env names them.
std::vector<std::string> knob_user_names(unsigned users);

// Levenshtein distance, for "did you mean".
size_t edit_distance(std::string_view a, std::string_view b);

// The names of the DISTCA_* variables set in this process's environment, sorted.
std::vector<std::string> distca_names_in_environment();

// One line (no newline) naming those of `names` that are DISTCA_* and not in the table, each with
// the nearest known name where one is close; "" when every DISTCA_* name is known. E.g.
//   distca: warning: DISTCA_CPU_ISAA is not a distca setting (did you mean DISTCA_CPU_ISA? distca
//   --help-env lists them)
std::string unknown_knobs_warning(std::span<const std::string> names);

// `distca --help-env`: the table as aligned text wrapped to `width` columns.
std::string knobs_help_text(size_t width = 100);
// `distca --help-env --json`: {"format": "distca-knobs", "version": 1, "knobs": [{"name",
// "default", "meaning", "used_by": [...]}, ...]}, indented, with a final newline.
std::string knobs_json_text();
inline constexpr const char* kKnobsFormat = "distca-knobs";
inline constexpr int kKnobsFormatVersion = 1;

}  // namespace distca
