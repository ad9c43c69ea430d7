#include "distca/core/knobs.h"

#include <fmt/format.h>
#include <unistd.h>  // environ

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "distca/core/check.h"

namespace distca {

namespace {

constexpr unsigned kCpp = kUsedByCpp, kPython = kUsedByPython, kScripts = kUsedByScripts, kTests = kUsedByTests;
constexpr const char* kFromHostsEnv = "from hosts.env";

// The table. A knob distca's own code reads (C++ or Python) comes first; then the scripts' and
// the tests'. Defaults are text, as a user would write them; tests/core/knobs_test.cc checks the
// ones that restate a constant.
constexpr Knob kKnobs[] = {
    {"DISTCA_CPU_ISA", "auto",
     "The build of the CPU attention kernels that runs: avx512, avx2, portable (those compiled in and "
     "runnable on this CPU; distca --version lists them) or auto, the fastest this CPU runs. A build "
     "this CPU cannot run, or one not compiled in, is refused before any work.",
     kCpp | kPython},
    {"DISTCA_MAX_INPUT_MB", "1024",
     "The largest input file distca reads (batches, plans, profiles, kernel tables), in MiB: a whole "
     "number in 1..1048576. A larger file is refused with a message naming this variable.",
     kCpp | kPython},
    {"DISTCA_PROGRESS_INTERVAL", "1",
     "Seconds between the progress lines of a long command, 0.1..3600; 0 prints every stage at once, "
     "with no delay and no heartbeat (what the tests use).",
     kCpp},
    {"DISTCA_HOPPER_DQ", "atomic",
     "How the sm_90a (Hopper) backward sums dQ: atomic (fp32 atomic adds from the K/V blocks) or pass "
     "(a pass of its own over the query tiles), for timing the two on a GPU.",
     kCpp | kScripts},
    {"DISTCA_CUDNN_GRAPH", "unset",
     "Variants of the cuDNN attention graph, comma-separated: exact-batch, top-left, no-max-total, "
     "dense, head-major-lse (with dense); unset builds the default graphs. Same results; for timing.",
     kCpp | kScripts},
    {"DISTCA_CUDNN_AUTOTUNE", "0",
     "1: on a cuDNN graph's first use, time every engine configuration its heuristics return (modes A "
     "and FALLBACK) and run the fastest; 0 runs the heuristics' first. Not yet validated on a GPU.",
     kCpp | kScripts},
    {"DISTCA_CUDNN_AUTOTUNE_MS", "500",
     "With DISTCA_CUDNN_AUTOTUNE=1, the time in milliseconds spent timing one graph's configurations "
     "(0..600000; the first is always timed).",
     kCpp},
    {"DISTCA_CUDNN_ENGINE_CACHE", "unset",
     "With DISTCA_CUDNN_AUTOTUNE=1, a JSON file remembering each graph's fastest engine per GPU and cuDNN "
     "version, read instead of timing again; one of another GPU or cuDNN, or that does not parse, is "
     "ignored with one line. Unset: remembered for the process only.",
     kCpp | kScripts},
    {"DISTCA_CUDA_POOL_KEEP_MIB", "2048",
     "MiB of freed device memory the CUDA kernels' stream-ordered pool keeps across synchronisations "
     "(0..16777216; 0 returns it to the driver at each, CUDA's default), so a large cuDNN workspace is "
     "not allocated afresh on every call. Not yet validated on a GPU.",
     kCpp | kScripts},
    {"DISTCA_KERNEL_TABLE", "unset",
     "A kernel table file (python -m distca.torch.kernel_table writes one) that distca.torch's auto "
     "kernel uses instead of the table shipped for the device, distca/torch/kernel_tables/<device>.json.",
     kPython},
    {"DISTCA_SHARED_DATA", "../shared/data",
     "The folder of document-length samples (dist_*.json) and reference plans (reference/) that the "
     "planner bench, the Python benches, scripts and tests read; the default is beside the repository.",
     kCpp | kPython | kScripts | kTests},
    {"DISTCA_BLAS_REEXEC", "unset",
     "Set by distca itself: on an AVX-512 CPU it sets OPENBLAS_CORETYPE=SkylakeX and this, then "
     "re-executes once, so that OpenBLAS loads its AVX-512 kernels. Not a setting to set by hand.",
     kCpp},
    {"DISTCA_BIN", "build/src/tools/distca",
     "The distca binary the Python tests run (test_cli_agreement.py, test_readme.py).", kTests},
    {"DISTCA_TEST_LONG", "unset",
     "1 runs the tests at their soak sizes (more steps, more random cases); scripts/test.sh --long "
     "sets it.",
     kScripts | kTests},
    {"DISTCA_TEST_KEEP", "0",
     "1 keeps the logs of tests/hosts/multihost_test.sh when it passes (they are kept when it fails).", kTests},
    {"DISTCA_CUDA_ARCHS", "90a-real",
     "The CUDA architectures scripts/gpu-check.sh builds for (passed to the CMake option of the same "
     "name).",
     kScripts},
    {"DISTCA_MPIRUN_HOST_FLAGS", kFromHostsEnv,
     "scripts/hosts.py up writes this and the DISTCA_HOSTS_* below into DIR/hosts.env, which scripts "
     "and tests source: mpirun's flags that reach the test hosts (rsh agent, subnet, keepalive), for "
     "`mpirun $DISTCA_MPIRUN_HOST_FLAGS --hostfile \"$DISTCA_HOSTS_HOSTFILE\" ...`.",
     kScripts | kTests},
    {"DISTCA_HOSTS_PREFIX", kFromHostsEnv,
     "The test hosts' name prefix; scripts/netns-agent.sh starts daemons only in the namespaces that "
     "carry it.",
     kScripts | kTests},
    {"DISTCA_HOSTS_N", kFromHostsEnv, "The number of test hosts.", kScripts},
    {"DISTCA_HOSTS_SUBNET", kFromHostsEnv, "The test hosts' /24, as A.B.C.", kScripts},
    {"DISTCA_HOSTS_ADDRS", kFromHostsEnv, "The test hosts' addresses, space-separated, host 0 first.", kScripts},
    {"DISTCA_HOSTS_NAMESPACES", kFromHostsEnv, "The test hosts' network namespaces, space-separated.", kScripts},
    {"DISTCA_HOSTS_IFACE", kFromHostsEnv, "Each test host's interface inside its namespace.", kScripts},
    {"DISTCA_HOSTS_BRIDGE", kFromHostsEnv, "The bridge joining the test hosts in the root namespace.", kScripts},
    {"DISTCA_HOSTS_BRIDGE_ADDR", kFromHostsEnv, "The bridge's address (mpirun runs there).", kScripts},
    {"DISTCA_HOSTS_SLOTS", kFromHostsEnv, "Slots per host in the hostfile.", kScripts},
    {"DISTCA_HOSTS_HOSTFILE", kFromHostsEnv, "The test hosts' Open MPI hostfile.", kScripts | kTests},
    {"DISTCA_HOSTS_RATE", kFromHostsEnv, "Each test host's egress rate (--rate; empty: unshaped).", kScripts},
    {"DISTCA_HOSTS_DELAY", kFromHostsEnv, "Each test host's egress delay (--delay; empty: none).", kScripts},
    {"DISTCA_HOSTS_LOSS", kFromHostsEnv, "Each test host's egress packet loss (--loss; empty: none).", kScripts},
    {"DISTCA_HOSTS_AGENT", kFromHostsEnv, "The rsh agent mpirun starts the hosts' daemons with (scripts/netns-agent.sh).",
     kScripts},
};

bool is_distcas_own(const Knob& k) { return (k.users & (kCpp | kPython)) != 0; }

// `text` wrapped greedily at spaces into lines of at most `width` characters (a longer word
// stands alone).
std::vector<std::string> wrap(const std::string& text, size_t width) {
  std::vector<std::string> lines;
  std::istringstream words(text);
  std::string word, line;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(line);
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

}  // namespace

std::span<const Knob> knobs() { return kKnobs; }

const Knob* find_knob(std::string_view name) {
  for (const Knob& k : kKnobs) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

const char* knob(std::string_view name) {
  const Knob* k = find_knob(name);
  DISTCA_CHECK(k != nullptr) << std::string(name)
                             << " is not in the table of knobs: add it to src/core/knobs.cc, with its default and "
                                "meaning";
  return std::getenv(k->name);
}

std::vector<std::string> knob_user_names(unsigned users) {
  std::vector<std::string> names;
  if (users & kCpp) names.emplace_back("C++");
  if (users & kPython) names.emplace_back("Python");
  if (users & kScripts) names.emplace_back("scripts");
  if (users & kTests) names.emplace_back("tests");
  return names;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> distca_names_in_environment() {
  std::vector<std::string> names;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (!entry.starts_with("DISTCA_")) continue;
    names.emplace_back(entry.substr(0, entry.find('=')));
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string unknown_knobs_warning(std::span<const std::string> names) {
  // A misspelling is at most this many edits from the name meant (DISTCA_CPU_ISAA, DISTCA_CPU_IAS);
  // at 3, DISTCA_FOO would be "DISTCA_BIN?".
  constexpr size_t kMostEdits = 2;
  std::vector<std::string> unknown, hints;  // hints[i]: the known name nearest unknown[i], or ""
  for (const std::string& name : names) {
    if (!name.starts_with("DISTCA_") || find_knob(name) != nullptr) continue;
    if (std::find(unknown.begin(), unknown.end(), name) != unknown.end()) continue;
    std::string nearest;
    size_t best = kMostEdits + 1;
    for (const Knob& k : kKnobs) {
      const size_t d = edit_distance(name, k.name);
      if (d < best) best = d, nearest = k.name;
    }
    unknown.push_back(name);
    hints.push_back(nearest);
  }
  if (unknown.empty()) return "";
  constexpr const char* kWhere = "distca --help-env lists them";
  if (unknown.size() == 1) {
    return fmt::format("distca: warning: {} is not a distca setting ({}{})", unknown[0],
                       hints[0].empty() ? "" : fmt::format("did you mean {}? ", hints[0]), kWhere);
  }
  std::vector<std::string> named;
  for (size_t i = 0; i < unknown.size(); ++i) {
    named.push_back(hints[i].empty() ? unknown[i] : fmt::format("{} (did you mean {}?)", unknown[i], hints[i]));
  }
  return fmt::format("distca: warning: {} are not distca settings ({})", fmt::join(named, ", "), kWhere);
}

std::string knobs_help_text(size_t width) {
  constexpr size_t kMostDefault = 16;  // a longer default goes on a line of its own
  size_t name_width = 0, default_width = 0;
  for (const Knob& k : kKnobs) {
    name_width = std::max(name_width, std::string_view(k.name).size());
    const size_t d = std::string_view(k.default_text).size();
    if (d <= kMostDefault) default_width = std::max(default_width, d);
  }
  const size_t indent = 2 + name_width + 2 + default_width + 2;
  const size_t text_width = width > indent + 30 ? width - indent : 30;
  std::string out;
  for (const std::string& line :
       wrap("The environment variables distca reads, and those of its scripts and tests: one table "
            "(src/core/knobs.cc). A run's settings are its flags; these say how it runs (which kernel build, "
            "input limits, progress lines) or where the scripts and tests find things. A DISTCA_* variable set "
            "that is not listed here gets one warning line from the distca command and from the Python package "
            "(distca.knobs), naming the nearest known one: a misspelt name would otherwise do nothing.",
            width)) {
    out += line + "\n";
  }
  out += "`distca --help-env --json` prints the table as JSON.\n";
  for (const bool own : {true, false}) {
    out += own ? "\ndistca (the command, the C++ library, the Python package):\n" : "\nscripts and tests:\n";
    out += fmt::format("  {:<{}}  {:<{}}  {}\n", "NAME", name_width, "DEFAULT", default_width, "MEANING");
    for (const Knob& k : kKnobs) {
      if (is_distcas_own(k) != own) continue;
      const std::vector<std::string> lines =
          wrap(fmt::format("{} Used by: {}.", k.meaning, fmt::join(knob_user_names(k.users), ", ")), text_width);
      const std::string_view dflt = k.default_text;
      size_t first = 0;
      if (dflt.size() > default_width) {
        out += fmt::format("  {:<{}}  {}\n", k.name, name_width, dflt);
      } else {
        out += fmt::format("  {:<{}}  {:<{}}  {}\n", k.name, name_width, dflt, default_width, lines[0]);
        first = 1;
      }
      for (size_t i = first; i < lines.size(); ++i) out += fmt::format("{:{}}{}\n", "", indent, lines[i]);
    }
  }
  return out;
}

std::string knobs_json_text() {
  nlohmann::json list = nlohmann::json::array();
  for (const Knob& k : kKnobs) {
    list.push_back({{"name", k.name},
                    {"default", k.default_text},
                    {"meaning", k.meaning},
                    {"used_by", knob_user_names(k.users)}});
  }
  const nlohmann::json out = {{"format", kKnobsFormat}, {"version", kKnobsFormatVersion}, {"knobs", list}};
  return out.dump(2) + "\n";
}

}  // namespace distca
