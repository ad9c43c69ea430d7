// The table of DISTCA_* knobs (core/knobs.h): knob() refuses a name the table lacks, the defaults
// that restate a constant agree with it, and the warning for unknown variables names each one once
// with the nearest known name. tests/knobs/knobs.cmake checks the table against the tree.
#include "distca/core/knobs.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "distca/core/file.h"
#include "distca/core/progress.h"

namespace distca {
namespace {

TEST(Knobs, EachNameOnceEachWithDefaultMeaningAndUsers) {
  std::set<std::string> names;
  for (const Knob& k : knobs()) {
    EXPECT_TRUE(std::string_view(k.name).starts_with("DISTCA_")) << k.name;
    EXPECT_TRUE(names.insert(k.name).second) << k.name << " twice";
    EXPECT_NE(std::string_view(k.default_text), "") << k.name << ": \"unset\" where absence is the default";
    EXPECT_TRUE(std::string_view(k.meaning).ends_with(".")) << k.name << ": a sentence";
    EXPECT_FALSE(knob_user_names(k.users).empty()) << k.name;
    EXPECT_EQ(find_knob(k.name), &k);
  }
  EXPECT_EQ(find_knob("DISTCA_CPU_ISAA"), nullptr);
  EXPECT_EQ(find_knob(""), nullptr);
}

TEST(Knobs, DefaultsAgreeWithTheConstantsTheyRestate) {
  EXPECT_EQ(find_knob(kMaxInputEnv)->default_text, std::to_string(kDefaultMaxInputMiB));
  std::ostringstream interval;
  interval << kDefaultProgressInterval;
  EXPECT_EQ(find_knob(kProgressIntervalEnv)->default_text, interval.str());
}

TEST(Knobs, KnobReadsTheEnvironment) {
  ::unsetenv("DISTCA_TEST_KEEP");
  EXPECT_EQ(knob("DISTCA_TEST_KEEP"), nullptr);
  ::setenv("DISTCA_TEST_KEEP", "1", 1);
  ASSERT_NE(knob("DISTCA_TEST_KEEP"), nullptr);
  EXPECT_STREQ(knob("DISTCA_TEST_KEEP"), "1");
  ::unsetenv("DISTCA_TEST_KEEP");
}

TEST(KnobsDeathTest, KnobRefusesANameNotInTheTable) {
  EXPECT_DEATH((void)knob("DISTCA_NOT_IN_THE_TABLE"),
               "DISTCA_NOT_IN_THE_TABLE is not in the table of knobs: add it to src/core/knobs.cc");
  EXPECT_DEATH((void)knob("OPENBLAS_CORETYPE"), "OPENBLAS_CORETYPE is not in the table of knobs");
}

TEST(Knobs, AKnownOrForeignNameGivesNoWarning) {
  const std::vector<std::string> names = {"DISTCA_CPU_ISA", "DISTCA_SHARED_DATA", "OPENBLAS_CORETYPE", "RANK"};
  EXPECT_EQ(unknown_knobs_warning(names), "");
  EXPECT_EQ(unknown_knobs_warning({}), "");
}

TEST(Knobs, AnUnknownNameIsOneLineWithTheNearestKnownOne) {
  const std::vector<std::string> typo = {"DISTCA_CPU_ISAA"};
  EXPECT_EQ(unknown_knobs_warning(typo),
            "distca: warning: DISTCA_CPU_ISAA is not a distca setting (did you mean DISTCA_CPU_ISA? distca --help-env "
            "lists them)");
  const std::vector<std::string> far = {"DISTCA_FOO"};  // 3 edits from DISTCA_BIN: no guess
  EXPECT_EQ(unknown_knobs_warning(far),
            "distca: warning: DISTCA_FOO is not a distca setting (distca --help-env lists them)");
}

TEST(Knobs, SeveralUnknownNamesAreOneLineEachNamedOnce) {
  const std::vector<std::string> names = {"DISTCA_MAX_INPUT_MIB", "DISTCA_CPU_ISA", "DISTCA_FOO", "DISTCA_FOO"};
  const std::string line = unknown_knobs_warning(names);
  EXPECT_EQ(line,
            "distca: warning: DISTCA_MAX_INPUT_MIB (did you mean DISTCA_MAX_INPUT_MB?), DISTCA_FOO are not distca "
            "settings (distca --help-env lists them)");
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(Knobs, TheEnvironmentsDistcaNamesAreRead) {
  ::setenv("DISTCA_KNOB_TEST_PLANTED", "1", 1);
  const std::vector<std::string> names = distca_names_in_environment();
  ::unsetenv("DISTCA_KNOB_TEST_PLANTED");
  EXPECT_NE(std::find(names.begin(), names.end(), "DISTCA_KNOB_TEST_PLANTED"), names.end());
  for (const std::string& n : names) EXPECT_TRUE(n.starts_with("DISTCA_")) << n;
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
}

TEST(Knobs, EditDistance) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("plan", ""), 4u);
  EXPECT_EQ(edit_distance("plna", "plan"), 2u);
  EXPECT_EQ(edit_distance("DISTCA_CPU_ISAA", "DISTCA_CPU_ISA"), 1u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
}

TEST(Knobs, HelpTextListsEveryKnobWithinItsWidth) {
  const std::string text = knobs_help_text(100);
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) EXPECT_LE(line.size(), 100u) << line;
  for (const Knob& k : knobs()) {
    EXPECT_NE(text.find("\n  " + std::string(k.name) + " "), std::string::npos) << k.name;
  }
  const nlohmann::json j = nlohmann::json::parse(knobs_json_text());
  EXPECT_EQ(j["format"], kKnobsFormat);
  EXPECT_EQ(j["version"], kKnobsFormatVersion);
  ASSERT_EQ(j["knobs"].size(), knobs().size());
  EXPECT_EQ(j["knobs"][0]["name"], knobs()[0].name);
}

}  // namespace
}  // namespace distca
