/* SPDX-License-Identifier: Apache-2.0
 * Test support for the unit tests: a logger (the ncclDebugLogger_t NCCL passes to init) that
 * keeps the plugin's warnings, line after line, in `warnings`; a test empties it before the
 * call it checks (warnings[0] = '\0'). With `capture_every_level` set it keeps the INFO lines
 * too. Each test program includes it once.
 */
#ifndef FS_TEST_WARN_CAPTURE_H
#define FS_TEST_WARN_CAPTURE_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "log.h"

static char warnings[8192]; /* what the plugin warned, line after line */
static int capture_every_level; /* 1: INFO lines as well */

static void capture(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                    const char* fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  if (level != NCCL_LOG_WARN && !capture_every_level) {
    return;
  }
  size_t used = strlen(warnings);
  va_list args;
  va_start(args, fmt);
  vsnprintf(warnings + used, sizeof(warnings) - used, fmt, args);
  va_end(args);
  used = strlen(warnings);
  snprintf(warnings + used, sizeof(warnings) - used, "\n");
}

#endif
