// The protocol's sequence table alone, over a session store (no server):
// lookups and their errors, a start replacing an open sequence, sequences
// whose sessions are gone, the per-model cap, forks of another model's
// sequence and erasing only what is still recorded.
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "core/decode_session.h"
#include "core/session_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/sequences.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

SequenceId Number(uint64_t number) {
  SequenceId id;
  id.number = number;
  return id;
}

SequenceId Text(std::string text) {
  SequenceId id;
  id.is_string = true;
  id.text = std::move(text);
  return id;
}

class SequenceTableTest : public ::testing::Test {
 protected:
  SequenceTableTest() : store_(StoreOptions()) {}

  static SessionStore::Options StoreOptions() {
    SessionStore::Options options;
    options.max_bytes = size_t{64} << 20;
    return options;
  }

  // A new session in the store.
  std::string NewSession() {
    DecodeSessionConfig config;
    config.num_heads = 1;
    config.key_dim = 8;
    config.max_length = 16;
    auto session = DecodeSession::Create(config);
    EXPECT_TRUE(session.ok()) << session.status();
    auto id = store_.Add(std::move(*session));
    EXPECT_TRUE(id.ok()) << id.status();
    return *id;
  }

  SessionStore store_;
};

TEST_F(SequenceTableTest, FindsWhatWasInsertedAndNamesTheStartFlagElse) {
  SequenceTable table(&store_, nullptr, 16);
  const absl::StatusOr<std::string> none =
      table.Find("attention_session", Number(42));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(none.status().message()),
            "sequence_id: inference request for sequence 42 to "
            "model 'attention_session' must specify the START flag on the "
            "first request of the sequence");

  const std::string session = NewSession();
  ASSERT_TRUE(table.Insert("attention_session", Number(42), session).ok());
  EXPECT_EQ(*table.Find("attention_session", Number(42)), session);
  // 42 and "42" are different sequences, and so are other models'.
  EXPECT_FALSE(table.Find("attention_session", Text("42")).ok());
  EXPECT_FALSE(table.Find("demo_session", Number(42)).ok());
  EXPECT_EQ(table.size("attention_session"), 1u);
}

TEST_F(SequenceTableTest, AStartReplacesAnOpenSequenceAndFreesItsSession) {
  SequenceTable table(&store_, nullptr, 16);
  const std::string first = NewSession();
  const std::string second = NewSession();
  ASSERT_TRUE(table.Insert("attention_session", Text("a"), first).ok());
  ASSERT_TRUE(table.Insert("attention_session", Text("a"), second).ok());
  EXPECT_EQ(*table.Find("attention_session", Text("a")), second);
  EXPECT_EQ(store_.Find(first).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_.Find(second).ok());
  EXPECT_EQ(table.size("attention_session"), 1u);
}

TEST_F(SequenceTableTest, ASequenceWhoseSessionIsGoneSaysWhyUntilItStarts) {
  SequenceTable table(&store_, nullptr, 16);
  const std::string session = NewSession();
  ASSERT_TRUE(table.Insert("attention_session", Number(7), session).ok());
  ASSERT_TRUE(store_.Delete(session).ok());
  for (int i = 0; i < 2; ++i) {  // the same answer every time
    const absl::Status gone =
        table.Find("attention_session", Number(7)).status();
    EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(gone.message(), HasSubstr("sequence_id: sequence 7 of model "
                                          "'attention_session' is gone ("));
    EXPECT_THAT(gone.message(), HasSubstr("was deleted"));
    EXPECT_THAT(gone.message(), HasSubstr("send its first request again with "
                                          "sequence_start"));
  }
  // A start begins it again.
  const std::string again = NewSession();
  ASSERT_TRUE(table.Insert("attention_session", Number(7), again).ok());
  EXPECT_EQ(*table.Find("attention_session", Number(7)), again);
}

TEST_F(SequenceTableTest, AFullModelRefusesUntilASessionIsGone) {
  SequenceTable table(&store_, nullptr, 16, /*max_per_model=*/2);
  const std::string one = NewSession();
  ASSERT_TRUE(table.Insert("attention_session", Number(1), one).ok());
  ASSERT_TRUE(table.Insert("attention_session", Number(2), NewSession()).ok());
  const absl::Status full =
      table.Insert("attention_session", Number(3), NewSession());
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(std::string(full.message()),
            "sequence_id: model 'attention_session' holds 2 open "
            "sequences, the most one model may; end some with sequence_end "
            "first");
  // A restart of an open sequence is no new sequence; another model has
  // room of its own.
  EXPECT_TRUE(table.Insert("attention_session", Number(2), NewSession()).ok());
  EXPECT_TRUE(table.Insert("demo_session", Number(3), NewSession()).ok());
  // Once a session is gone, the full table sweeps its sequence.
  ASSERT_TRUE(store_.Delete(one).ok());
  EXPECT_TRUE(table.Insert("attention_session", Number(3), NewSession()).ok());
  EXPECT_EQ(table.size("attention_session"), 2u);
  EXPECT_EQ(table.Find("attention_session", Number(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SequenceTableTest, AForkOfAnotherModelsSequenceNamesThatModel) {
  SequenceTable table(&store_, nullptr, 16);
  ASSERT_TRUE(table.Insert("demo_session", Number(40), NewSession()).ok());
  const absl::Status other =
      table.FindParent("attention_session", Number(40), Number(43)).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(other.message()),
            "sequence_fork: inference request for sequence 43 to "
            "model 'attention_session' forks sequence 40, which is a "
            "sequence of model 'demo_session'; a fork continues a sequence "
            "of its own model");
  const absl::Status none =
      table.FindParent("attention_session", Number(41), Number(43)).status();
  EXPECT_THAT(none.message(),
              HasSubstr("forks sequence 41, which has not been started or "
                        "has ended"));
  EXPECT_TRUE(table.FindParent("demo_session", Number(40), Number(43)).ok());
}

TEST_F(SequenceTableTest, EraseForgetsOnlyTheSessionStillRecorded) {
  SequenceTable table(&store_, nullptr, 16);
  const std::string old_session = NewSession();
  const std::string new_session = NewSession();
  ASSERT_TRUE(table.Insert("attention_session", Number(5), old_session).ok());
  ASSERT_TRUE(table.Insert("attention_session", Number(5), new_session).ok());
  // An end that raced with a restart must not forget the new sequence.
  table.Erase("attention_session", Number(5), old_session);
  EXPECT_EQ(*table.Find("attention_session", Number(5)), new_session);
  table.Erase("attention_session", Number(5), new_session);
  EXPECT_EQ(table.size("attention_session"), 0u);
}

}  // namespace
}  // namespace attnserve
