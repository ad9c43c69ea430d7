#include "distca/plan/verify.h"

#include <gtest/gtest.h>

namespace distca::plan {
namespace {

Batch one_doc(int64_t len) { return batch_from_ranks({{len}, {}}, 0).value(); }

TEST(VerifyTasks, AcceptsShardsAndKeySplits) {
  Batch b = one_doc(10);
  EXPECT_TRUE(verify_tasks(b, {causal_task(0, 0, 10, 0)}).is_ok());
  EXPECT_TRUE(verify_tasks(b, {causal_task(0, 0, 3, 1), causal_task(0, 3, 10, 0)}).is_ok());
  // Rows [5,10) split by keys: [0,4) non-causal + [4, q] causal; rows [0,5) causal.
  std::vector<Task> split = {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 4, 1}, Task{0, 5, 10, 4, 10, 0}};
  EXPECT_TRUE(verify_tasks(b, split).is_ok());
  // Three-way key split of the same rows.
  std::vector<Task> three = {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 2, 1}, Task{0, 5, 10, 2, 4, 1},
                             Task{0, 5, 10, 4, 10, 0}};
  EXPECT_TRUE(verify_tasks(b, three).is_ok());
}

TEST(VerifyTasks, RejectsMissingRows) {
  Status s = verify_tasks(one_doc(10), {causal_task(0, 0, 4, 0), causal_task(0, 5, 10, 0)});
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("rows [4, 5)"), std::string::npos) << s.message();
  EXPECT_FALSE(verify_tasks(one_doc(10), {causal_task(0, 0, 9, 0)}).is_ok());
  EXPECT_FALSE(verify_tasks(one_doc(10), {}).is_ok());
}

TEST(VerifyTasks, RejectsDoubleCoverage) {
  Status s = verify_tasks(one_doc(10), {causal_task(0, 0, 6, 0), causal_task(0, 4, 10, 1)});
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("covered twice"), std::string::npos) << s.message();
  // A non-causal prefix that overlaps the causal part.
  EXPECT_FALSE(verify_tasks(one_doc(10), {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 4, 1},
                                          Task{0, 5, 10, 3, 10, 0}}).is_ok());
}

TEST(VerifyTasks, RejectsKeyGaps) {
  EXPECT_FALSE(verify_tasks(one_doc(10), {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 3, 1},
                                          Task{0, 5, 10, 4, 10, 0}}).is_ok());
  EXPECT_FALSE(verify_tasks(one_doc(10), {causal_task(0, 0, 5, 0), Task{0, 5, 10, 2, 10, 0}}).is_ok());
  // A gap, then an overlap, between two non-causal key ranges of the same rows.
  EXPECT_FALSE(verify_tasks(one_doc(10), {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 2, 1},
                                          Task{0, 5, 10, 3, 4, 1}, Task{0, 5, 10, 4, 10, 0}}).is_ok());
  EXPECT_FALSE(verify_tasks(one_doc(10), {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 3, 1},
                                          Task{0, 5, 10, 2, 4, 1}, Task{0, 5, 10, 4, 10, 0}}).is_ok());
}

TEST(VerifyTasks, RejectsMalformedTasks) {
  Batch b = one_doc(10);
  EXPECT_FALSE(verify_tasks(b, {causal_task(0, 0, 11, 0)}).is_ok());           // past the end
  EXPECT_FALSE(verify_tasks(b, {causal_task(0, 0, 10, 2)}).is_ok());           // no server 2
  EXPECT_FALSE(verify_tasks(b, {causal_task(1, 0, 10, 0)}).is_ok());           // no doc 1
  EXPECT_FALSE(verify_tasks(b, {Task{0, 5, 5, 0, 5, 0}}).is_ok());             // empty rows
  EXPECT_FALSE(verify_tasks(b, {causal_task(0, 0, 5, 0), Task{0, 5, 10, 0, 7, 1},
                                Task{0, 5, 10, 7, 10, 0}}).is_ok());            // keys past row 5
  EXPECT_FALSE(verify_tasks(b, {causal_task(0, 0, 5, 0), Task{0, 5, 10, 6, 10, 0}}).is_ok());  // k0 > q0
}

}  // namespace
}  // namespace distca::plan
