#include "distca/plan/verify.h"

#include <fmt/format.h>

#include <algorithm>

namespace distca::plan {
namespace {

std::string describe(const Task& t) {
  return fmt::format("task (doc {}, q [{}, {}), kv [{}, {}), server {})", t.doc, t.q0, t.q1, t.k0,
                     t.k1, t.server);
}

Status check_well_formed(const Batch& batch, const Task& t) {
  if (t.doc < 0 || t.doc >= batch.num_docs()) {
    return invalid_argument(describe(t) + ": no such document");
  }
  if (t.server < 0 || t.server >= batch.num_ranks) {
    return invalid_argument(describe(t) + ": server outside [0, R)");
  }
  const int64_t length = batch.doc_lengths[t.doc];
  if (t.q0 < 0 || t.q1 <= t.q0 || t.q1 > length) {
    return invalid_argument(fmt::format("{}: query range outside [0, {}) or empty", describe(t), length));
  }
  if (t.k0 < 0 || t.k1 <= t.k0) return invalid_argument(describe(t) + ": empty key range");
  if (t.is_causal()) {
    if (t.k0 > t.q0) return invalid_argument(describe(t) + ": causal task whose keys start after its first query");
  } else if (t.k1 > t.q0 + 1) {
    return invalid_argument(describe(t) + ": non-causal key range reaches past the first query");
  }
  return Status::ok();
}

// Every row q of the document must see keys [0, q] exactly once: on each stretch of rows where
// the same tasks are active, exactly one causal task covers [k0, q] and the non-causal ranges
// tile [0, k0) with no gap and no overlap.
Status check_document(const Batch& batch, int32_t doc, std::vector<const Task*>& tasks) {
  const int64_t length = batch.doc_lengths[doc];
  std::sort(tasks.begin(), tasks.end(), [](const Task* a, const Task* b) { return a->q0 < b->q0; });
  std::vector<int64_t> cuts = {0, length};
  for (const Task* t : tasks) {
    cuts.push_back(t->q0);
    cuts.push_back(t->q1);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<const Task*> active;
  size_t next = 0;
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const int64_t a = cuts[c];
    const int64_t b = cuts[c + 1];
    std::erase_if(active, [&](const Task* t) { return t->q1 <= a; });
    while (next < tasks.size() && tasks[next]->q0 == a) active.push_back(tasks[next++]);
    const Task* causal = nullptr;
    std::vector<const Task*> prefix;
    for (const Task* t : active) {
      if (t->is_causal()) {
        if (causal != nullptr) {
          return invalid_argument(fmt::format("document {} rows [{}, {}): covered twice, by {} and {}",
                                              doc, a, b, describe(*causal), describe(*t)));
        }
        causal = t;
      } else {
        prefix.push_back(t);
      }
    }
    if (causal == nullptr) {
      return invalid_argument(fmt::format(
          "document {} rows [{}, {}): the diagonal key (each row's own position) is not covered",
          doc, a, b));
    }
    std::sort(prefix.begin(), prefix.end(), [](const Task* x, const Task* y) { return x->k0 < y->k0; });
    int64_t at = 0;
    for (const Task* t : prefix) {
      if (t->k0 != at) {
        return invalid_argument(fmt::format("document {} rows [{}, {}): keys from {} are {} ({})",
                                            doc, a, b, std::min(at, t->k0),
                                            t->k0 > at ? "not covered" : "covered twice", describe(*t)));
      }
      at = t->k1;
    }
    if (causal->k0 != at) {
      return invalid_argument(fmt::format("document {} rows [{}, {}): keys from {} are {} ({})", doc, a,
                                          b, std::min(at, causal->k0),
                                          causal->k0 > at ? "not covered" : "covered twice",
                                          describe(*causal)));
    }
  }
  return Status::ok();
}

}  // namespace

Status verify_tasks(const Batch& batch, const std::vector<Task>& tasks) {
  std::vector<std::vector<const Task*>> by_doc(batch.num_docs());
  for (const Task& t : tasks) {
    DISTCA_RETURN_IF_ERROR(check_well_formed(batch, t));
    by_doc[t.doc].push_back(&t);
  }
  for (int32_t d = 0; d < batch.num_docs(); ++d) {
    DISTCA_RETURN_IF_ERROR(check_document(batch, d, by_doc[d]));
  }
  return Status::ok();
}

Status verify_task_shapes(const Batch& batch, const std::vector<Task>& tasks) {
  for (const Task& t : tasks) DISTCA_RETURN_IF_ERROR(check_well_formed(batch, t));
  return Status::ok();
}

}  // namespace distca::plan
