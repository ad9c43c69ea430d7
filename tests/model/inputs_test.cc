// Training inputs: learning-rate schedules, data identity and epochs, held-out documents, and
// checkpoint headers that are range- and type-checked.
#include <gtest/gtest.h>
