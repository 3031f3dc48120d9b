/* SPDX-License-Identifier: Apache-2.0
 * Process-wide state (refcounted) and per-communicator contexts (refcounted).
 *
 * NCCL >= 2.28 calls init/finalize once per communicator (v11+) and may dlclose the library
 * when the last one is finalized, so the global state is built by the first reference and
 * torn down completely by the last: parameters, devices and the table mapping. Contexts,
 * listen comms and connections each hold one reference, so the table is never unmapped under
 * a live connection. The v10 API has no finalize: its process-wide context keeps a reference
 * until the library is unloaded.
 *
 * A context is itself referenced by its owner (released by finalize), by each of its listen
 * comms and by each of its connections, finished or still being connected or assembled, all
 * of which read it. The last release frees it and drops its global reference, so finalize
 * may come before closeListen or before a pending connect completes.
 */
#ifndef FLOWSCHED_CONTEXT_H
#define FLOWSCHED_CONTEXT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "nccl/common.h"
#include "param.h"
#include "socket_util.h"

struct fs_comm;

struct fs_context {
  uint64_t id; /* unique in the process: a later context may reuse a freed one's address */
  uint64_t comm_id;
  int32_t traffic_class;
  atomic_int refs; /* owner + listen comms + connections */
  pthread_mutex_t lock; /* guards the fields below (service and progress threads) */
  struct fs_comm* comms; /* open connections created through this context */
  uint32_t net_op, net_algo, net_proto; /* latest setNetAttr hint (0 = none seen) */
  _Atomic int32_t self_rank; /* this process's rank: the tag of its first isend (v11+; -1) */
  char class_name[32]; /* FLOWSCHED_CLASS when this context was created (v11+; "" = unset) */
};

/* Take a reference on the global state, initialising it on the first one. */
int fs_global_acquire(ncclDebugLogger_t logger);
/* Drop a reference; the last one tears everything down. */
void fs_global_release(void);
const struct fs_params* fs_global_params(void);
int fs_global_device_count(void);
/* The device `dev`, or NULL when out of range. */
const struct fs_device* fs_global_device(int dev);
/* The process-wide context used by the v10 API (created by the first v10 init). */
int fs_global_v10_context(ncclDebugLogger_t logger, struct fs_context** out);

int fs_context_create(uint64_t comm_id, int32_t traffic_class, ncclDebugLogger_t logger,
                      struct fs_context** out);
/* NCCL's finalize: drop the owner's reference (the context lives on while comms use it). */
void fs_context_finalize(struct fs_context* ctx);
/* Take a reference for a listen comm or a connection. */
void fs_context_retain(struct fs_context* ctx);
/* Drop a reference; the last one frees the context and releases its global reference. */
void fs_context_release(struct fs_context* ctx);
/* Record a setNetAttr hint. It is a per-context hint that NCCL changes per operation: only
 * connections created after it take it (as their connect-time attribute); the slots of
 * open connections keep theirs. */
void fs_context_set_net_attr(struct fs_context* ctx, uint32_t op, uint32_t algo, uint32_t proto);
/* The hint a connection created now on this thread records. */
void fs_context_connect_attr(struct fs_context* ctx, uint32_t* op, uint32_t* algo,
                             uint32_t* proto);
void fs_context_add_comm(struct fs_context* ctx, struct fs_comm* comm);
void fs_context_remove_comm(struct fs_context* ctx, struct fs_comm* comm);

/* Flow class of a connection of `ctx` (may be NULL): trafficClass through the table's class
 * map, else FLOWSCHED_CLASS as it was when the context was created (v11+: per communicator)
 * or, for the process-wide v8-v10 context, as it is now (at connect/accept), else tp. Attaches the table first if it is not mapped yet. */
uint16_t fs_class_resolve(const struct fs_context* ctx, int32_t traffic_class);
/* Parse a class label or id ("param_sync", "2"); -1 when unknown. */
int fs_class_parse(const char* text);

#endif
