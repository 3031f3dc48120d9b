/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the connect state machine's check of a pending TCP handshake
 * (connect_check_socket) when poll() fails: an interrupted poll (EINTR) leaves the handshake
 * pending, another error fails the connect; neither may be taken for a finished handshake
 * (the hello would then go out on a socket still connecting, and a refusal would fail the
 * connect instead of retrying it). poll is replaced here; the functions are static, so the
 * file is included; the rest of the plugin comes from the static internal library.
 *
 *   test_connect_poll   exit status 0 when every case holds
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

static int g_poll_errno; /* what the next poll fails with */

static int test_poll(struct pollfd* fds, nfds_t n, int timeout) {
  (void)fds;
  (void)n;
  (void)timeout;
  errno = g_poll_errno;
  return -1;
}

#define poll test_poll
#include "transport_conn.c"
#undef poll

int main(void) {
  static const struct {
    int poll_errno;
    int want; /* connect_check_socket's result */
  } cases[] = {{EINTR, 0}, {ENOMEM, -ENOMEM}};
  int failures = 0;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    struct fs_comm comm;
    memset(&comm, 0, sizeof(comm));
    struct fs_connect_state st = {.comm = &comm, .phase = FS_PHASE_CONNECTING};
    st.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0); /* SO_ERROR 0 */
    if (st.fd < 0) {
      perror("socket");
      return 2;
    }
    g_poll_errno = cases[i].poll_errno;
    int rc = connect_check_socket(&st);
    if (rc != cases[i].want || st.phase != FS_PHASE_CONNECTING) {
      fprintf(stderr, "FAIL: poll failing with %s: %d, phase %d (want %d, phase %d)\n",
              strerror(cases[i].poll_errno), rc, st.phase, cases[i].want, FS_PHASE_CONNECTING);
      failures++;
    }
    close(st.fd);
  }
  if (failures == 0) {
    printf("ok test_connect_poll\n");
  }
  return failures == 0 ? 0 : 1;
}
