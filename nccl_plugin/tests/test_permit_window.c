/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the permit's share window when several progress threads ask at once
 * (permit.c, window_decay). Every deferred connection's progress thread asks for its permit
 * in a loop, so at a window's end several threads decay the shares within nanoseconds: one
 * moves the window's start to the time it read, and another that read the clock just before
 * finds a start later than its own "now". That is not a window that ended: the shares the
 * guard protects must stay, and the start must not move back.
 *
 * The test owns the clock (clock_gettime below replaces the C library's for this binary), so
 * "read just before another thread moved the start" is a read of an earlier time.
 *
 *   test_permit_window   exit status 0 when every case decides as the table says
 */
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "permit.h"

#define DEV 0
#define TP 0
#define BULK 7
#define WINDOW_NS 1000000000ull /* 1 s */
#define T0 (100 * WINDOW_NS)    /* when the first bytes open the window */

static _Atomic uint64_t fake_now_ns = T0;

/* The permit's clock (CLOCK_MONOTONIC) for this test. */
int clock_gettime(clockid_t clock, struct timespec* ts) {
  (void)clock;
  uint64_t now = atomic_load(&fake_now_ns);
  ts->tv_sec = (time_t)(now / 1000000000ull);
  ts->tv_nsec = (long)(now % 1000000000ull);
  return 0;
}

static const struct {
  const char* what;
  int64_t asked_at; /* the asking thread's clock, relative to the window's start */
  int bulk_permitted;
} k_cases[] = {
    /* tp sent 1 MB in this window, bulk nothing: bulk is below its share and goes */
    {"asked within the window", 1000, 1},
    /* the same, but the thread read the clock 1 us before another thread opened the
     * window: the window did not end, bulk still goes */
    {"asked with a clock read before the window's start", -1000, 1},
};

int main(void) {
  int failures = 0;
  for (size_t i = 0; i < sizeof(k_cases) / sizeof(k_cases[0]); i++) {
    fs_gate_reset();
    struct fs_gate_params params = {.enabled = 1, .min_share_permille = 500,
                                    .window_ns = WINDOW_NS, .max_defer_ns = 0};
    fs_gate_configure(&params);
    atomic_store(&fake_now_ns, T0);
    fs_gate_started(NULL, DEV, TP, 1000000); /* opens the window at T0 */
    fs_gate_done(DEV, TP);
    fs_gate_started(NULL, DEV, TP, 100); /* a tp send in flight: bulk contends with it */
    struct fs_gate_conn bulk = {0};
    atomic_store(&fake_now_ns, (uint64_t)((int64_t)T0 + k_cases[i].asked_at));
    int first = fs_gate_permit(&bulk, DEV, BULK);
    /* the next ask, with the clock where it is for every thread now */
    atomic_store(&fake_now_ns, T0 + 2000);
    int second = fs_gate_permit(&bulk, DEV, BULK);
    fs_gate_done(DEV, TP);
    if (first != k_cases[i].bulk_permitted || second != k_cases[i].bulk_permitted) {
      fprintf(stderr, "FAIL %s: bulk %s, then %s; want %s (shares wiped?)\n", k_cases[i].what,
              first ? "permitted" : "deferred", second ? "permitted" : "deferred",
              k_cases[i].bulk_permitted ? "permitted" : "deferred");
      failures++;
    }
  }
  if (failures == 0) {
    printf("test_permit_window: %zu cases ok\n", sizeof(k_cases) / sizeof(k_cases[0]));
  }
  return failures == 0 ? 0 : 1;
}
