/* SPDX-License-Identifier: Apache-2.0
 * Logging through NCCL's logger (the logFn handed to init). Without a logger (a harness that
 * passes NULL) warnings go to stderr and INFO lines are dropped. */
#ifndef FLOWSCHED_LOG_H
#define FLOWSCHED_LOG_H

#include <stdatomic.h>

#include "nccl/common.h"

void fs_log_set_logger(ncclDebugLogger_t logger);
void fs_log(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
            const char* fmt, ...) __attribute__((format(printf, 5, 6)));
/* Text for an errno value (thread-safe, static storage). */
const char* fs_errstr(int errnum);

/* The plugin's name in its own log lines ("fstcp" for the standalone inner build). */
#ifdef FS_INNER_BUILD
#define FS_LOG_PREFIX "NET/fstcp: "
#else
#define FS_LOG_PREFIX "NET/flowsched: "
#endif

#define FS_WARN(fmt, ...) \
  fs_log(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, FS_LOG_PREFIX fmt, ##__VA_ARGS__)
#define FS_INFO(flags, fmt, ...) \
  fs_log(NCCL_LOG_INFO, (flags), __FILE__, __LINE__, FS_LOG_PREFIX fmt, ##__VA_ARGS__)

/* Warn at most once per flag (flags live in the global state and reset on re-initialisation). */
#define FS_WARN_ONCE(flag, fmt, ...)                  \
  do {                                                \
    if (!atomic_exchange(&(flag), 1)) {               \
      FS_WARN(fmt, ##__VA_ARGS__);                    \
    }                                                 \
  } while (0)

#endif
