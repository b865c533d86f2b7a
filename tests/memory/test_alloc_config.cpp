// TALLY_ALLOC_CONF parsing: PyTorch's syntax, clear errors naming the key.
#include <gtest/gtest.h>

#include <cstdlib>

#include "memory/alloc_config.h"

namespace tally::memory {
namespace {

std::string error_of(const std::string& conf) {
  try {
    AllocatorConfig::parse(conf);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(AllocConfig, Defaults) {
  const AllocatorConfig c = AllocatorConfig::parse("");
  EXPECT_FALSE(c.max_split_size_set());
  EXPECT_EQ(c.garbage_collection_threshold, 0.0);
  for (size_t d : c.roundup_power2_divisions) EXPECT_EQ(d, 0u);
}

TEST(AllocConfig, ParsesPyTorchSyntax) {
  const AllocatorConfig c = AllocatorConfig::parse(
      "max_split_size_mb:128, roundup_power2_divisions:4,garbage_collection_threshold:0.6");
  EXPECT_EQ(c.max_split_size, 128 * kMiB);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.6);
  for (size_t d : c.roundup_power2_divisions) EXPECT_EQ(d, 4u);
  EXPECT_EQ(AllocatorConfig::parse("max_split_size_mb:5").max_split_size, 20 * kMiB);  // min 20
}

TEST(AllocConfig, DivisionsPerInterval) {
  const AllocatorConfig c = AllocatorConfig::parse("roundup_power2_divisions:[64:8,256:4,>:1]");
  EXPECT_EQ(c.roundup_power2_divisions[0], 8u);  // below the first key gets its value
  EXPECT_EQ(c.roundup_power2_divisions[6], 8u);  // 64 MiB = 2^6
  EXPECT_EQ(c.roundup_power2_divisions[7], 0u);
  EXPECT_EQ(c.roundup_power2_divisions[8], 4u);  // 256 MiB
  EXPECT_EQ(c.roundup_power2_divisions[9], 1u);
  EXPECT_EQ(c.roundup_power2_divisions[15], 1u);
  EXPECT_EQ(c.divisions_for(100 * kMiB), 8u);  // [64, 128) MiB is index 6
  EXPECT_EQ(c.divisions_for(200 * kMiB), 0u);  // [128, 256) MiB was not given
  EXPECT_EQ(c.divisions_for(65 * kMiB), 8u);
  EXPECT_EQ(c.divisions_for(300 * kMiB), 4u);
}

TEST(AllocConfig, ErrorsNameTheKey) {
  EXPECT_NE(error_of("max_split_size_mb:abc").find("max_split_size_mb"), std::string::npos);
  EXPECT_NE(error_of("roundup_power2_divisions:3").find("roundup_power2_divisions"),
            std::string::npos);
  EXPECT_NE(error_of("roundup_power2_divisions:[63:2]").find("power of 2"), std::string::npos);
  EXPECT_NE(error_of("garbage_collection_threshold:1.5").find("garbage_collection_threshold"),
            std::string::npos);
  EXPECT_NE(error_of("no_such_key:1").find("unknown key 'no_such_key'"), std::string::npos);
  EXPECT_NE(error_of("max_split_size_mb").find("key:value"), std::string::npos);
  EXPECT_NE(error_of("expandable_segments:yes")
                .find("bad value 'yes' for key "
                      "'expandable_segments': expected True or False"),
            std::string::npos);
  EXPECT_NE(error_of("expandable_segments:").find("expandable_segments"), std::string::npos);
  EXPECT_EQ(error_of("expandable_segments:False,backend:native"), "");
}

TEST(AllocConfig, ExpandableSegments) {
  EXPECT_FALSE(AllocatorConfig::parse("").expandable_segments);
  EXPECT_TRUE(AllocatorConfig::parse("expandable_segments:True").expandable_segments);
  EXPECT_FALSE(AllocatorConfig::parse("expandable_segments:False").expandable_segments);
  // PyTorch's spelling, and the other boolean keys' spellings Tally accepts.
  EXPECT_TRUE(AllocatorConfig::parse(" expandable_segments: true ").expandable_segments);
  EXPECT_TRUE(AllocatorConfig::parse("expandable_segments:1").expandable_segments);
  const AllocatorConfig c = AllocatorConfig::parse(
      "max_split_size_mb:64,expandable_segments:True,large_segment_size_mb:4");
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_EQ(c.max_split_size, 64 * kMiB);
  EXPECT_EQ(c.large_segment_size, 4 * kMiB);
  // reclaim_on_growth (Tally's) needs expandable segments.
  EXPECT_FALSE(AllocatorConfig::parse("expandable_segments:True").reclaim_on_growth);
  EXPECT_TRUE(
      AllocatorConfig::parse("expandable_segments:True,reclaim_on_growth:True").reclaim_on_growth);
  EXPECT_THROW(AllocatorConfig::parse("reclaim_on_growth:True"), std::invalid_argument);
  EXPECT_THROW(AllocatorConfig::parse("expandable_segments:True,reclaim_on_growth:maybe"),
               std::invalid_argument);
  EXPECT_NO_THROW(AllocatorConfig::parse("reclaim_on_growth:False"));
  // A key given twice is refused, as every key (issue 54: the last one won silently).
  EXPECT_THROW(AllocatorConfig::parse("expandable_segments:True,expandable_segments:False"),
               std::invalid_argument);
}

TEST(AllocConfig, FromEnvironment) {
  setenv("TALLY_ALLOC_CONF", "max_split_size_mb:64", 1);
  EXPECT_EQ(AllocatorConfig::from_env().max_split_size, 64 * kMiB);
  EXPECT_EQ(AllocatorConfig::from_env().settings, "max_split_size_mb:64");
  setenv("TALLY_ALLOC_CONF", "max_split_size_mb:x", 1);
  EXPECT_THROW(AllocatorConfig::from_env(), std::invalid_argument);
  unsetenv("TALLY_ALLOC_CONF");
}

// Issue 54: a key given twice took the last value silently; now refused, naming the key.
TEST(AllocConfig, DuplicateKeysAreRefused) {
  const std::string e =
      error_of("max_split_size_mb:64,garbage_collection_threshold:0.5, max_split_size_mb :128");
  EXPECT_NE(e.find("key 'max_split_size_mb' is given twice"), std::string::npos) << e;
  EXPECT_NE(error_of("expandable_segments:True,expandable_segments:True").find("given twice"),
            std::string::npos);
  const std::string i = error_of("roundup_power2_divisions:[64:8,64:4]");
  EXPECT_NE(i.find("interval '64' is given twice"), std::string::npos) << i;
  EXPECT_NE(error_of("roundup_power2_divisions:[>:8,>:4]").find("given twice"), std::string::npos);
  EXPECT_EQ(error_of("max_split_size_mb:64,roundup_power2_divisions:[64:8,128:4]"), "");
}

// Issue 54: roundup_power2_divisions:9223372036854775808 (2^63) was accepted; the divisions are
// 0 or a power of 2 up to 2^30, in both forms.
TEST(AllocConfig, DivisionsAreRangeChecked) {
  for (const char* conf :
       {"roundup_power2_divisions:9223372036854775808", "roundup_power2_divisions:2147483648",
        "roundup_power2_divisions:[64:2147483648]",
        "roundup_power2_divisions:[>:9223372036854775808]"}) {
    const std::string e = error_of(conf);
    EXPECT_NE(e.find("roundup_power2_divisions"), std::string::npos) << conf << ": " << e;
    EXPECT_NE(e.find("at most 2^30"), std::string::npos) << conf << ": " << e;
  }
  EXPECT_NE(error_of("roundup_power2_divisions:18446744073709551616").find("non-negative integer"),
            std::string::npos);
  const AllocatorConfig c = AllocatorConfig::parse("roundup_power2_divisions:1073741824");
  EXPECT_EQ(c.roundup_power2_divisions[3], kMaxRoundupDivisions);
  EXPECT_EQ(error_of("roundup_power2_divisions:[1:0,>:64]"), "");
}

}  // namespace
}  // namespace tally::memory
