// minbytes with its receivers' soft intake raised (planner_minbytes.cc, step 3): the level is
// intake_scale times the water level that just covers the excess (capped at the largest room),
// so each sender sheds in fewer, larger blocks to fewer receivers: less on the sender's link,
// more on each receiver's. 1 is plan_minbytes (without its budget search). minlink's candidates.
#pragma once

#include "distca/plan/planner.h"

namespace distca::plan {

struct MinbytesShape {
  double intake_scale = 1.0;  // the soft intake's level over the water level (inf: the largest room)
  double host_fill = 0.0;     // > 0: senders with many receivers' worth of excess ship blocks of
                              // host_fill x cap to hosts that hand their own work on (a second hop)
  bool host_every = false;    // with hosts: every such sender, or only those that without would be
                              // about as busy as the busiest hosted one (reserve_hosts)
};

// passed_over: the senders the hosts were not for (host_every false), of the plan returned.
Result<Plan> plan_minbytes_shaped(const Batch& batch, const CostModel& cost, const PlannerOptions& options,
                                  const MinbytesShape& shape, std::vector<int32_t>* passed_over = nullptr);

}  // namespace distca::plan
