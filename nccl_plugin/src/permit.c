/* SPDX-License-Identifier: Apache-2.0 */
#include "permit.h"

#include <string.h>
#include <time.h>

#include "flow_table.h"
#include "log.h"
#include "param.h"

#define FS_DEFAULT_MIN_SHARE 50       /* per mille */
#define FS_DEFAULT_WINDOW_US 100000   /* 100 ms */
#define FS_DEFAULT_MAX_DEFER_US 50000 /* 50 ms */

struct gate_dev {
  _Atomic int64_t inflight[FS_GATE_LEVELS];
  _Atomic uint64_t window_start_ns;
  _Atomic uint64_t bytes[FS_GATE_LEVELS]; /* decayed bytes started per level */
  _Atomic uint64_t total;
};

static struct {
  _Atomic int enabled;
  _Atomic uint32_t min_share_permille;
  _Atomic uint64_t window_ns;
  _Atomic uint64_t max_defer_ns;
  struct gate_dev devs[FS_GATE_MAX_DEVS];
  _Atomic uint64_t permits, deferrals, guard_share, guard_age, max_wait_ns;
} fs_gate;

static int64_t knob_or(int64_t value, int64_t def) {
  return value >= 0 ? value : def;
}

/* The policy file's value (ms or per mille in the table) when it sets one, else `def`. */
static int64_t policy_or(uint16_t value, int64_t scale, int64_t def) {
  return value != FS_GATE_UNSET ? (int64_t)value * scale : def;
}

void fs_gate_setup(const struct fs_params* p, int default_on) {
  struct fs_table_config cfg; /* the policy's [gating], when an agent wrote one */
  fs_table_config(&cfg);
  int policy_on = cfg.gate_mode == FS_GATE_MODE_ON    ? 1
                  : cfg.gate_mode == FS_GATE_MODE_OFF ? 0
                                                      : default_on;
  if (cfg.gate_mode == FS_GATE_MODE_DEFAULT || cfg.gate_mode > FS_GATE_MODE_TUNED) {
    cfg.gate_min_share = cfg.gate_window_ms = cfg.gate_max_defer_ms = FS_GATE_UNSET;
  }
  if (cfg.gate_min_share > 1000 && cfg.gate_min_share != FS_GATE_UNSET) {
    cfg.gate_min_share = FS_GATE_UNSET; /* out of range: not from a valid policy */
  }
  if (cfg.gate_window_ms == 0) {
    cfg.gate_window_ms = FS_GATE_UNSET;
  }
  int64_t share = policy_or(cfg.gate_min_share, 1, FS_DEFAULT_MIN_SHARE);
  int64_t window_us = policy_or(cfg.gate_window_ms, 1000, FS_DEFAULT_WINDOW_US);
  int64_t defer_us = policy_or(cfg.gate_max_defer_ms, 1000, FS_DEFAULT_MAX_DEFER_US);
  int64_t window_knob = p->gate_window_us;
  if (window_knob == 0) { /* no window: shares would be wiped at every send (no guard) */
    FS_WARN("FLOWSCHED_GATE_WINDOW_US=0 is no window; using %lld us", (long long)window_us);
    window_knob = -1;
  }
  struct fs_gate_params g = {
      .enabled = p->gating >= 0 ? (int)p->gating : policy_on,
      .min_share_permille = (uint32_t)knob_or(p->gate_min_share, share),
      .window_ns = (uint64_t)knob_or(window_knob, window_us) * 1000,
      .max_defer_ns = (uint64_t)knob_or(p->gate_max_defer_us, defer_us) * 1000,
  };
  fs_gate_configure(&g);
  FS_INFO(NCCL_INIT | NCCL_NET,
          "permit %s: guard share %u per mille over %llu us, longest deferral %llu us",
          g.enabled ? "on" : "off", g.min_share_permille,
          (unsigned long long)(g.window_ns / 1000), (unsigned long long)(g.max_defer_ns / 1000));
}

void fs_gate_configure(const struct fs_gate_params* params) {
  atomic_store(&fs_gate.min_share_permille, params->min_share_permille);
  atomic_store(&fs_gate.window_ns, params->window_ns > 0 ? params->window_ns : 1);
  atomic_store(&fs_gate.max_defer_ns, params->max_defer_ns);
  atomic_store(&fs_gate.enabled, params->enabled);
}

int fs_gate_enabled(void) {
  return atomic_load_explicit(&fs_gate.enabled, memory_order_relaxed);
}

static int in_range(int dev, uint32_t level) {
  return dev >= 0 && dev < FS_GATE_MAX_DEVS && level < FS_GATE_LEVELS;
}

static int more_urgent_in_flight(const struct gate_dev* d, uint32_t level) {
  for (uint32_t l = 0; l < level; l++) {
    if (atomic_load_explicit(&d->inflight[l], memory_order_relaxed) > 0) {
      return 1;
    }
  }
  return 0;
}

/* `value` halved `times` times (nothing left from 64 halvings on). */
static uint64_t halved(uint64_t value, uint64_t times) {
  return times >= 64 ? 0 : value >> times;
}

/* Halve `counter` `times` times, atomically with the sends that add to it meanwhile (a load
 * then a store would lose their bytes). Returns what it took away. */
static uint64_t counter_halve(_Atomic uint64_t* counter, uint64_t times) {
  uint64_t cur = atomic_load_explicit(counter, memory_order_relaxed);
  while (!atomic_compare_exchange_weak_explicit(counter, &cur, halved(cur, times),
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
  return cur - halved(cur, times);
}

/* Halve the shares once per window that ended since the last decay, so they follow the recent
 * past (one thread wins). The decay runs on the contended path only: after a stretch of k
 * windows without contention the shares are halved k times, not once, or a level that sent
 * alone for minutes would keep a share that lets less urgent levels through the guard for
 * many windows once they contend. 0 = nothing sent on the device yet (window_open). */
static void window_decay(struct gate_dev* d, uint64_t now_ns) {
  uint64_t start = atomic_load_explicit(&d->window_start_ns, memory_order_relaxed);
  uint64_t window = atomic_load_explicit(&fs_gate.window_ns, memory_order_relaxed);
  /* now_ns < start: this thread read the clock just before another one moved the start (the
   * threads of deferred connections all ask at a window's end); no window ended for it, and
   * now_ns - start would wrap to "every window ended": the shares wiped, the start moved back */
  if (start == 0 || now_ns < start || now_ns - start < window ||
      !atomic_compare_exchange_strong(&d->window_start_ns, &start, now_ns)) {
    return;
  }
  uint64_t windows = (now_ns - start) / window;
  for (int l = 0; l < FS_GATE_LEVELS; l++) {
    counter_halve(&d->bytes[l], windows);
  }
  counter_halve(&d->total, windows);
}

static int below_share(const struct gate_dev* d, uint32_t level) {
  uint64_t share = atomic_load_explicit(&fs_gate.min_share_permille, memory_order_relaxed);
  uint64_t total = atomic_load_explicit(&d->total, memory_order_relaxed);
  uint64_t mine = atomic_load_explicit(&d->bytes[level], memory_order_relaxed);
  return share > 0 && total > 0 && mine * 1000 < share * total;
}

static void stat_max(_Atomic uint64_t* slot, uint64_t value) {
  uint64_t cur = atomic_load_explicit(slot, memory_order_relaxed);
  while (value > cur && !atomic_compare_exchange_weak(slot, &cur, value)) {
  }
}

/* A guard lets a deferred send through. Its deferral is not over yet: the transport may still
 * refuse the send (no request slot, an RDMA peer not clear to send yet), and the retry must
 * keep the deferral's age, or each refusal would restart the age bound. fs_gate_started ends
 * it once the send was accepted. */
static int permit_guard(_Atomic uint64_t* guard) {
  atomic_fetch_add_explicit(guard, 1, memory_order_relaxed);
  return 1;
}

static uint64_t now_ns_monotonic(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int fs_gate_permit(struct fs_gate_conn* conn, int dev, uint32_t level) {
  if (!fs_gate_enabled() || !in_range(dev, level) || level == 0) {
    conn->deferred_since_ns = 0;
    return 1;
  }
  struct gate_dev* d = &fs_gate.devs[dev];
  if (!more_urgent_in_flight(d, level)) {
    return 1; /* the clock is read only on the contended path */
  }
  uint64_t now_ns = now_ns_monotonic();
  window_decay(d, now_ns);
  if (below_share(d, level)) {
    return permit_guard(&fs_gate.guard_share);
  }
  uint64_t max_defer = atomic_load_explicit(&fs_gate.max_defer_ns, memory_order_relaxed);
  if (conn->deferred_since_ns == 0) {
    conn->deferred_since_ns = now_ns;
  } else if (max_defer > 0 && now_ns - conn->deferred_since_ns >= max_defer) {
    return permit_guard(&fs_gate.guard_age);
  }
  atomic_fetch_add_explicit(&fs_gate.deferrals, 1, memory_order_relaxed);
  return 0;
}

/* The first bytes on a device open its first window, so that the decay counts the windows
 * since then (one clock read per device, not per send). */
static void window_open(struct gate_dev* d) {
  if (atomic_load_explicit(&d->window_start_ns, memory_order_relaxed) == 0) {
    uint64_t unset = 0;
    atomic_compare_exchange_strong(&d->window_start_ns, &unset, now_ns_monotonic());
  }
}

void fs_gate_started(struct fs_gate_conn* conn, int dev, uint32_t level, size_t bytes) {
  atomic_fetch_add_explicit(&fs_gate.permits, 1, memory_order_relaxed);
  if (conn != NULL && conn->deferred_since_ns != 0) { /* the deferral ends here, in a send */
    stat_max(&fs_gate.max_wait_ns, now_ns_monotonic() - conn->deferred_since_ns);
    conn->deferred_since_ns = 0;
  }
  if (!in_range(dev, level)) {
    return;
  }
  struct gate_dev* d = &fs_gate.devs[dev];
  window_open(d);
  atomic_fetch_add_explicit(&d->inflight[level], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->bytes[level], bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&d->total, bytes, memory_order_relaxed);
}

void fs_gate_done(int dev, uint32_t level) {
  if (in_range(dev, level)) {
    atomic_fetch_sub_explicit(&fs_gate.devs[dev].inflight[level], 1, memory_order_relaxed);
  }
}

void fs_gate_stats(struct fs_gate_stats* out) {
  out->permits = atomic_load(&fs_gate.permits);
  out->deferrals = atomic_load(&fs_gate.deferrals);
  out->guard_share = atomic_load(&fs_gate.guard_share);
  out->guard_age = atomic_load(&fs_gate.guard_age);
  out->max_wait_ns = atomic_load(&fs_gate.max_wait_ns);
}

void fs_gate_reset(void) {
  for (int i = 0; i < FS_GATE_MAX_DEVS; i++) {
    struct gate_dev* d = &fs_gate.devs[i];
    for (int l = 0; l < FS_GATE_LEVELS; l++) {
      atomic_store(&d->inflight[l], 0);
      atomic_store(&d->bytes[l], 0);
    }
    atomic_store(&d->total, 0);
    atomic_store(&d->window_start_ns, 0);
  }
}
