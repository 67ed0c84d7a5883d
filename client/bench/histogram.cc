#include "client/bench/histogram.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

namespace attnserve {

LatencyHistogram::LatencyHistogram() { Reset(); }

void LatencyHistogram::Reset() {
  for (auto& bucket : buckets_) bucket.store(0, std::memory_order_relaxed);
  count_.store(0, std::memory_order_relaxed);
  min_.store(std::numeric_limits<int64_t>::max(), std::memory_order_relaxed);
  max_.store(0, std::memory_order_relaxed);
  sum_.store(0, std::memory_order_relaxed);
}

int LatencyHistogram::BucketOf(int64_t nanos) {
  if (nanos < kLinearLimit) return nanos < 0 ? 0 : static_cast<int>(nanos);
  // v = m * 2^shift with m in [128, 256).
  const int shift = std::bit_width(static_cast<uint64_t>(nanos)) - 8;
  const int mantissa = static_cast<int>(nanos >> shift);
  return kLinearLimit + (shift - 1) * kSubBuckets + (mantissa - kSubBuckets);
}

int64_t LatencyHistogram::BucketLow(int bucket) {
  if (bucket < kLinearLimit) return bucket;
  const int j = bucket - kLinearLimit;
  const int shift = j / kSubBuckets + 1;
  return static_cast<int64_t>(kSubBuckets + j % kSubBuckets) << shift;
}

int64_t LatencyHistogram::BucketWidth(int bucket) {
  if (bucket < kLinearLimit) return 1;
  return int64_t{1} << ((bucket - kLinearLimit) / kSubBuckets + 1);
}

void LatencyHistogram::Record(int64_t nanos) {
  nanos = std::max<int64_t>(nanos, 0);
  buckets_[BucketOf(nanos)].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(static_cast<double>(nanos), std::memory_order_relaxed);
  int64_t seen = min_.load(std::memory_order_relaxed);
  while (nanos < seen && !min_.compare_exchange_weak(seen, nanos)) {
  }
  seen = max_.load(std::memory_order_relaxed);
  while (nanos > seen && !max_.compare_exchange_weak(seen, nanos)) {
  }
}

void LatencyHistogram::Merge(const LatencyHistogram& other) {
  if (other.count() == 0) return;
  for (int i = 0; i < kNumBuckets; ++i) {
    buckets_[i].fetch_add(other.buckets_[i].load(std::memory_order_relaxed),
                          std::memory_order_relaxed);
  }
  count_.fetch_add(other.count(), std::memory_order_relaxed);
  sum_.fetch_add(other.sum_.load(std::memory_order_relaxed),
                 std::memory_order_relaxed);
  int64_t seen = min_.load();
  while (other.min() < seen && !min_.compare_exchange_weak(seen, other.min())) {
  }
  seen = max_.load();
  while (other.max() > seen && !max_.compare_exchange_weak(seen, other.max())) {
  }
}

int64_t LatencyHistogram::min() const {
  return count() == 0 ? 0 : min_.load(std::memory_order_relaxed);
}

int64_t LatencyHistogram::max() const {
  return max_.load(std::memory_order_relaxed);
}

double LatencyHistogram::mean() const {
  const int64_t n = count();
  return n == 0 ? 0 : sum_.load(std::memory_order_relaxed) / n;
}

double LatencyHistogram::stddev() const {
  const int64_t n = count();
  if (n < 2) return 0;
  const double mu = mean();
  double squares = 0;
  for (int i = 0; i < kNumBuckets; ++i) {
    const uint64_t c = buckets_[i].load(std::memory_order_relaxed);
    if (c == 0) continue;
    const double mid = BucketLow(i) + (BucketWidth(i) - 1) / 2.0;
    squares += c * (mid - mu) * (mid - mu);
  }
  return std::sqrt(squares / (n - 1));
}

int64_t LatencyHistogram::Percentile(double percentile) const {
  uint64_t total = 0;
  for (const auto& bucket : buckets_) {
    total += bucket.load(std::memory_order_relaxed);
  }
  if (total == 0) return 0;
  const double p = std::clamp(percentile, 0.0, 100.0);
  const uint64_t rank = std::max<uint64_t>(
      1, static_cast<uint64_t>(std::ceil(p / 100.0 * total)));
  uint64_t seen = 0;
  for (int i = 0; i < kNumBuckets; ++i) {
    seen += buckets_[i].load(std::memory_order_relaxed);
    if (seen >= rank) {
      const int64_t mid = BucketLow(i) + (BucketWidth(i) - 1) / 2;
      return std::clamp(mid, min(), max());
    }
  }
  return max();
}

}  // namespace attnserve
