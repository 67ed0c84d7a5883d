// Request and response messages recycled from call to call: a cleared
// protobuf message keeps the capacity of its byte fields, so a steady stream
// of calls of similar sizes parses its tensors and writes its results
// without allocating (or page-faulting in) new buffers.
//
// Bounds: at most `max_pooled` idle pairs and `max_pooled_bytes` of their
// capacity are kept; larger pairs are freed when they are released.
//
// Thread-safety: AllocateMessages and the pairs' Release may be called
// concurrently from any thread. Ownership: the pool owns the idle pairs; a
// pair taken is its taker's until Release, which must come before the pool
// is destroyed.
#ifndef ATTNSERVE_SERVER_MESSAGE_POOL_H_
#define ATTNSERVE_SERVER_MESSAGE_POOL_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"

namespace attnserve {

// A pair taken from a MessagePool, whatever its message types: Release()
// hands it back (its holder must not touch it afterwards).
class PooledMessages {
 public:
  virtual void Release() = 0;

 protected:
  ~PooledMessages() = default;
};

// A pair held until its owner goes.
struct ReleaseMessages {
  void operator()(PooledMessages* messages) const { messages->Release(); }
};
using PooledMessagesPtr = std::unique_ptr<PooledMessages, ReleaseMessages>;

template <typename Request, typename Response>
class MessagePool {
 public:
  class Messages final : public PooledMessages {
   public:
    Request* request() { return &request_; }
    Response* response() { return &response_; }
    void Release() override { pool_->Recycle(this); }

   private:
    friend class MessagePool;
    explicit Messages(MessagePool* pool) : pool_(pool) {}
    MessagePool* pool_;
    Request request_;
    Response response_;
    // What the pair held in its last call: a bound on its idle capacity.
    size_t bytes_ = 0;
  };

  MessagePool(size_t max_pooled, size_t max_pooled_bytes)
      : max_pooled_(max_pooled), max_pooled_bytes_(max_pooled_bytes) {}
  MessagePool(const MessagePool&) = delete;
  MessagePool& operator=(const MessagePool&) = delete;

  // An idle pair, cleared, or a new one.
  Messages* AllocateMessages() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      MutexLock lock(&mu_);
      if (!idle_.empty()) {
        std::unique_ptr<Messages> messages = std::move(idle_.back());
        idle_.pop_back();
        pooled_bytes_ -= messages->bytes_;
        ++reused_;
        return messages.release();
      }
    }
    return new Messages(this);
  }

  // Calls that found an idle pair (for tests and metrics).
  size_t reused() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return reused_;
  }

 private:
  void Recycle(Messages* released) ABSL_LOCKS_EXCLUDED(mu_) {
    std::unique_ptr<Messages> messages(released);
    messages->bytes_ =
        messages->request_.ByteSizeLong() + messages->response_.ByteSizeLong();
    messages->request_.Clear();
    messages->response_.Clear();
    MutexLock lock(&mu_);
    if (idle_.size() < max_pooled_ &&
        pooled_bytes_ + messages->bytes_ <= max_pooled_bytes_) {
      pooled_bytes_ += messages->bytes_;
      idle_.push_back(std::move(messages));
    }
  }

  const size_t max_pooled_;
  const size_t max_pooled_bytes_;
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Messages>> idle_ ABSL_GUARDED_BY(mu_);
  size_t pooled_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t reused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MESSAGE_POOL_H_
