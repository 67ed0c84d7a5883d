// The mutex, scoped lock and condition variable of the tree: std::mutex and
// std::condition_variable with clang's thread-safety annotations, so that
// -Wthread-safety checks ABSL_GUARDED_BY members and the lock contracts of
// functions (a plain std::mutex is no capability to clang, and annotations
// naming one check nothing).
//
// Why not absl::Mutex: ThreadSanitizer sees synchronization only in
// instrumented code or through the pthread calls it intercepts. Debian's
// abseil is not instrumented, so absl::Mutex would be invisible to TSan (false
// race reports); std::mutex locks through pthread, which TSan sees.
//
// Thread-safety: Mutex and CondVar are for concurrent use (that is their
// point); a MutexLock belongs to the thread that made it. None is copyable or
// movable. Ownership: a Mutex or CondVar must outlive every thread using it;
// MutexLock holds a pointer to its Mutex, not the Mutex.
#ifndef ATTNSERVE_CORE_MUTEX_H_
#define ATTNSERVE_CORE_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace attnserve {

// An exclusive, non-recursive lock.
class ABSL_LOCKABLE Mutex {
 public:
  // constexpr, as std::mutex: a Mutex at namespace scope needs no dynamic
  // initialization.
  constexpr Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Tells the analysis that the calling thread holds this mutex, where it
  // cannot prove it; checks nothing at run time.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` from construction to the end of its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
  }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable waited on under a Mutex.
//
// Contract:
// - A waiter holds `mu` when it calls Wait*, which releases it while blocked
//   and holds it again on return. All threads waiting at once must pass the
//   same Mutex.
// - Wait* may return without a Signal (spurious wake-ups): wait in a loop
//   that re-checks the condition, `while (!ready_) cv_.Wait(&mu_);`. Write
//   the condition in the loop rather than in a lambda, where the analysis
//   would not know the mutex is held.
// - Signal and SignalAll may be called with or without the mutex held; after
//   unlocking spares the woken thread from blocking on it at once.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // the caller goes on holding *mu
  }

  // Wait, for at most `timeout`; true if it ended by timing out.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const std::cv_status status = cv_.wait_for(lock, timeout);
    lock.release();
    return status == std::cv_status::timeout;
  }

  // Wait, at most until `deadline`; true if it ended by timing out.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const std::cv_status status = cv_.wait_until(lock, deadline);
    lock.release();
    return status == std::cv_status::timeout;
  }

  // Wakes one waiter, if any.
  void Signal() { cv_.notify_one(); }
  // Wakes every waiter.
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_CORE_MUTEX_H_
