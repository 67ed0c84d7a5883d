// Early-return helpers for absl::Status and absl::StatusOr.
#ifndef ATTNSERVE_CORE_STATUS_MACROS_H_
#define ATTNSERVE_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTN_STATUS_CONCAT_INNER_(a, b) a##b
#define ATTN_STATUS_CONCAT_(a, b) ATTN_STATUS_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function if it is not OK.
#define ATTN_RETURN_IF_ERROR(expr)                                \
  do {                                                            \
    if (absl::Status _attn_status = (expr); !_attn_status.ok()) { \
      return _attn_status;                                        \
    }                                                             \
  } while (false)

// Evaluates a StatusOr expression; returns its status on error, otherwise
// moves its value into `lhs` (which may be a declaration).
#define ATTN_ASSIGN_OR_RETURN(lhs, expr)                                     \
  ATTN_ASSIGN_OR_RETURN_IMPL_(ATTN_STATUS_CONCAT_(_attn_or_, __LINE__), lhs, \
                              expr)
#define ATTN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()

#endif  // ATTNSERVE_CORE_STATUS_MACROS_H_
