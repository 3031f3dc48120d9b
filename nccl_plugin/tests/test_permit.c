/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the permit's share guard (permit.c): the shares are the bytes of each level
 * over the window, halved every window, so they follow the recent past. A level that sent
 * alone for a long time must not keep a share that lets a less urgent level through the
 * guard once they contend: that history is many windows old and counts for nothing.
 *
 * Each case runs on a fresh permit state: bytes sent by a tp send (level 0), then, after
 * `quiet_windows` windows (0: at once), a tp send in flight and a bulk send (level 7) that
 * asks for its permit. The only guard on is the share (50%); no age bound.
 *
 *   test_permit   exit status 0 when every case decides as the table says
 */
#include <stdio.h>
#include <time.h>

#include "permit.h"

#define DEV 0
#define TP 0
#define BULK 7

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Wait until the monotonic clock is `ns` past `from` (a condition on the clock, whatever the
 * scheduler does meanwhile). */
static void wait_past(uint64_t from, uint64_t ns) {
  struct timespec tick = {.tv_sec = 0, .tv_nsec = 50000};
  while (now_ns() - from < ns) {
    nanosleep(&tick, NULL);
  }
}

static const struct {
  const char* what;
  uint64_t window_ns;
  uint64_t tp_history; /* bytes tp sent alone before the contention */
  uint64_t quiet_windows;
  int bulk_permitted; /* what the guard must answer bulk */
} k_cases[] = {
    /* tp just sent, bulk nothing: bulk is below its share and goes */
    {"recent tp bytes", 10000000000ull, 1000000, 0, 1},
    /* the same bytes 200 windows ago: no share left to protect, strict priority defers bulk */
    {"stale tp bytes", 1000, 1000000000, 200, 0},
};

int main(void) {
  int failures = 0;
  for (size_t i = 0; i < sizeof(k_cases) / sizeof(k_cases[0]); i++) {
    fs_gate_reset();
    struct fs_gate_params params = {.enabled = 1, .min_share_permille = 500,
                                    .window_ns = k_cases[i].window_ns, .max_defer_ns = 0};
    fs_gate_configure(&params);
    fs_gate_started(DEV, TP, k_cases[i].tp_history);
    fs_gate_done(DEV, TP);
    uint64_t sent_at = now_ns();
    if (k_cases[i].quiet_windows > 0) {
      wait_past(sent_at, k_cases[i].quiet_windows * k_cases[i].window_ns);
    }
    fs_gate_started(DEV, TP, 100); /* a tp send in flight: bulk contends with it */
    struct fs_gate_conn bulk = {0};
    int permitted = fs_gate_permit(&bulk, DEV, BULK);
    fs_gate_done(DEV, TP);
    if (permitted != k_cases[i].bulk_permitted) {
      fprintf(stderr, "FAIL %s: bulk %s, want %s\n", k_cases[i].what,
              permitted ? "permitted" : "deferred",
              k_cases[i].bulk_permitted ? "permitted" : "deferred");
      failures++;
    }
  }
  if (failures == 0) {
    printf("test_permit: %zu cases ok\n", sizeof(k_cases) / sizeof(k_cases[0]));
  }
  return failures == 0 ? 0 : 1;
}
