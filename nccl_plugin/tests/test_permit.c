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
 * Then the age bound (test_age_survives_refusal): a send the age bound let through and the
 * transport refused (a NULL request: no request slot, an RDMA peer not clear to send) is
 * retried at once, not deferred for another max_defer.
 *
 *   test_permit   exit status 0 when every case decides as the table says
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "param.h"
#include "permit.h"
#include "warn_capture.h"

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

#define AGE_NS 20000000ull /* 20 ms */

/* Each step: what the bulk connection's permit must answer (1 = permitted). */
static int age_expect(const char* what, int got, int want) {
  if (got != want) {
    fprintf(stderr, "FAIL age bound, %s: bulk %s, want %s\n", what, got ? "permitted" : "deferred",
            want ? "permitted" : "deferred");
    return 1;
  }
  return 0;
}

static int test_age_survives_refusal(void) {
  fs_gate_reset();
  struct fs_gate_params params = {.enabled = 1, .min_share_permille = 0,
                                  .window_ns = 1000000000ull, .max_defer_ns = AGE_NS};
  fs_gate_configure(&params);
  fs_gate_started(NULL, DEV, TP, 100); /* a tp send in flight for the whole test */
  struct fs_gate_conn bulk = {0};
  int failures = age_expect("first try", fs_gate_permit(&bulk, DEV, BULK), 0);
  uint64_t first = now_ns();
  wait_past(first, AGE_NS);
  failures += age_expect("after max_defer", fs_gate_permit(&bulk, DEV, BULK), 1);
  /* the transport refused that send (no fs_gate_started): the retry keeps the deferral's age */
  failures += age_expect("retry after a refusal", fs_gate_permit(&bulk, DEV, BULK), 1);
  fs_gate_started(&bulk, DEV, BULK, 10); /* accepted: the deferral ends */
  fs_gate_done(DEV, BULK);
  failures += age_expect("next send after the accepted one", fs_gate_permit(&bulk, DEV, BULK), 0);
  struct fs_gate_stats st;
  fs_gate_stats(&st);
  if (st.max_wait_ns < AGE_NS) {
    fprintf(stderr, "FAIL age bound: longest wait %llu ns, want >= %llu\n",
            (unsigned long long)st.max_wait_ns, (unsigned long long)AGE_NS);
    failures++;
  }
  fs_gate_done(DEV, TP);
  return failures;
}

/* FLOWSCHED_GATE_WINDOW_US=0 is no window: the default one (100 ms) with a warning, as a
 * policy's window of 0, not a 1 ns one that wipes the shares at every send. */
static int test_zero_window_knob(void) {
  fs_log_set_logger(capture);
  capture_every_level = 1;
  setenv("FLOWSCHED_GATE_WINDOW_US", "0", 1);
  struct fs_params params;
  fs_params_load(&params);
  warnings[0] = '\0';
  fs_gate_setup(&params, 1);
  unsetenv("FLOWSCHED_GATE_WINDOW_US");
  if (strstr(warnings, "over 100000 us") == NULL ||
      strstr(warnings, "FLOWSCHED_GATE_WINDOW_US=0") == NULL) {
    fprintf(stderr, "FAIL: FLOWSCHED_GATE_WINDOW_US=0 logged:\n%s", warnings);
    return 1;
  }
  return 0;
}

int main(void) {
  int failures = test_age_survives_refusal() + test_zero_window_knob();
  for (size_t i = 0; i < sizeof(k_cases) / sizeof(k_cases[0]); i++) {
    fs_gate_reset();
    struct fs_gate_params params = {.enabled = 1, .min_share_permille = 500,
                                    .window_ns = k_cases[i].window_ns, .max_defer_ns = 0};
    fs_gate_configure(&params);
    fs_gate_started(NULL, DEV, TP, k_cases[i].tp_history);
    fs_gate_done(DEV, TP);
    uint64_t sent_at = now_ns();
    if (k_cases[i].quiet_windows > 0) {
      wait_past(sent_at, k_cases[i].quiet_windows * k_cases[i].window_ns);
    }
    fs_gate_started(NULL, DEV, TP, 100); /* a tp send in flight: bulk contends with it */
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
    printf("test_permit: %zu cases and the age bound ok\n", sizeof(k_cases) / sizeof(k_cases[0]));
  }
  return failures == 0 ? 0 : 1;
}
