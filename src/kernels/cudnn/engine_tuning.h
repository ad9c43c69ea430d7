// cuDNN engine autotuning, the host side (plain C++, built everywhere, tested on any machine):
// which of a graph's engine configurations to run, and the file that remembers the choice.
//
// cuDNN's heuristics rank a graph's engine configurations; plan 0 of mode A is what runs unless
// someone times the others (the H100's backward ran at half PyTorch's speed on plan 0:
// reports/gpu/2026-11-27-h100-cudnn-speed). With DISTCA_CUDNN_AUTOTUNE=1, on a graph key's first
// use CudnnAttention builds every configuration modes A and FALLBACK return, times each on the
// device (choose_engine, within DISTCA_CUDNN_AUTOTUNE_MS per key) and keeps the fastest; the
// choice is remembered per (GPU, cuDNN version, graph key) in DISTCA_CUDNN_ENGINE_CACHE, which a
// later run reads instead of timing again. A cache of another GPU or cuDNN, or one that does not
// parse, is ignored with one line (nothing in it is trusted). Not yet validated on a GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "distca/core/status.h"

namespace distca::kernels::cudnn {

struct EngineChoice {
  int64_t index = -1;     // the execution plan's index among the graph's candidates
  std::string name;       // cuDNN's name of it (e.g. "eng7_k2=..."): a cached choice must match it
  double ms = 0;          // its measured time, the fastest of its runs
  int64_t timed = 0;      // candidates timed (the others ran out of the time cap or failed)
  int64_t candidates = 0; // candidates there were
  bool from_cache = false;
};

// Times candidates 0..count-1 in order with `time_ms` (an error: that one is skipped) while the
// elapsed `seconds()` since the first stays under `cap_seconds` (the first is always timed), and
// returns the fastest that ran. An error when none ran, naming the first failure. `name(i)` names
// candidate i for the choice.
Result<EngineChoice> choose_engine(int64_t count, const std::function<std::string(int64_t)>& name,
                                   const std::function<Result<double>(int64_t)>& time_ms, double cap_seconds,
                                   const std::function<double()>& seconds);

// DISTCA_CUDNN_AUTOTUNE: unset, "" or "0" off, "1" on; anything else an error naming the knob.
Result<bool> parse_autotune(const char* value);
// DISTCA_CUDNN_AUTOTUNE_MS: the time cap per graph key in milliseconds, a number in [0, 600000];
// unset: 500. Returned in seconds.
Result<double> parse_autotune_ms(const char* value);

// The choices of one (device, cuDNN) pair, by graph key; a JSON file
// {"format": "distca-cudnn-engines", "version": 1, "device": ..., "cudnn": ..., "engines": {key:
// {"index", "name", "ms"}}}.
class EngineCache {
 public:
  // `path` empty: a cache that is never read or written. A missing file: empty. A file that does
  // not parse, is of another format or version, or of another device or cuDNN: empty, and
  // `*warning` says why in one line (the file is then replaced on save()).
  static EngineCache load(std::string path, std::string device, std::string cudnn, std::string* warning);

  std::optional<EngineChoice> find(const std::string& key) const;
  void put(const std::string& key, const EngineChoice& choice);
  // Writes the file (a temporary beside it, then renamed: a reader never sees half a file).
  Status save() const;
  const std::string& path() const { return path_; }
  size_t size() const { return engines_.size(); }

 private:
  std::string path_, device_, cudnn_;
  std::map<std::string, EngineChoice> engines_;
};

}  // namespace distca::kernels::cudnn
