/* SPDX-License-Identifier: Apache-2.0
 * The node's shared-memory flow table, seen from the plugin.
 *
 * The byte layout is documented once, in flowsched/shm/layout.py; these structs mirror it and
 * the static asserts below pin every offset. A pytest test compares the offsets printed by
 * tests/layout_dump.c with the Python tables field by field.
 *
 * The agent creates the table; the plugin maps it (lazily, at connection setup), claims one
 * slot per connection with a compare-and-swap, reads the slot's `level` with one atomic load
 * per isend, and adds its bytes with atomic adds. Without a usable table every connection
 * gets a private slot, so the hot path is the same and runs at the class's default level.
 */
#ifndef FLOWSCHED_FLOW_TABLE_H
#define FLOWSCHED_FLOW_TABLE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define FS_TABLE_MAGIC 0x54465346u /* "FSFT" */
#define FS_TABLE_VERSION 1u
#define FS_TABLE_HEADER_SIZE 4096u
#define FS_TABLE_SLOT_SIZE 128u
#define FS_TABLE_MAX_LEVELS 16
#define FS_TABLE_MAX_CLASS_MAP 32
#define FS_TABLE_MAX_CLASSES 16
#define FS_LEVEL_UNSET 0xFFFFFFFFu
#define FS_GATE_MODE_DEFAULT 0 /* no [gating] in the policy (or an older agent): ignore gate_* */
#define FS_GATE_MODE_OFF 1
#define FS_GATE_MODE_ON 2
#define FS_GATE_MODE_TUNED 3 /* [gating] without `enabled`: the gate_* numbers only */
#define FS_GATE_UNSET 0xFFFFu

enum fs_slot_state { FS_SLOT_FREE = 0, FS_SLOT_CLAIMED = 1, FS_SLOT_ACTIVE = 2, FS_SLOT_CLOSED = 3 };
enum fs_direction { FS_DIR_SEND = 0, FS_DIR_RECV = 1 };
/* The slot was claimed for a connection that was already open: it moved here from a private
 * slot (no table when it was made) or from a table since re-created, and its bytes, messages,
 * open_ns and applied level carry over from there. */
#define FS_SLOT_FLAG_MOVED 1u

struct fs_class_map_entry {
  int32_t traffic_class;
  uint32_t class_id;
};

struct fs_level_marking {
  uint8_t dscp;
  uint8_t pad[3];
  uint32_t so_priority;
};

struct fs_table_header {
  uint32_t magic;
  uint32_t version;
  uint32_t header_size;
  uint32_t slot_size;
  uint32_t num_slots;
  uint32_t num_levels;
  uint32_t agent_pid;
  _Atomic uint32_t config_seq; /* seqlock over the config area, odd while written */
  uint64_t generation;
  _Atomic uint64_t heartbeat_ns;
  uint32_t flags;
  uint8_t reserved0[12];
  /* config area */
  uint32_t num_class_map;
  uint32_t fallback_class;
  struct fs_class_map_entry class_map[FS_TABLE_MAX_CLASS_MAP];
  uint8_t default_level[FS_TABLE_MAX_CLASSES];
  uint8_t gate_mode; /* the policy's permit: FS_GATE_MODE_* (permit.c) */
  uint8_t reserved1;
  uint16_t gate_min_share;    /* per mille, FS_GATE_UNSET = the plugin's default */
  uint16_t gate_window_ms;    /* FS_GATE_UNSET = the plugin's default */
  uint16_t gate_max_defer_ms; /* FS_GATE_UNSET = the plugin's default */
  struct fs_level_marking level_marking[FS_TABLE_MAX_LEVELS];
  uint8_t reserved2[3616];
};

struct fs_table_slot {
  _Atomic uint32_t state;
  uint32_t pid;
  _Atomic uint64_t claim_seq;
  uint64_t comm_id;
  _Atomic int32_t peer_rank;
  int32_t traffic_class;
  _Atomic uint32_t level; /* written by the agent */
  uint16_t class_id;
  uint8_t direction;
  uint8_t flags; /* FS_SLOT_FLAG_*; 0 on a plain claim (the agent zeroes it when it frees) */
  _Atomic uint64_t bytes;
  _Atomic uint64_t messages;
  uint64_t open_ns;
  _Atomic uint64_t last_ns;
  _Atomic uint32_t net_op;
  _Atomic uint32_t net_algo;
  _Atomic uint32_t net_proto;
  _Atomic uint32_t applied_level;
  _Atomic uint64_t applied_ns;
  _Atomic uint64_t level_set_ns; /* written by the agent */
  uint32_t dev;
  uint8_t reserved1[4];
  uint64_t pid_ns; /* inode of the owner's pid namespace (0 = unknown): `pid` is a pid there */
  uint64_t start_ticks; /* the owner's start, clock ticks after boot (host's count; 0 unknown) */
};

_Static_assert(sizeof(struct fs_table_header) == FS_TABLE_HEADER_SIZE, "header size");
_Static_assert(sizeof(struct fs_table_slot) == FS_TABLE_SLOT_SIZE, "slot size");
_Static_assert(offsetof(struct fs_table_header, config_seq) == 28, "config_seq");
_Static_assert(offsetof(struct fs_table_header, generation) == 32, "generation");
_Static_assert(offsetof(struct fs_table_header, flags) == 48, "flags");
_Static_assert(offsetof(struct fs_table_header, num_class_map) == 64, "num_class_map");
_Static_assert(offsetof(struct fs_table_header, class_map) == 72, "class_map");
_Static_assert(offsetof(struct fs_table_header, default_level) == 328, "default_level");
_Static_assert(offsetof(struct fs_table_header, gate_mode) == 344, "gate_mode");
_Static_assert(offsetof(struct fs_table_header, gate_max_defer_ms) == 350, "gate_max_defer_ms");
_Static_assert(offsetof(struct fs_table_header, level_marking) == 352, "level_marking");
_Static_assert(offsetof(struct fs_table_slot, level) == 32, "level");
_Static_assert(offsetof(struct fs_table_slot, flags) == 39, "flags");
_Static_assert(offsetof(struct fs_table_slot, bytes) == 40, "bytes");
_Static_assert(offsetof(struct fs_table_slot, applied_level) == 84, "applied_level");
_Static_assert(offsetof(struct fs_table_slot, dev) == 104, "dev");
_Static_assert(offsetof(struct fs_table_slot, pid_ns) == 112, "pid_ns");
_Static_assert(offsetof(struct fs_table_slot, start_ticks) == 120, "start_ticks");

/* A snapshot of the config area (taken under the seqlock) or of the compiled defaults. */
struct fs_table_config {
  uint32_t num_levels;
  uint32_t fallback_class;
  uint32_t num_class_map;
  struct fs_class_map_entry class_map[FS_TABLE_MAX_CLASS_MAP];
  uint8_t default_level[FS_TABLE_MAX_CLASSES];
  struct fs_level_marking level_marking[FS_TABLE_MAX_LEVELS];
  uint8_t gate_mode; /* the policy's permit settings (FS_GATE_MODE_*, FS_GATE_UNSET) */
  uint16_t gate_min_share, gate_window_ms, gate_max_defer_ms;
  int from_table; /* 0: compiled-in defaults */
};

/* What a connection tells the table when it claims a slot. */
struct fs_flow_info {
  uint64_t comm_id;
  int32_t peer_rank;
  int32_t traffic_class;
  uint16_t class_id;
  uint8_t direction;
  uint32_t dev;
  uint32_t net_op, net_algo, net_proto;
};

/* config_seq value that no stable config area has (it is odd): "no consistent copy used". */
#define FS_CONFIG_SEQ_NONE 0xFFFFFFFFu

/* A connection's binding to its slot (a table slot, or `local` when there is no table). */
struct fs_flow {
  struct fs_table_slot* slot;
  struct fs_table_slot local;
  /* The config_seq word this flow watches: the mapped table's, or a constant 0 when no table
   * was mapped when the flow opened. The mapping outlives the flow (it holds a global
   * reference), so the pointer stays valid. */
  const _Atomic uint32_t* config_seq;
  uint32_t seen_level;      /* raw `level` value last acted on */
  uint32_t seen_config_seq; /* config_seq of the config `marking` was computed from */
  uint16_t class_id;
  struct fs_level_marking marking; /* what the sockets carry now */
  uint32_t table_epoch;            /* fs_table_epoch when the slot was bound (fs_flow_account) */
};

/* Moving open connections into a table that appeared or was re-created after they were made.
 * fs_table_epoch moves whenever a table is published (mapped or followed); a connection whose
 * epoch differs moves its slot there at its next completed message (fs_flow_rebind). Without a
 * new connection setup nobody would look for the table, so completed messages also look for
 * it, at most once per FS_TABLE_RECHECK_NS per process (fs_table_recheck): NCCL keeps a
 * communicator's connections for its life, and a job that started before the agent would
 * otherwise never be scheduled. */
#define FS_TABLE_RECHECK_NS 1000000000ull
extern _Atomic uint32_t fs_table_epoch;
extern _Atomic uint64_t fs_table_recheck_ns; /* UINT64_MAX until a table path was given */
void fs_flow_rebind(struct fs_flow* flow);
void fs_table_recheck(uint64_t now_ns);

/* Map the table at `path` if not mapped yet (0, or -errno; logs once per failure kind). */
int fs_table_attach(const char* path);
/* Find the table's path with `resolve` (into a buffer of `cap` bytes) at each look instead
 * of taking fs_table_attach's: for a default path that depends on which files exist
 * (FLOWSCHED_TABLE unset, fs_table_default_path). NULL: no resolver. */
void fs_table_resolve_path_with(void (*resolve)(char* out, size_t cap));
/* Unmap the table (global teardown). */
void fs_table_detach(void);
/* The config in force: the last consistent copy of the config area (re-read only when
 * config_seq moved), or the compiled defaults when no table is attached or no consistent copy
 * was ever read. */
void fs_table_config(struct fs_table_config* out);
/* Class id for an NCCL trafficClass, or -1 when the map names none. */
int fs_table_class_for_traffic_class(const struct fs_table_config* cfg, int32_t traffic_class);
/* Claim a slot for a new connection (falls back to flow->local) and fill it. */
void fs_flow_open(struct fs_flow* flow, const struct fs_flow_info* info);
/* Mark the slot CLOSED (bytes final). */
void fs_flow_close(struct fs_flow* flow);
/* Effective level and marking for a raw slot `level` value; *config_seq receives the value
 * of the flow's config_seq word that the result corresponds to (FS_CONFIG_SEQ_NONE when the
 * table's config area could not be read consistently yet). */
uint32_t fs_flow_effective_level(const struct fs_flow* flow, uint32_t raw,
                                 struct fs_level_marking* marking, uint32_t* config_seq);
/* Record that `level` now is on the sockets. */
void fs_flow_applied(struct fs_flow* flow, uint32_t level);
/* CLOCK_MONOTONIC as the host counts it (the initial time namespace's), in ns: the clock of
 * the table's *_ns fields, also inside a time namespace with a monotonic offset. */
uint64_t fs_now_ns(void);
/* Re-read this process's time namespace offset (lazily at the first fs_now_ns, also a forked
 * child's, and at each fs_flow_open). */
void fs_clock_refresh(void);
/* Where the offsets are read: /proc/self/timens_offsets (unit tests point it elsewhere). */
extern const char* fs_timens_offsets_path;

/* Hot path: must the sockets' marking be recomputed? Yes when the agent wrote another level
 * into the slot, or when it rewrote the config area (a new DSCP table, new class defaults)
 * since the marking was computed. Two relaxed loads and compares, no branch on the config:
 * the config_seq load is only a hint (the recompute re-reads the area under its seqlock), and
 * an odd config_seq (a rewrite in progress) is not acted on, so one rewrite costs one
 * recompute, taken once the writer is done. */
static inline int fs_flow_level_changed(struct fs_flow* flow, uint32_t* raw) {
  *raw = atomic_load_explicit(&flow->slot->level, memory_order_relaxed);
  uint32_t seq = atomic_load_explicit(flow->config_seq, memory_order_relaxed);
  return (*raw != flow->seen_level) | (((seq & 1u) == 0) & (seq != flow->seen_config_seq));
}

/* Hot path: account one message (two relaxed loads more on the way to the counters: the
 * recheck deadline and the table epoch). */
static inline void fs_flow_account(struct fs_flow* flow, uint64_t bytes, uint64_t now_ns) {
  if (now_ns >= atomic_load_explicit(&fs_table_recheck_ns, memory_order_relaxed)) {
    fs_table_recheck(now_ns);
  }
  if (flow->table_epoch != atomic_load_explicit(&fs_table_epoch, memory_order_relaxed)) {
    fs_flow_rebind(flow);
  }
  atomic_fetch_add_explicit(&flow->slot->bytes, bytes, memory_order_relaxed);
  atomic_fetch_add_explicit(&flow->slot->messages, 1, memory_order_relaxed);
  atomic_store_explicit(&flow->slot->last_ns, now_ns, memory_order_relaxed);
}

#endif
