/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the API boundary's error mapping: each internal -errno to the ncclResult_t
 * NCCL expects. result_of is static, so the file is included; the rest of the plugin comes
 * from the static internal library.
 *
 *   test_api_results        exit status 0 when every case maps as the table says
 */
#include "api.c"

#include <stdio.h>

static void silent(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                   const char* fmt, ...) {
  (void)level;
  (void)flags;
  (void)file;
  (void)line;
  (void)fmt;
}

static const struct {
  int err; /* positive errno; 0 = success */
  ncclResult_t want;
} k_cases[] = {
    {0, ncclSuccess},
    /* the peer, or the path to it, is at fault: NCCL's socket transport says RemoteError */
    {ECONNREFUSED, ncclRemoteError},
    {ETIMEDOUT, ncclRemoteError},
    {EHOSTUNREACH, ncclRemoteError},
    {ENETUNREACH, ncclRemoteError},
    {ECONNRESET, ncclRemoteError},
    {EPIPE, ncclRemoteError},
    {ECONNABORTED, ncclRemoteError},
    {EPROTO, ncclRemoteError},
    /* misuse by NCCL */
    {EINVAL, ncclInternalError},
    {EFAULT, ncclInternalError},
    {EBADF, ncclInternalError},
    /* user or configuration errors */
    {EMSGSIZE, ncclInvalidUsage},
    {ENODEV, ncclInvalidUsage},
    {ENOTSUP, ncclInvalidUsage},
    /* this process or its kernel */
    {ENOMEM, ncclSystemError},
    {EMFILE, ncclSystemError},
    {EADDRINUSE, ncclSystemError},
    {EIO, ncclSystemError},
};

int main(void) {
  fs_log_set_logger(silent);
  int failed = 0;
  for (size_t i = 0; i < sizeof(k_cases) / sizeof(k_cases[0]); i++) {
    ncclResult_t got = result_of(-k_cases[i].err, "test");
    if (got != k_cases[i].want) {
      fprintf(stderr, "FAIL errno %d (%s): ncclResult %d, expected %d\n", k_cases[i].err,
              fs_errstr(k_cases[i].err), (int)got, (int)k_cases[i].want);
      failed = 1;
    }
  }
  if (!failed) {
    printf("ok api results (%zu cases)\n", sizeof(k_cases) / sizeof(k_cases[0]));
  }
  return failed;
}
