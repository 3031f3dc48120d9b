/* SPDX-License-Identifier: Apache-2.0 */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Atomic(ncclDebugLogger_t) fs_logger;

void fs_log_set_logger(ncclDebugLogger_t logger) {
  if (logger != NULL) {
    atomic_store(&fs_logger, logger);
  }
}

void fs_log(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
            const char* fmt, ...) {
  char text[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof(text), fmt, args);
  va_end(args);
  ncclDebugLogger_t logger = atomic_load(&fs_logger);
  if (logger != NULL) {
    logger(level, flags, file, line, "%s", text);
  } else if (level == NCCL_LOG_WARN) {
    fprintf(stderr, "%s\n", text);
  }
}

const char* fs_errstr(int errnum) {
  static _Thread_local char buf[128];
  return strerror_r(errnum, buf, sizeof(buf));
}
