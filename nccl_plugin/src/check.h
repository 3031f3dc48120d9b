/* SPDX-License-Identifier: Apache-2.0
 * One error convention for everything below the API boundary: functions return 0 on success
 * or a negative errno. Only api.c turns these into ncclResult_t. */
#ifndef FLOWSCHED_CHECK_H
#define FLOWSCHED_CHECK_H

#include <errno.h>

/* Propagate a failure to the caller. */
#define FS_CHECK(call)      \
  do {                      \
    int fs_rc_ = (call);    \
    if (fs_rc_ < 0) {       \
      return fs_rc_;        \
    }                       \
  } while (0)

/* Record a failure in `rc` and jump to a cleanup label. */
#define FS_CHECK_GOTO(call, rc, label) \
  do {                                 \
    (rc) = (call);                     \
    if ((rc) < 0) {                    \
      goto label;                      \
    }                                  \
  } while (0)

/* errno as a negative value, for system calls that failed. */
#define FS_NEG_ERRNO() (errno > 0 ? -errno : -EIO)

#endif
