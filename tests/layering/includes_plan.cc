// Compiled by the layering tests: with core's include root alone this must fail to find the
// plan header (a lower layer cannot include a higher one); with plan's root it must compile.
#include "distca/plan/plan.h"

int main() { return distca::plan::causal_pairs(0, 1) == 1 ? 0 : 1; }
