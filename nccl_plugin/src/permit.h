/* SPDX-License-Identifier: Apache-2.0
 * The host-side permit (MFS's submit/permit): strict priority between the levels of one
 * device, enforced by deferring isend (NCCL retries a NULL request on its next loop).
 *
 * A send at level L on device d is permitted when no connection of this process at a more
 * urgent level (< L) on d has a send in flight (accepted by the transport, not yet completed).
 * It counts accepted sends only, never queued work: an accepted send completes without
 * waiting for a deferred one, so the rule alone adds no dependency (rdma-wrapping.md §5).
 * Sends that need more sends to finish (multi-recv groups, rendezvous) can still close a cycle,
 * so a starvation guard bounds every deferral:
 *  - share: a level whose bytes on the device over the window (halved each window) are below
 *    min_share of all bytes may send anyway, so it keeps that share under contention;
 *  - age: a connection deferred for max_defer since its first deferral sends anyway (the
 *    deferral lasts until a send is accepted, whatever the transport refused meanwhile).
 * The decision is re-taken on every call, so a promotion lifts a deferral at the next retry.
 * State is per process (every comm's progress thread of the process shares it), lock-free.
 */
#ifndef FLOWSCHED_PERMIT_H
#define FLOWSCHED_PERMIT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define FS_GATE_MAX_DEVS 64
#define FS_GATE_LEVELS 16

struct fs_gate_params {
  int enabled;
  uint32_t min_share_permille; /* 0 = no share guard */
  uint64_t window_ns;
  uint64_t max_defer_ns; /* 0 = no age bound */
};

/* Per connection: when its current deferral began (0 = not deferred). */
struct fs_gate_conn {
  uint64_t deferred_since_ns;
};

/* Counters since the library was loaded (reported at close and by the tests). */
struct fs_gate_stats {
  uint64_t permits;        /* sends started */
  uint64_t deferrals;      /* isend calls answered with a NULL request */
  uint64_t guard_share;    /* sends the share guard let through */
  uint64_t guard_age;      /* sends the age bound let through */
  uint64_t max_wait_ns;    /* longest deferral that ended in a send */
};

struct fs_params;
/* Configure from the knobs (FLOWSCHED_GATING etc.; -1 = the policy file's value, else the
 * built-in default) with gating on by default when `default_on` (wrapping mode). */
void fs_gate_setup(const struct fs_params* params, int default_on);
/* Set the parameters (at initialisation; the counters are kept). */
void fs_gate_configure(const struct fs_gate_params* params);
int fs_gate_enabled(void);
/* May a send at `level` on `dev` start now? 1 = yes (call fs_gate_started once the
 * transport accepted it), 0 = defer (answer NCCL with a NULL request). */
int fs_gate_permit(struct fs_gate_conn* conn, int dev, uint32_t level);
/* A permitted send was accepted / completed (or failed, or its connection was closed with it
 * still in flight). Levels and devices out of range are ignored (never gated). Acceptance ends
 * `conn`'s deferral (NULL: none): a permitted send the transport refuses stays deferred since
 * its first deferral, so that the age bound is not restarted by each refusal. */
void fs_gate_started(struct fs_gate_conn* conn, int dev, uint32_t level, size_t bytes);
void fs_gate_done(int dev, uint32_t level);
void fs_gate_stats(struct fs_gate_stats* out);
/* Forget in-flight counts and shares (last user gone, or a test). */
void fs_gate_reset(void);

#endif
