// The plan verifier: proves that a task list computes every causal (query, key) pair of every
// document exactly once, and that every task is well formed. Every plan a test makes goes
// through it.
#pragma once

#include <vector>

#include "distca/core/status.h"
#include "distca/plan/batch.h"
#include "distca/plan/plan.h"

namespace distca::plan {

// Ok, or the first violation found, naming the document, rows and task.
Status verify_tasks(const Batch& batch, const std::vector<Task>& tasks);

// Ok, or the first task that is not well formed (document, query and key ranges, server); says
// nothing of coverage. For a part of a verified task list (a ping-pong nano-batch).
Status verify_task_shapes(const Batch& batch, const std::vector<Task>& tasks);

}  // namespace distca::plan
