#include "distca/plan/batch.h"
#include "distca/plan/verify.h"
#include "distca/plan/planner.h"

#include <gtest/gtest.h>

namespace distca::plan {
namespace {

TEST(PackDocuments, OverflowingDocumentBecomesPieces) {
  Batch b = pack_documents({5, 12, 3}, /*ranks=*/3, /*tokens=*/8).value();
  ASSERT_TRUE(b.validate().is_ok());
  EXPECT_EQ(b.doc_lengths, (std::vector<int64_t>{5, 12, 3}));
  // rank 0: doc0 [0,5) + doc1 [0,3); rank 1: doc1 [3,11); rank 2: doc1 [11,12) + doc2.
  ASSERT_EQ(b.pieces.size(), 5u);
  EXPECT_EQ(b.pieces[1].doc, 1);
  EXPECT_EQ(b.pieces[1].end, 3);
  EXPECT_EQ(b.pieces[2].rank, 1);
  EXPECT_EQ(b.pieces[2].length(), 8);
  EXPECT_EQ(b.doc_pieces[1].size(), 3u);
  EXPECT_EQ(b.total_tokens(), 20);
}

TEST(PackDocuments, CutsTheLastDocumentWhenFull) {
  Batch b = pack_documents({10, 10}, 1, 6).value();
  EXPECT_EQ(b.doc_lengths, (std::vector<int64_t>{6}));
  EXPECT_TRUE(b.validate().is_ok());
}

TEST(PackDocuments, RejectsBadSizes) {
  EXPECT_FALSE(pack_documents({1}, 0, 8).is_ok());
  EXPECT_FALSE(pack_documents({1}, 2, 0).is_ok());
  EXPECT_FALSE(pack_documents({3, 0}, 2, 8).is_ok());
  EXPECT_FALSE(pack_documents({-3}, 2, 8).is_ok());
  EXPECT_FALSE(pack_documents({1}, 1 << 20, 1 << 20).is_ok());  // 2^40 tokens: pair counts overflow
}

TEST(BatchFromRanks, EmptyRanksAndDerivedTokensPerRank) {
  Batch b = batch_from_ranks({{3, 4}, {}, {9}}, 0).value();
  EXPECT_EQ(b.num_ranks, 3);
  EXPECT_EQ(b.tokens_per_rank, 9);
  EXPECT_TRUE(b.validate().is_ok());
  EXPECT_FALSE(batch_from_ranks({{3, 4}, {9}}, 8).is_ok());  // rank 1 over T
  EXPECT_FALSE(batch_from_ranks({}, 8).is_ok());
  EXPECT_FALSE(batch_from_ranks({{kMaxTokens + 1}}, 0).is_ok());
}

TEST(BatchFromRanks, RanksMayHoldDifferentTokenCounts) {
  Batch b = batch_from_ranks({{100, 28}, {1000}, {7}}, 0).value();
  EXPECT_EQ(b.tokens_per_rank, 1000);  // the largest rank's
  EXPECT_TRUE(b.validate().is_ok());
  Batch capped = batch_from_ranks({{100, 28}, {1000}, {7}}, 4096).value();
  EXPECT_EQ(capped.tokens_per_rank, 4096);  // a capacity every rank fits in
}

TEST(ParseBatchJson, AcceptsTheDocumentedShapeAndNamesErrors) {
  Batch b = parse_batch_json(R"({"ranks": [[4, 4], [8]]})", 8, "b.json").value();
  EXPECT_EQ(b.num_docs(), 3);
  auto bad = parse_batch_json("{\"ranks\": [[4, ", 8, "b.json");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("b.json: malformed JSON"), std::string::npos);
  EXPECT_FALSE(parse_batch_json(R"({"rank": [[4]]})", 8, "b").is_ok());
  EXPECT_FALSE(parse_batch_json(R"({"ranks": [4]})", 8, "b").is_ok());
  EXPECT_FALSE(parse_batch_json(R"({"ranks": [["4"]]})", 8, "b").is_ok());
  EXPECT_FALSE(parse_batch_json(R"({"ranks": [[0]]})", 8, "b").is_ok());
}

// Each refusal names the file and the rank, and says what was expected.
TEST(ParseBatchJson, RefusesEmptyRanksAndBadLengthsNamingTheRank) {
  struct Case {
    const char* text;
    const char* expected;
  };
  const Case cases[] = {
      {R"({"ranks": [[], []]})", "b.json: rank 0 lists no documents"},
      {R"({"ranks": [[4], [4], []]})", "b.json: rank 2 lists no documents"},
      {R"({"ranks": []})", "b.json: a batch needs at least one rank"},
      {R"({"ranks": [[4, 0]]})", "b.json: rank 0 document 1 has length 0, expected a positive integer"},
      {R"({"ranks": [[4], [-2]]})", "b.json: rank 1 document 0 has length -2"},
      {R"({"ranks": [[2.5]]})", "b.json: rank 0 document 0 has length 2.5"},
      {R"({"ranks": [[4.0]]})", "expected a positive integer"},
      {R"({"ranks": [[true]]})", "expected a positive integer"},
      {R"({"ranks": [[null]]})", "expected a positive integer"},
      {R"({"ranks": [[18446744073709551615]]})", "b.json: rank 0 document 0 has length 18446744073709551615, more than"},
      {R"({"ranks": [[2147483648]]})", "more than 2147483647 tokens"},
      {R"({"ranks": [{"docs": [4]}]})", "b.json: rank 0 is {\"docs\":[4]}, expected an array"},
      {R"({"ranks": [[4]], "seed": 3})", "b.json: unknown key \"seed\""},
      // A step holds at most 2^31 - 1 tokens in all (sums of causal pairs stay within 64 bits).
      {R"({"ranks": [[2147483647], [1]]})", "b.json: more than 2147483647 tokens in the batch"},
  };
  for (const Case& c : cases) {
    auto r = parse_batch_json(c.text, 0, "b.json");
    ASSERT_FALSE(r.is_ok()) << c.text;
    EXPECT_NE(r.status().message().find(c.expected), std::string::npos) << c.text << ": " << r.status().message();
  }
  // The largest accepted length and unequal ranks are fine.
  Batch b = parse_batch_json(R"({"ranks": [[2147483647]]})", 0, "b.json").value();
  EXPECT_EQ(b.tokens_per_rank, kMaxTokens);
  Batch c = parse_batch_json(R"({"ranks": [[2147483646], [1]]})", 0, "b.json").value();
  EXPECT_EQ(c.tokens_per_rank, kMaxTokens - 1);
}

TEST(BatchValidate, CatchesGapsAndOverfullRanks) {
  Batch b = batch_from_ranks({{4}, {4}}, 4).value();
  b.pieces[1].begin = 1;  // doc 1 no longer starts at 0
  b.index();
  EXPECT_FALSE(b.validate().is_ok());
  Batch c = batch_from_ranks({{4}, {4}}, 4).value();
  c.tokens_per_rank = 3;
  EXPECT_FALSE(c.validate().is_ok());
}

// Pipeline CAD pools the micro-batches of the active stages: documents keep their order and
// their origin, pieces move to the stage's ranks, idle ranks hold nothing, and every planner's
// plan of the pool passes the verifier (every causal pair of every document exactly once).
TEST(PoolBatches, PlacesEachPartOnItsStagesRanksAndPlansVerify) {
  const Batch a = pack_documents({300, 500, 224}, 2, 512).value();  // stage 0's micro-batch 3 (2 ranks)
  const Batch b = pack_documents({1024}, 2, 512).value();           // stage 2's micro-batch 1
  const auto pool = pool_batches({{&a, 0, 0, 3}, {&b, 4, 2, 1}}, 6, 512).value();
  EXPECT_EQ(pool.batch.num_ranks, 6);
  EXPECT_EQ(pool.batch.doc_lengths, (std::vector<int64_t>{300, 500, 224, 1024}));
  ASSERT_EQ(pool.origin.size(), 4u);
  EXPECT_EQ(pool.origin[1].stage, 0);
  EXPECT_EQ(pool.origin[1].micro_batch, 3);
  EXPECT_EQ(pool.origin[1].doc, 1);
  EXPECT_EQ(pool.origin[3].stage, 2);
  EXPECT_EQ(pool.origin[3].micro_batch, 1);
  EXPECT_EQ(pool.origin[3].doc, 0);
  std::vector<int64_t> tokens(6, 0);
  for (const Piece& p : pool.batch.pieces) tokens[p.rank] += p.length();
  EXPECT_EQ(tokens, (std::vector<int64_t>{512, 512, 0, 0, 512, 512}));
  for (size_t i = 1; i < pool.batch.pieces.size(); ++i) EXPECT_LE(pool.batch.pieces[i - 1].rank, pool.batch.pieces[i].rank);
  const CostModel cost(model_preset("llama-8b").value(), ThroughputProfile{});
  for (const std::string& name : planner_names()) {
    const Plan plan = find_planner(name).value()(pool.batch, cost, PlannerOptions{}).value();
    EXPECT_TRUE(verify_tasks(pool.batch, plan.tasks).is_ok()) << name;
  }
  // Parts that overlap, overflow the pool or its ranks' tokens are refused; no part is an empty pool.
  EXPECT_NE(pool_batches({{&a, 0, 0, 0}, {&b, 1, 1, 0}}, 6, 512).status().message().find("share rank 1"), std::string::npos);
  EXPECT_NE(pool_batches({{&a, 5, 0, 0}}, 6, 512).status().message().find("not within the pool's 6"), std::string::npos);
  EXPECT_FALSE(pool_batches({{&a, 0, 0, 0}}, 6, 256).is_ok());
  EXPECT_FALSE(pool_batches({{nullptr, 0, 0, 0}}, 6, 512).is_ok());
  const auto empty = pool_batches({}, 3, 512);
  ASSERT_TRUE(empty.is_ok()) << empty.status().message();
  EXPECT_EQ(empty.value().batch.num_docs(), 0);
}

}  // namespace
}  // namespace distca::plan
