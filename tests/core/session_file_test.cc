// Session files (core/session_file.h): a session written and loaded back
// holds the same tokens, so that its next step answers bit for bit as the
// original's (every cache dtype, several layers, a fork reading shared
// blocks, an empty session); and a file that is truncated at any record
// boundary, has a flipped byte anywhere, another version, hostile dims,
// records out of order or non-finite rows is refused with DATA_LOSS (or
// its config's error) naming what is wrong, never loaded.
#include "core/session_file.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_kernel.h"
#include "core/checksum.h"
#include "core/decode_session.h"
#include "core/session_store.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core_test_util.h"

namespace attnserve::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBatch = 2;
constexpr int kHeads = 4;
constexpr int kKvHeads = 2;
constexpr int64_t kKeyDim = 16;
constexpr int64_t kValueDim = 8;

DecodeSessionConfig Config(DType dtype, int64_t layers) {
  DecodeSessionConfig config;
  config.num_layers = layers;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.key_dim = kKeyDim;
  config.value_dim = kValueDim;
  config.dtype = dtype == DType::kInt8 ? DType::kFloat32 : dtype;
  config.cache_dtype = dtype;
  config.rotary.dims = 8;  // positions matter
  config.default_scale = 0.3f;
  config.batch = kBatch;
  config.max_length = 4096;
  return config;
}

struct StepData {
  Tensor q, k, v;
};

StepData RandomStep(DType dtype, int64_t n, std::mt19937& rng) {
  const DType t = dtype == DType::kBFloat16 ? dtype : DType::kFloat32;
  return {RandomTensor(t, {kBatch, kHeads, n, kKeyDim}, rng),
          RandomTensor(t, {kBatch, kKvHeads, n, kKeyDim}, rng),
          RandomTensor(t, {kBatch, kKvHeads, n, kValueDim}, rng)};
}

absl::StatusOr<Tensor> RunStep(DecodeSession& s, const StepData& data,
                               int64_t layer = 0) {
  DecodeStepInputs in;
  in.layer = layer;
  in.query = data.q.view();
  in.key = data.k.view();
  in.value = data.v.view();
  TensorResults results;
  const absl::Status status = s.Step(in, DecodeStepOptions{}, results);
  if (!status.ok()) return status;
  return *results.Take("output");
}

std::string Write(const DecodeSession& session, absl::string_view id) {
  std::string bytes;
  const absl::Status written =
      WriteSessionFile(session, id, [&](absl::string_view piece) {
        bytes.append(piece.data(), piece.size());
        return absl::OkStatus();
      });
  EXPECT_TRUE(written.ok()) << written;
  return bytes;
}

// `bytes` loaded by `load` (LoadSessionFile or LoadSessionJournal) as file
// `name`, with a session budget of `max_bytes` (0: none).
template <typename LoadFunction>
absl::StatusOr<std::unique_ptr<DecodeSession>> LoadWith(
    LoadFunction load, absl::string_view bytes, absl::string_view name,
    SessionFileHeader* header, size_t max_bytes = 0) {
  SessionStore::Options options;
  options.max_bytes = max_bytes;
  SessionStore store(options);
  return load(bytes, name,
              {.layer_of = [](absl::string_view model)
                   -> absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> {
                 return absl::NotFoundError(absl::StrCat("no model ", model));
               },
               .verify =
                   [&](const DecodeSessionConfig& config) {
                     return store.VerifyConfig(config);
                   }},
              header);
}

absl::StatusOr<std::unique_ptr<DecodeSession>> Load(
    absl::string_view bytes, SessionFileHeader* header = nullptr,
    size_t max_bytes = 0) {
  return LoadWith(
      [](absl::string_view b, absl::string_view n, const SessionFileLoader& l,
         SessionFileHeader* h) { return LoadSessionFile(b, n, l, h); },
      bytes, "s.session", header, max_bytes);
}

// `bytes` taken by a SessionFileBuilder in pieces of `chunk` bytes (an
// import stream), as Load does, within a budget of `max_bytes`.
absl::StatusOr<std::unique_ptr<DecodeSession>> Build(
    absl::string_view bytes, size_t chunk, SessionFileHeader* header = nullptr,
    size_t max_bytes = 0) {
  return LoadWith(
      [chunk](absl::string_view b, absl::string_view n,
              const SessionFileLoader& l, SessionFileHeader* h)
          -> absl::StatusOr<std::unique_ptr<DecodeSession>> {
        SessionFileBuilder builder{std::string(n)};
        for (size_t at = 0; at < b.size(); at += chunk) {
          ATTN_RETURN_IF_ERROR(builder.Add(b.substr(at, chunk), l));
          EXPECT_EQ(builder.received(), std::min(b.size(), at + chunk));
        }
        if (h != nullptr && builder.header() != nullptr) {
          *h = *builder.header();
        }
        return builder.Release();
      },
      bytes, "s.session", header, max_bytes);
}

// The next step of `a` and of `b`, given the same inputs, agree bit for bit
// in every layer.
void ExpectSameNextSteps(DecodeSession& a, DecodeSession& b, DType dtype,
                         std::mt19937& rng) {
  for (int64_t layer = 0; layer < a.num_layers(); ++layer) {
    SCOPED_TRACE(absl::StrCat("layer ", layer));
    ASSERT_EQ(a.length(layer), b.length(layer));
    const StepData data = RandomStep(dtype, 3, rng);
    auto want = RunStep(a, data, layer);
    auto got = RunStep(b, data, layer);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->num_bytes(), want->num_bytes());
    EXPECT_EQ(std::memcmp(got->data(), want->data(), got->num_bytes()), 0);
  }
}

class SessionFileRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(SessionFileRoundTrip, ALoadedSessionStepsAsTheOriginal) {
  const DType dtype = GetParam();
  std::mt19937 rng(11);
  auto session = *DecodeSession::Create(Config(dtype, 3));
  // Layers of different lengths: within a block, across blocks, exactly
  // two blocks.
  const int64_t lengths[] = {300, 1300, 2 * kCacheBlockKeys};
  for (int64_t layer = 0; layer < 3; ++layer) {
    for (int64_t held = 0; held < lengths[layer];) {
      const int64_t n = std::min<int64_t>(700, lengths[layer] - held);
      ASSERT_TRUE(RunStep(*session, RandomStep(dtype, n, rng), layer).ok());
      held += n;
    }
  }
  const std::string bytes = Write(*session, "0123abcd");
  SessionFileHeader header;
  auto loaded = Load(bytes, &header);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(header.id, "0123abcd");
  EXPECT_EQ(header.lengths,
            std::vector<int64_t>(std::begin(lengths), std::end(lengths)));
  EXPECT_EQ((*loaded)->cache_dtype(), dtype);
  EXPECT_EQ((*loaded)->config().default_scale, 0.3f);
  EXPECT_EQ((*loaded)->cache_bytes(), session->cache_bytes());
  // Taken in pieces, as an import stream brings them.
  for (size_t chunk : {size_t{13}, size_t{4096}, size_t{1} << 20}) {
    SCOPED_TRACE(absl::StrCat("pieces of ", chunk));
    SessionFileHeader built_header;
    auto built = Build(bytes, chunk, &built_header);
    ASSERT_TRUE(built.ok()) << built.status();
    EXPECT_EQ(built_header.lengths, header.lengths);
    auto reference = Load(bytes);  // stepped with it, as `loaded` was not
    ASSERT_TRUE(reference.ok());
    ExpectSameNextSteps(**reference, **built, dtype, rng);
  }
  ExpectSameNextSteps(*session, **loaded, dtype, rng);
}

TEST(SessionFileImageTest, ReadsAtAnyOffsetGiveTheFileWritten) {
  std::mt19937 rng(12);
  auto session = *DecodeSession::Create(Config(DType::kInt8, 2));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kInt8, 1100, rng)).ok());
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kInt8, 70, rng), 1).ok());
  const std::string file = Write(*session, "0a1b");
  auto image = SessionFileImage::Of(*session, "0a1b");
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_EQ(image->size(), file.size());
  for (size_t piece : {size_t{1} << 20, size_t{4099}, size_t{100}}) {
    SCOPED_TRACE(absl::StrCat("pieces of ", piece));
    std::string read;
    // From the end backwards too: a resumed read starts anywhere.
    for (uint64_t at = 0; at < image->size();) {
      auto got = image->Read(at, piece);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_FALSE(got->empty());
      ASSERT_LE(got->size(), piece);
      read.append(got->data(), got->size());
      at += got->size();
    }
    EXPECT_TRUE(read == file);
    auto tail = image->Read(file.size() - 5, piece);
    ASSERT_TRUE(tail.ok());
    EXPECT_EQ(*tail, absl::string_view(file).substr(file.size() - 5));
  }
  auto end = image->Read(file.size(), 10);
  ASSERT_TRUE(end.ok());
  EXPECT_TRUE(end->empty());
  EXPECT_EQ(image->Read(file.size() + 1, 10).status().code(),
            absl::StatusCode::kOutOfRange);
}

TEST(SessionFileImageTest, AStepOrRewindBetweenReadsIsAborted) {
  std::mt19937 rng(13);
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 1));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 1100, rng)).ok());
  auto image = SessionFileImage::Of(*session, "ab");
  ASSERT_TRUE(image.ok());
  ASSERT_TRUE(image->Read(0, 100).ok());
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 1, rng)).ok());
  // The header was built already; the next record is read from the
  // session and refused.
  const auto after_step = image->Read(200, 100);
  EXPECT_EQ(after_step.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(after_step.status().message()),
              HasSubstr("the session changed"));
  // A new image of it reads; a rewind (a step at an earlier position)
  // then makes it stale again, though the length is what it was.
  image = SessionFileImage::Of(*session, "ab");
  ASSERT_TRUE(image.ok());
  DecodeStepInputs in;
  const StepData data = RandomStep(DType::kFloat32, 1, rng);
  in.query = data.q.view();
  in.key = data.k.view();
  in.value = data.v.view();
  in.position = 1100;
  TensorResults results;
  ASSERT_TRUE(session->Step(in, DecodeStepOptions{}, results).ok());
  EXPECT_EQ(session->length(), 1101);
  EXPECT_EQ(image->Read(image->size() - 20, 4).status().code(),
            absl::StatusCode::kAborted);
}

INSTANTIATE_TEST_SUITE_P(CacheDTypes, SessionFileRoundTrip,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16,
                                           DType::kInt8),
                         [](const auto& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(SessionFileTest, AForkIsWrittenWithTheSharedTokensItReads) {
  std::mt19937 rng(5);
  auto parent = *DecodeSession::Create(Config(DType::kFloat32, 1));
  ASSERT_TRUE(RunStep(*parent, RandomStep(DType::kFloat32, 1100, rng)).ok());
  auto fork = *parent->Fork(700);
  ASSERT_TRUE(RunStep(*fork, RandomStep(DType::kFloat32, 40, rng)).ok());
  ASSERT_TRUE(RunStep(*parent, RandomStep(DType::kFloat32, 9, rng)).ok());
  auto loaded = Load(Write(*fork, "f"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->length(), 740);
  EXPECT_TRUE((*loaded)->shared_caches().empty());
  ExpectSameNextSteps(*fork, **loaded, DType::kFloat32, rng);
}

TEST(SessionFileTest, Crc32cIsTheCastagnoliChecksum) {
  // The check value of CRC-32C, and the same in two pieces.
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(Crc32c("56789", Crc32c("1234")), 0xe3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  std::string long_input(1000, '\0');
  for (size_t i = 0; i < long_input.size(); ++i) {
    long_input[i] = static_cast<char>(i * 7);
  }
  EXPECT_EQ(Crc32c(long_input.substr(3)),
            Crc32c(long_input.substr(500), Crc32c(long_input.substr(3, 497))));
  // The CPU's instruction (where it has one) and the table agree, at
  // every length and alignment.
  EXPECT_EQ(Crc32cPortable("123456789"), 0xe3069283u);
  for (size_t start = 0; start < 9; ++start) {
    for (size_t length : {0, 1, 7, 8, 9, 63, 64, 65, 991}) {
      const absl::string_view piece =
          absl::string_view(long_input).substr(start, length);
      EXPECT_EQ(Crc32c(piece, 0x1234u), Crc32cPortable(piece, 0x1234u))
          << start << " " << length;
    }
  }
}

TEST(SessionFileTest, AnEmptySessionRoundTrips) {
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 2));
  auto loaded = Load(Write(*session, "e"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->length(0), 0);
  EXPECT_EQ((*loaded)->num_layers(), 2);
}

// The bytes of a two-layer float32 session of 600 and 100 tokens, and
// where each of its records starts.
struct SampleFile {
  std::string bytes;
  std::vector<size_t> record_starts;  // blocks, then the end record
  size_t body_size = 0;
};

SampleFile Sample() {
  std::mt19937 rng(3);
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 2));
  EXPECT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 600, rng)).ok());
  EXPECT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 100, rng), 1).ok());
  SampleFile sample;
  sample.bytes = Write(*session, "sample");
  std::memcpy(&sample.body_size, sample.bytes.data() + 12, 4);
  size_t at = 16 + sample.body_size + 4;
  for (int64_t tokens :
       {kCacheBlockKeys, 600 - kCacheBlockKeys, int64_t{100}}) {
    sample.record_starts.push_back(at);
    at += 28 + session->RowBytes(tokens);
  }
  sample.record_starts.push_back(at);
  return sample;
}

uint32_t Crc(absl::string_view bytes) { return Crc32c(bytes); }

// `sample` with its header body changed by `edit`, the checksum redone:
// what a hostile writer can make.
std::string WithHeader(const SampleFile& sample,
                       const std::function<void(std::string&)>& edit) {
  std::string body = sample.bytes.substr(16, sample.body_size);
  edit(body);
  std::string out = sample.bytes.substr(0, 12);
  const uint32_t size = static_cast<uint32_t>(body.size());
  const uint32_t crc = Crc(body);
  out.append(reinterpret_cast<const char*>(&size), 4);
  out += body;
  out.append(reinterpret_cast<const char*>(&crc), 4);
  out += sample.bytes.substr(16 + sample.body_size + 4);
  return out;
}

template <typename T>
void Poke(std::string& bytes, size_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof(T));
}

void ExpectRefused(const std::string& bytes, absl::StatusCode code,
                   const std::string& message, const std::string& what) {
  SCOPED_TRACE(what);
  auto loaded = Load(bytes, nullptr, size_t{64} << 20);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), code) << loaded.status();
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(message));
  // Taken in pieces (an import), the same file fails with the same code,
  // or, cut short, stays incomplete.
  auto built = Build(bytes, 777, nullptr, size_t{64} << 20);
  ASSERT_FALSE(built.ok());
  if (built.status().code() != absl::StatusCode::kFailedPrecondition ||
      code == absl::StatusCode::kFailedPrecondition) {
    EXPECT_EQ(built.status().code(), code) << built.status();
  } else {
    EXPECT_THAT(std::string(built.status().message()), HasSubstr("taken of"));
  }
}

TEST(SessionFileTest, TruncationAtAnyRecordBoundaryIsDataLoss) {
  const SampleFile sample = Sample();
  ASSERT_TRUE(Load(sample.bytes).ok());
  std::vector<size_t> cuts = {0, 7, 15, 16 + sample.body_size};
  for (size_t start : sample.record_starts) {
    cuts.push_back(start);
    cuts.push_back(start + 10);
  }
  cuts.push_back(sample.bytes.size() - 1);
  for (size_t cut : cuts) {
    ExpectRefused(sample.bytes.substr(0, cut), absl::StatusCode::kDataLoss,
                  "session file 's.session'",
                  absl::StrCat("truncated to ", cut));
  }
  ExpectRefused(sample.bytes + "x", absl::StatusCode::kDataLoss,
                "its header describes", "a byte appended");
}

TEST(SessionFileTest, AFlippedByteAnywhereIsDataLoss) {
  const SampleFile sample = Sample();
  std::mt19937 rng(9);
  std::vector<size_t> at = {0, 9, 14, 20, 16 + sample.body_size + 1};
  for (size_t start : sample.record_starts) {
    for (size_t offset : {0, 5, 13, 25, 100}) at.push_back(start + offset);
  }
  for (int i = 0; i < 30; ++i) {
    at.push_back(
        std::uniform_int_distribution<size_t>(0, sample.bytes.size() - 1)(rng));
  }
  for (size_t where : at) {
    if (where >= sample.bytes.size()) continue;
    std::string bytes = sample.bytes;
    bytes[where] ^= 0x10;
    ExpectRefused(bytes, absl::StatusCode::kDataLoss, "session file",
                  absl::StrCat("byte ", where, " flipped"));
  }
}

// A file of format version 1 (its header without flags), as the previous
// release wrote it, still loads.
TEST(SessionFileTest, AVersionOneFileLoads) {
  const SampleFile sample = Sample();
  std::string v1 = WithHeader(sample, [](std::string& body) {
    body.resize(body.size() - 4);  // no flags
  });
  Poke<uint32_t>(v1, 8, 1);
  SessionFileHeader header;
  auto loaded = Load(v1, &header);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(header.lengths, (std::vector<int64_t>{600, 100}));
  EXPECT_FALSE(header.unconfirmed);
}

// A file of `session` in `shape`.
std::string WriteShaped(const DecodeSession& session,
                        const SessionFileShape& shape) {
  std::string bytes;
  const absl::Status written = WriteSessionFile(
      session, "s",
      [&](absl::string_view piece) {
        bytes.append(piece.data(), piece.size());
        return absl::OkStatus();
      },
      /*unconfirmed=*/false, shape);
  EXPECT_TRUE(written.ok()) << written;
  return bytes;
}

SessionFileShape Prefix(std::vector<int64_t> lengths) {
  SessionFileShape shape;
  shape.prefix = std::move(lengths);
  return shape;
}
SessionFileShape Based(SessionFileBase base) {
  SessionFileShape shape;
  shape.base = std::move(base);
  return shape;
}

// `bytes` loaded with `base` as its base file.
absl::StatusOr<std::unique_ptr<DecodeSession>> LoadOverBase(
    absl::string_view bytes, absl::StatusOr<std::string> base,
    bool journal = false, SessionFileHeader* header = nullptr) {
  SessionStore store({});
  // Named: the loader refers to them.
  const auto base_file = [&]() { return base; };
  const auto no_models = [](absl::string_view)
      -> absl::StatusOr<std::shared_ptr<const MultiHeadLayer>> {
    return absl::NotFoundError("no models");
  };
  const auto verify = [&](const DecodeSessionConfig& c) {
    return store.VerifyConfig(c);
  };
  const SessionFileLoader loader{
      .layer_of = no_models, .verify = verify, .base = base_file};
  return journal ? LoadSessionJournal(bytes, "s.journal", loader, header)
                 : LoadSessionFile(bytes, "s.session", loader, header);
}

// Version 3: a fork's prefix is in a base file, named by its size and
// checksum, which must hold those tokens of the same config.
TEST(SessionFileTest, AFileWithABaseLoadsOverItsBase) {
  std::mt19937 rng(31);
  auto session = *DecodeSession::Create(Config(DType::kInt8, 2));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kInt8, 1100, rng), 0).ok());
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kInt8, 600, rng), 1).ok());
  const std::vector<int64_t> prefix = {1024, 512};
  const std::string base = WriteShaped(*session, Prefix(prefix));
  const SessionFileBase named{prefix, base.size(), Crc(base)};
  const std::string file = WriteShaped(*session, Based(named));
  // The file holds the tokens after the base only.
  EXPECT_LT(file.size(), Write(*session, "s").size() - base.size() / 2);
  EXPECT_EQ(ReadSessionFileHeader(file, "s.session")->base, named);
  auto loaded = LoadOverBase(file, base);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (int64_t layer : {0, 1}) {
    std::string want, got;
    ASSERT_TRUE(session->CopyRows(layer, 0, session->length(layer), want).ok());
    ASSERT_TRUE(
        (*loaded)->CopyRows(layer, 0, session->length(layer), got).ok());
    EXPECT_TRUE(want == got) << "layer " << layer;
  }
  const auto refused = [&](absl::StatusOr<std::string> other,
                           const std::string& message) {
    auto result = LoadOverBase(file, std::move(other));
    ASSERT_FALSE(result.ok()) << message;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(message));
  };
  const std::string what = absl::StrCat(
      "session file 's.session': its base "
      "file (",
      base.size(), " bytes, checksum ", Crc(base), ")");
  refused(absl::NotFoundError("gone"), what + ": gone");
  std::string flipped = base;
  flipped[flipped.size() / 2] ^= 1;
  refused(flipped, what + " is another");
  // Named by its size and checksum, but of other lengths.
  const std::string longer = WriteShaped(*session, Prefix({1024, 600}));
  const std::string misnamed = WriteShaped(
      *session, Based(SessionFileBase{prefix, longer.size(), Crc(longer)}));
  auto result = LoadOverBase(misnamed, longer);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("holds another session's tokens"));
  // A base must be whole blocks within the session.
  EXPECT_FALSE(WriteSessionFile(
                   *session, "s",
                   [](absl::string_view) { return absl::OkStatus(); }, false,
                   Based(SessionFileBase{{1000, 0}, 1, 1}))
                   .ok());
}

TEST(SessionFileTest, HostileHeadersAndRecordsAreRefusedWithWhatIsWrong) {
  const SampleFile sample = Sample();
  std::string version = sample.bytes;
  Poke<uint32_t>(version, 8, 4);
  ExpectRefused(version, absl::StatusCode::kDataLoss,
                "format version 4; this server reads versions 1 to 3",
                "a later version");
  Poke<uint32_t>(version, 8, 0);
  ExpectRefused(version, absl::StatusCode::kDataLoss,
                "format version 0; this server reads versions 1 to 3",
                "version 0");
  ExpectRefused("not a session file at all", absl::StatusCode::kDataLoss,
                "not a session file", "foreign bytes");
  // Header fields (body offsets: max_length at 44, num_layers at 52, the
  // first length after the id and model strings).
  ExpectRefused(
      WithHeader(
          sample,
          [](std::string& body) { Poke<int64_t>(body, 44, int64_t{1} << 40); }),
      absl::StatusCode::kResourceExhausted, "max_length", "a huge max_length");
  ExpectRefused(WithHeader(sample,
                           [](std::string& body) {
                             Poke<int64_t>(body, 52, kMaxSessionLayers + 1);
                           }),
                absl::StatusCode::kDataLoss, "malformed header",
                "too many layers");
  ExpectRefused(
      WithHeader(sample, [](std::string& body) { Poke<int32_t>(body, 8, -1); }),
      absl::StatusCode::kInvalidArgument, "num_kv_heads", "negative kv heads");
  ExpectRefused(
      WithHeader(sample, [](std::string& body) { Poke<int32_t>(body, 8, 0); }),
      absl::StatusCode::kDataLoss,
      "its config makes 4 key/value heads of dims 16/8 (FLOAT32 cache); its "
      "rows are of 0 of 16/8 (FLOAT32)",
      "kv heads that resolve to other dims");
  ExpectRefused(WithHeader(sample,
                           [&](std::string& body) {
                             // The first layer's length, 600 -> 5000.
                             Poke<int64_t>(body, body.size() - 20, 5000);
                           }),
                absl::StatusCode::kDataLoss, "malformed header",
                "a length past max_length");
  ExpectRefused(WithHeader(sample,
                           [&](std::string& body) {
                             Poke<int64_t>(body, body.size() - 20, 700);
                           }),
                absl::StatusCode::kDataLoss, "its header describes",
                "a length the blocks do not hold");
  ExpectRefused(
      WithHeader(
          sample,
          [&](std::string& body) { Poke<uint32_t>(body, body.size() - 4, 2); }),
      absl::StatusCode::kDataLoss, "malformed header", "an unknown flag");
}

// Rewrites the block record at `start` (rows of `rows_bytes`) with `edit`
// applied to its fields and rows, its checksum redone.
std::string WithBlock(const std::string& file, size_t start, size_t rows_bytes,
                      const std::function<void(std::string&)>& edit) {
  std::string record = file.substr(start, 28 + rows_bytes);
  edit(record);
  const std::string signed_part = record.substr(0, 24) + record.substr(28);
  Poke<uint32_t>(record, 24, Crc(signed_part));
  return file.substr(0, start) + record + file.substr(start + record.size());
}

TEST(SessionFileTest, ResignedHostileBlocksAreRefused) {
  const SampleFile sample = Sample();
  const size_t first = sample.record_starts[0];
  const size_t rows = sample.record_starts[1] - first - 28;
  ExpectRefused(WithBlock(sample.bytes, first, rows,
                          [](std::string& r) { Poke<int64_t>(r, 8, 512); }),
                absl::StatusCode::kDataLoss,
                "block 0 (layer 0, tokens 0..512): found a record of layer 0, "
                "tokens 512 + 512 instead",
                "a block out of order");
  ExpectRefused(WithBlock(sample.bytes, first, rows,
                          [](std::string& r) { Poke<uint32_t>(r, 4, 1); }),
                absl::StatusCode::kDataLoss, "found a record of layer 1",
                "a block of another layer");
  ExpectRefused(
      WithBlock(sample.bytes, first, rows,
                [](std::string& r) {
                  Poke<float>(r, 28 + 64,
                              std::numeric_limits<float>::quiet_NaN());
                }),
      absl::StatusCode::kDataLoss,
      "rows of layer 0 (keys): element 16 is not finite", "a NaN key");
  ExpectRefused(WithBlock(sample.bytes, first, rows,
                          [](std::string& r) { r.replace(0, 4, "XXXX"); }),
                absl::StatusCode::kDataLoss, "not a block record",
                "a foreign record");
}

// The journal of `session` as a server writes it: the header, then each
// full block of every layer.
std::string JournalOf(const DecodeSession& session, absl::string_view id) {
  absl::StatusOr<std::string> out = SessionJournalHeader(session, id);
  EXPECT_TRUE(out.ok()) << out.status();
  std::string rows;
  for (int64_t layer = 0; layer < session.num_layers(); ++layer) {
    for (int64_t first = 0; first + kCacheBlockKeys <= session.length(layer);
         first += kCacheBlockKeys) {
      rows.clear();
      EXPECT_TRUE(session.CopyRows(layer, first, kCacheBlockKeys, rows).ok());
      *out += SessionBlockFields(layer, first, kCacheBlockKeys, rows);
      *out += rows;
    }
  }
  return *out;
}

absl::StatusOr<std::unique_ptr<DecodeSession>> LoadJournal(
    absl::string_view bytes, SessionFileHeader* header = nullptr) {
  return LoadWith(
      [](absl::string_view b, absl::string_view n, const SessionFileLoader& l,
         SessionFileHeader* h) { return LoadSessionJournal(b, n, l, h); },
      bytes, "s.journal", header);
}

// A session holding the full blocks of `session` (its first `lengths`
// tokens per layer), built by appending them.
std::unique_ptr<DecodeSession> PrefixOf(const DecodeSession& session,
                                        const std::vector<int64_t>& lengths) {
  auto prefix = *DecodeSession::Create(session.config());
  std::string rows;
  for (int64_t layer = 0; layer < session.num_layers(); ++layer) {
    for (int64_t first = 0; first < lengths[layer]; first += kCacheBlockKeys) {
      rows.clear();
      EXPECT_TRUE(session.CopyRows(layer, first, kCacheBlockKeys, rows).ok());
      EXPECT_TRUE(prefix->AppendRows(layer, first, kCacheBlockKeys, rows).ok());
    }
  }
  return prefix;
}

TEST(SessionJournalTest, AJournalReplaysToTheFullBlocksUnconfirmed) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt8}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::mt19937 rng(21);
    auto session = *DecodeSession::Create(Config(dtype, 2));
    ASSERT_TRUE(RunStep(*session, RandomStep(dtype, 1100, rng)).ok());
    ASSERT_TRUE(RunStep(*session, RandomStep(dtype, 300, rng), 1).ok());
    SessionFileHeader header;
    auto loaded = LoadJournal(JournalOf(*session, "j"), &header);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    // The unfilled blocks are lost: 1024 and 0 tokens.
    EXPECT_EQ(header.lengths, (std::vector<int64_t>{1024, 0}));
    EXPECT_TRUE(header.unconfirmed);
    EXPECT_EQ(header.id, "j");
    auto reference = PrefixOf(*session, {1024, 0});
    ExpectSameNextSteps(*reference, **loaded, dtype, rng);
  }
}

// A fork's journal names a base file holding its shared prefix: the replay
// starts from the base's blocks, and a rewind record drops them as it
// drops journaled ones.
TEST(SessionJournalTest, AJournalOverABaseReplaysFromItsBlocks) {
  std::mt19937 rng(23);
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 1));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 1600, rng)).ok());
  const std::string base = WriteShaped(*session, Prefix({1024}));
  const SessionFileBase named{{1024}, base.size(), Crc(base)};
  std::string journal = *SessionJournalHeader(*session, "j", &named);
  std::string rows;
  ASSERT_TRUE(session->CopyRows(0, 1024, kCacheBlockKeys, rows).ok());
  journal += SessionBlockFields(0, 1024, kCacheBlockKeys, rows) + rows;
  SessionFileHeader header;
  auto loaded = LoadOverBase(journal, base, /*journal=*/true, &header);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(header.lengths, (std::vector<int64_t>{1536}));
  EXPECT_TRUE(header.unconfirmed);
  ExpectSameNextSteps(*PrefixOf(*session, {1536}), **loaded, DType::kFloat32,
                      rng);
  journal += SessionBlockFields(0, 512, 0, "");
  loaded = LoadOverBase(journal, base, /*journal=*/true, &header);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(header.lengths, (std::vector<int64_t>{512}));
  ExpectSameNextSteps(*PrefixOf(*session, {512}), **loaded, DType::kFloat32,
                      rng);
  auto without = LoadOverBase(journal, absl::NotFoundError("gone"), true);
  EXPECT_EQ(without.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(without.status().message()),
              HasSubstr("its base file"));
}

TEST(SessionJournalTest, ARewindRecordDropsTheBlocksItReplaced) {
  std::mt19937 rng(22);
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 1));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 1536, rng)).ok());
  std::string journal = JournalOf(*session, "j");
  // The client rewinds to 700 and refills block 1 with other tokens.
  journal += SessionBlockFields(0, 512, 0, "");
  DecodeStepInputs in;
  const StepData refill = RandomStep(DType::kFloat32, 400, rng);
  in.query = refill.q.view();
  in.key = refill.k.view();
  in.value = refill.v.view();
  in.position = 700;
  TensorResults results;
  ASSERT_TRUE(session->Step(in, DecodeStepOptions{}, results).ok());
  std::string rows;
  ASSERT_TRUE(session->CopyRows(0, 512, kCacheBlockKeys, rows).ok());
  journal += SessionBlockFields(0, 512, kCacheBlockKeys, rows);
  journal += rows;
  SessionFileHeader header;
  auto loaded = LoadJournal(journal, &header);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(header.lengths, (std::vector<int64_t>{1024}));
  auto reference = PrefixOf(*session, {1024});
  ExpectSameNextSteps(*reference, **loaded, DType::kFloat32, rng);
  // Cut right after the rewind record: block 0 only.
  const size_t cut = journal.size() - 28 - session->RowBytes(kCacheBlockKeys);
  loaded = LoadJournal(journal.substr(0, cut), &header);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(header.lengths, (std::vector<int64_t>{512}));
}

TEST(SessionJournalTest, ACutAnywhereLeavesTheRecordsBeforeIt) {
  std::mt19937 rng(23);
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 1));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 1600, rng)).ok());
  const std::string journal = JournalOf(*session, "j");
  const size_t record = 28 + session->RowBytes(kCacheBlockKeys);
  const size_t header_bytes = journal.size() - 3 * record;
  for (size_t cut = header_bytes; cut <= journal.size(); cut += 997) {
    SCOPED_TRACE(absl::StrCat("cut at ", cut));
    SessionFileHeader header;
    auto loaded = LoadJournal(journal.substr(0, cut), &header);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const int64_t whole = static_cast<int64_t>((cut - header_bytes) / record);
    EXPECT_EQ(header.lengths[0], whole * kCacheBlockKeys);
  }
  // A header cut short is no journal.
  auto loaded = LoadJournal(journal.substr(0, header_bytes - 1));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
}

TEST(SessionJournalTest, CorruptionBeforeTheLastRecordIsDataLoss) {
  std::mt19937 rng(24);
  auto session = *DecodeSession::Create(Config(DType::kFloat32, 1));
  ASSERT_TRUE(RunStep(*session, RandomStep(DType::kFloat32, 1536, rng)).ok());
  const std::string journal = JournalOf(*session, "j");
  const size_t record = 28 + session->RowBytes(kCacheBlockKeys);
  const size_t first = journal.size() - 3 * record;
  // A flipped byte in the last record: it was being written; two blocks.
  std::string torn = journal;
  torn[journal.size() - 5] ^= 0x10;
  SessionFileHeader header;
  ASSERT_TRUE(LoadJournal(torn, &header).ok());
  EXPECT_EQ(header.lengths[0], 1024);
  // In an earlier one: corruption.
  for (size_t at : {first + 3, first + 30, first + record + 100}) {
    std::string bytes = journal;
    bytes[at] ^= 0x10;
    auto loaded = LoadJournal(bytes);
    ASSERT_FALSE(loaded.ok()) << at;
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(loaded.status().message()),
                HasSubstr("session file 's.journal': journal record"));
  }
  // Re-signed hostile records: past the layer's blocks, a partial block,
  // another layer, a foreign tag.
  const std::string header_part = journal.substr(0, first);
  const std::string rows = journal.substr(first + 28, record - 28);
  const auto expect = [&](const std::string& bytes, const std::string& what) {
    auto loaded = LoadJournal(bytes);
    ASSERT_FALSE(loaded.ok()) << what;
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(what));
  };
  expect(header_part + SessionBlockFields(0, 1024, 512, rows) + rows,
         "journal record 0: starts at token 1024; layer 0 holds 0");
  expect(header_part + SessionBlockFields(0, 0, 100, "") + rows,
         "journal record 0: layer 0, tokens 0 + 100 is no block");
  expect(header_part + SessionBlockFields(3, 0, 512, rows) + rows,
         "journal record 0: layer 3, tokens 0 + 512 is no block");
  std::string foreign = SessionBlockFields(0, 0, 512, rows);
  foreign.replace(0, 4, "XXXX");
  expect(header_part + foreign + rows, "journal record 0: not a block record");
  // A session file is not a journal.
  expect(Write(*session, "j"), "not a journal");
}

}  // namespace
}  // namespace attnserve::testing
