/* SPDX-License-Identifier: Apache-2.0 */
#include "flow_table.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "class_defaults.h"
#include "log.h"

/* Synchronization. NCCL calls in from several threads at once: service threads (listen,
 * connect, accept: slot claims and class resolution) and progress threads (isend, test: level
 * and config changes), across all communicators of the process.
 *  - `lock` serializes mapping, unmapping, slot claims and moves. `base` is published with an
 *    atomic store so that readers outside the lock see either NULL or a fully validated
 *    mapping; the mapping is torn down only by the last global reference, when no connection
 *    exists. A progress thread takes it only to move a connection (fs_flow_rebind) and, with
 *    trylock, for the once-a-second look (fs_table_recheck).
 *  - `config_lock` guards the cached config (`config`, `config_seq`, `config_hdr`,
 *    `config_valid`). Every read of the config goes through it: the cache is refreshed from
 *    the shared area (under the agent's seqlock) only when config_seq moved or the table
 *    changed, and is used as is while the agent holds the seqlock, so a rewrite in progress
 *    never makes a connection fall back to the compiled-in defaults once one consistent copy
 *    was read. The lock is taken on connection setup and on level or config changes, never on
 *    the per-message path. Order: `lock` before `config_lock` (fs_table_detach, table_follow
 *    and fs_flow_rebind take both). */
/* Re-created tables followed per process (each keeps the one it replaced mapped). */
#define FS_TABLE_MAX_RETIRED 8

static struct {
  pthread_mutex_t lock;
  uint8_t* _Atomic base;
  size_t size;
  uint32_t num_slots;
  _Atomic uint32_t claim_cursor;
  atomic_int warned_missing;
  atomic_int warned_corrupt;
  atomic_int warned_full;
  dev_t dev; /* the mapped file, to notice a re-created table (fs_table_attach) */
  ino_t ino;
  char path[PATH_MAX]; /* where the table is looked for (fs_table_attach's, or resolved) */
  void (*resolve_path)(char* out, size_t cap); /* decides `path` at every look, if set */
  /* Tables replaced by a newer file at the same path: kept mapped for the connections whose
   * slots are in them until they move to the new table (fs_flow_rebind), or for good when it
   * had no free slot for them (they run on at their last level, unseen by the new agent). */
  struct {
    uint8_t* base;
    size_t size;
  } retired[FS_TABLE_MAX_RETIRED];
  int nretired;
  pthread_mutex_t config_lock;
  struct fs_table_config config; /* last consistent copy (sanitized) */
  uint32_t config_seq;           /* the config_seq it was read at */
  const struct fs_table_header* config_hdr; /* the table it was read from (two tables' seqs
                                             * may be equal: an agent that wrote once has 2) */
  int config_valid;              /* 0 until one consistent copy was read */
} fs_table = {.lock = PTHREAD_MUTEX_INITIALIZER, .config_lock = PTHREAD_MUTEX_INITIALIZER};

/* What a flow watches when no table was mapped at its opening: a config_seq that never moves. */
static const _Atomic uint32_t fs_no_table_config_seq = 0;

_Atomic uint32_t fs_table_epoch = 0;
_Atomic uint64_t fs_table_recheck_ns = UINT64_MAX;

const char* fs_timens_offsets_path = "/proc/self/timens_offsets";

/* The monotonic offset of this process's time namespace, in ns (fs_clock_refresh). */
static struct {
  _Atomic int64_t monotonic_ns;
  atomic_int known; /* 0 until read once */
} fs_clock;

static ssize_t read_small(const char* path, char* buf, size_t size);

/* The offset of clock `name` (numbered `id` by older kernels) in this process's time namespace
 * into *sec and *nsec (0 when the file or the line is absent: no time namespaces). 0 on
 * success, -1 when the line is malformed. */
static int timens_offset(const char* name, const char* id, long long* sec, long long* nsec) {
  char buf[256];
  *sec = *nsec = 0;
  if (read_small(fs_timens_offsets_path, buf, sizeof(buf)) < 0) return 0;
  char* save = NULL;
  for (char* line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    char clock[16];
    if (sscanf(line, "%15s", clock) != 1) continue;
    if (strcmp(clock, name) != 0 && strcmp(clock, id) != 0) continue;
    if (sscanf(line, "%*s %lld %lld", sec, nsec) != 2 || *nsec < 0 || *nsec >= 1000000000LL) {
      *sec = *nsec = 0;
      return -1;
    }
  }
  return 0;
}

/* After unshare(CLONE_NEWTIME), only the caller's children are in the new time namespace: a
 * child forked then has another offset on its clock than the one its parent cached. The child
 * reads its own at its first fs_now_ns (a read here would not be async-signal-safe). */
static void clock_forget_in_child(void) {
  atomic_store_explicit(&fs_clock.known, 0, memory_order_relaxed);
}

static void clock_watch_forks(void) {
  pthread_atfork(NULL, NULL, clock_forget_in_child);
}

/* Whether /proc/self/timens_offsets shows this process's own time namespace. It shows the one
 * its children get: another after unshare(CLONE_NEWTIME), whose caller stays where it was.
 * Without time namespaces (no such links), the file is absent anyway. */
static int timens_offsets_own(void) {
  struct stat own, children;
  if (stat("/proc/self/ns/time", &own) != 0 ||
      stat("/proc/self/ns/time_for_children", &children) != 0) {
    return 1;
  }
  return own.st_dev == children.st_dev && own.st_ino == children.st_ino;
}

void fs_clock_refresh(void) {
  static pthread_once_t watching = PTHREAD_ONCE_INIT;
  pthread_once(&watching, clock_watch_forks);
  long long sec = 0, nsec = 0;
  if (timens_offsets_own()) {
    timens_offset("monotonic", "1", &sec, &nsec); /* 1: CLOCK_MONOTONIC's id; malformed: 0 */
  } else if (atomic_load_explicit(&fs_clock.known, memory_order_acquire)) {
    return; /* the offset read before the unshare: a namespace's offsets never change */
  } /* else unknowable from here: the host's clock, as without a namespace */
  atomic_store_explicit(&fs_clock.monotonic_ns, sec * 1000000000LL + nsec, memory_order_relaxed);
  atomic_store_explicit(&fs_clock.known, 1, memory_order_release);
}

/* In a time namespace (CLONE_NEWTIME), CLOCK_MONOTONIC reads the host's plus the namespace's
 * offset; the agent writes and reads the table's *_ns fields on the host's, so the offset is
 * taken off here: an agent's heartbeat, the slots' open_ns (compared with the starts of pids
 * the agent sees) and the agent's level_set_ns against applied_ns are on one clock. */
uint64_t fs_now_ns(void) {
  if (!atomic_load_explicit(&fs_clock.known, memory_order_acquire)) fs_clock_refresh();
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  uint64_t own = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
  return own - (uint64_t)atomic_load_explicit(&fs_clock.monotonic_ns, memory_order_relaxed);
}

static struct fs_table_header* table_header(void) {
  return (struct fs_table_header*)fs_table.base;
}

static struct fs_table_slot* table_slot(uint32_t index) {
  return (struct fs_table_slot*)(fs_table.base + FS_TABLE_HEADER_SIZE +
                                 (size_t)index * FS_TABLE_SLOT_SIZE);
}

/* The header's layout words, copied once out of the shared mapping. Another process may
 * rewrite the header at any time (a writer that re-creates the file, a corrupt or hostile
 * one): every check and every later use must see the same values, so they are read once, here,
 * through a volatile view (the compiler may not read the mapping again for a later use). */
struct table_layout {
  uint32_t magic, version, header_size, slot_size, num_slots, num_levels;
};

static struct table_layout table_layout_copy(const void* base) {
  const volatile struct fs_table_header* hdr = base;
  return (struct table_layout){.magic = hdr->magic,
                               .version = hdr->version,
                               .header_size = hdr->header_size,
                               .slot_size = hdr->slot_size,
                               .num_slots = hdr->num_slots,
                               .num_levels = hdr->num_levels};
}

/* Why a mapped header (its copied layout) cannot be used, or NULL when it is fine. */
static const char* table_header_problem(const struct table_layout* hdr, size_t file_size) {
  if (hdr->magic != FS_TABLE_MAGIC) {
    return "bad magic";
  }
  if (hdr->version != FS_TABLE_VERSION) {
    return "unsupported version";
  }
  if (hdr->header_size != FS_TABLE_HEADER_SIZE || hdr->slot_size != FS_TABLE_SLOT_SIZE) {
    return "unexpected header or slot size";
  }
  if (hdr->num_slots == 0 ||
      file_size < FS_TABLE_HEADER_SIZE + (size_t)hdr->num_slots * FS_TABLE_SLOT_SIZE) {
    return "file shorter than its slots";
  }
  if (hdr->num_levels == 0 || hdr->num_levels > FS_TABLE_MAX_LEVELS) {
    return "num_levels out of range";
  }
  return NULL;
}

/* Why an opened table file must not be trusted, or NULL. The table steers this process's
 * traffic and receives its byte counts: it must be a regular file (O_NOFOLLOW refused a
 * symbolic link already) owned by this user or by root (the agent), never by another user,
 * and not writable by others (a root agent serving a --group makes it 0660, never o+w). */
static const char* table_owner_problem(const struct stat* st) {
  if (!S_ISREG(st->st_mode)) {
    return "not a regular file";
  }
  if (st->st_uid != 0 && st->st_uid != geteuid()) {
    return "owned by another user";
  }
  if (st->st_mode & S_IWOTH) {
    return "writable by others";
  }
  return NULL;
}

/* A validated mapping of a table file, not yet published. */
struct table_mapping {
  uint8_t* base;
  size_t size;
  uint32_t num_slots; /* validated against `size` (never re-read from the mapping) */
  dev_t dev;
  ino_t ino;
};

static int table_map_file(const char* path, struct table_mapping* out) {
  int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int rc = FS_NEG_ERRNO();
    if (rc == -ELOOP) {
      FS_WARN_ONCE(fs_table.warned_corrupt,
                   "flow table %s is a symbolic link: refused, using default levels", path);
    } else {
      FS_WARN_ONCE(fs_table.warned_missing,
                   "no flow table at %s (%s): connections run at their class's default level",
                   path, fs_errstr(-rc));
    }
    return rc;
  }
  struct stat st;
  const char* untrusted = fstat(fd, &st) == 0 ? table_owner_problem(&st) : "cannot stat";
  if (untrusted != NULL) {
    close(fd);
    FS_WARN_ONCE(fs_table.warned_corrupt, "flow table %s refused (%s): using default levels",
                 path, untrusted);
    return -EPERM;
  }
  if ((size_t)st.st_size < FS_TABLE_HEADER_SIZE) {
    close(fd);
    FS_WARN_ONCE(fs_table.warned_corrupt, "flow table %s is too short: using default levels", path);
    return -EPROTO;
  }
  void* base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    FS_WARN_ONCE(fs_table.warned_corrupt, "cannot map flow table %s: using default levels", path);
    return -ENOMEM;
  }
  struct table_layout layout = table_layout_copy(base);
  const char* problem = table_header_problem(&layout, (size_t)st.st_size);
  if (problem != NULL) {
    munmap(base, (size_t)st.st_size);
    FS_WARN_ONCE(fs_table.warned_corrupt, "flow table %s unusable (%s): using default levels",
                 path, problem);
    return -EPROTO;
  }
  *out = (struct table_mapping){.base = base,
                                .size = (size_t)st.st_size,
                                .num_slots = layout.num_slots,
                                .dev = st.st_dev,
                                .ino = st.st_ino};
  return 0;
}

/* Publish `m` as the table new connections claim slots in (called with `lock` held). */
static void table_publish(const char* path, const struct table_mapping* m) {
  fs_table.size = m->size;
  fs_table.dev = m->dev;
  fs_table.ino = m->ino;
  fs_table.num_slots = m->num_slots; /* the value checked against the file size */
  atomic_store(&fs_table.claim_cursor, 0);
  fs_table.base = m->base; /* published to readers outside the lock */
  atomic_fetch_add(&fs_table_epoch, 1); /* open connections elsewhere move here (rebind) */
  FS_INFO(NCCL_INIT | NCCL_NET, "flow table %s mapped (%u slots)", path, fs_table.num_slots);
}

static int table_map(const char* path) {
  struct table_mapping m;
  int rc = table_map_file(path, &m);
  if (rc == 0) {
    table_publish(path, &m);
  }
  return rc;
}

/* 1 when `path` now names another file than the mapped table: an agent re-created it (to
 * resize it, say). Checked at connection setup, never on the per-message path. */
static int table_replaced(const char* path) {
  struct stat st;
  return stat(path, &st) == 0 && (st.st_dev != fs_table.dev || st.st_ino != fs_table.ino);
}

/* Map the new table at `path` for the connections made from now on; the current one stays
 * mapped (retired) for the connections whose slots are in it. At most FS_TABLE_MAX_RETIRED
 * replacements are followed: after that, new connections stay on the current table. */
static void table_follow(const char* path) {
  if (fs_table.nretired >= FS_TABLE_MAX_RETIRED) {
    return;
  }
  struct table_mapping m;
  if (table_map_file(path, &m) != 0) {
    return; /* a table being created: the next connection looks again */
  }
  fs_table.retired[fs_table.nretired].base = fs_table.base;
  fs_table.retired[fs_table.nretired].size = fs_table.size;
  fs_table.nretired++;
  pthread_mutex_lock(&fs_table.config_lock);
  fs_table.config_valid = 0; /* the new table's agent may have another policy */
  pthread_mutex_unlock(&fs_table.config_lock);
  FS_WARN("flow table %s was re-created: connections move to the new one at their next "
          "completed message",
          path);
  table_publish(path, &m);
}

/* Where to look for the table now: what the resolver says when there is one (it re-decides
 * at every look), else `given` (NULL: the path remembered). Caller holds `lock`. */
static void table_refresh_path(const char* given) {
  if (fs_table.resolve_path != NULL) {
    fs_table.resolve_path(fs_table.path, sizeof(fs_table.path));
  } else if (given != NULL && strcmp(fs_table.path, given) != 0) {
    snprintf(fs_table.path, sizeof(fs_table.path), "%s", given);
  }
}

void fs_table_resolve_path_with(void (*resolve)(char* out, size_t cap)) {
  pthread_mutex_lock(&fs_table.lock);
  fs_table.resolve_path = resolve;
  pthread_mutex_unlock(&fs_table.lock);
}

int fs_table_attach(const char* path) {
  pthread_mutex_lock(&fs_table.lock);
  table_refresh_path(path);
  if (atomic_load(&fs_table_recheck_ns) == UINT64_MAX) { /* arm the look (fs_table_recheck) */
    atomic_store(&fs_table_recheck_ns, fs_now_ns() + FS_TABLE_RECHECK_NS);
  }
  int rc = 0;
  if (fs_table.base == NULL) {
    rc = table_map(fs_table.path);
  } else if (table_replaced(fs_table.path)) {
    table_follow(fs_table.path);
  }
  pthread_mutex_unlock(&fs_table.lock);
  return rc;
}

void fs_table_detach(void) {
  pthread_mutex_lock(&fs_table.lock);
  if (fs_table.base != NULL) {
    munmap(fs_table.base, fs_table.size);
  }
  for (int i = 0; i < fs_table.nretired; i++) {
    munmap(fs_table.retired[i].base, fs_table.retired[i].size);
  }
  fs_table.nretired = 0;
  atomic_store(&fs_table_recheck_ns, UINT64_MAX); /* no connection left to move */
  fs_table.base = NULL;
  fs_table.size = 0;
  fs_table.num_slots = 0;
  pthread_mutex_lock(&fs_table.config_lock);
  fs_table.config_valid = 0; /* a later mapping may be another agent's table */
  pthread_mutex_unlock(&fs_table.config_lock);
  pthread_mutex_unlock(&fs_table.lock);
}

static void config_defaults(struct fs_table_config* out) {
  memset(out, 0, sizeof(*out));
  out->num_levels = FS_DEFAULT_NUM_LEVELS;
  out->fallback_class = FS_CLASS_TP;
  out->num_class_map = FS_DEFAULT_TRAFFIC_CLASS_MAP_SIZE;
  for (uint32_t i = 0; i < FS_NUM_CLASSES; i++) {
    out->class_map[i] = (struct fs_class_map_entry){.traffic_class = (int32_t)i, .class_id = i};
    out->default_level[i] = fs_default_class_level[i];
  }
  out->gate_mode = FS_GATE_MODE_DEFAULT;
  out->gate_min_share = out->gate_window_ms = out->gate_max_defer_ms = FS_GATE_UNSET;
  for (uint32_t i = 0; i < FS_DEFAULT_NUM_LEVELS; i++) {
    out->level_marking[i].dscp = fs_default_level_dscp[i];
    out->level_marking[i].so_priority = fs_default_level_prio[i];
  }
}

/* Copy the config area under its seqlock; 0 on a consistent copy, taken at *seq_out. */
static int config_copy(const struct fs_table_header* hdr, struct fs_table_config* out,
                       uint32_t* seq_out) {
  for (int attempt = 0; attempt < 100; attempt++) {
    uint32_t seq = atomic_load_explicit(&hdr->config_seq, memory_order_acquire);
    if (seq & 1u) {
      continue;
    }
    out->num_levels = hdr->num_levels;
    out->fallback_class = hdr->fallback_class;
    out->num_class_map = hdr->num_class_map;
    memcpy(out->class_map, hdr->class_map, sizeof(out->class_map));
    memcpy(out->default_level, hdr->default_level, sizeof(out->default_level));
    out->gate_mode = hdr->gate_mode;
    out->gate_min_share = hdr->gate_min_share;
    out->gate_window_ms = hdr->gate_window_ms;
    out->gate_max_defer_ms = hdr->gate_max_defer_ms;
    memcpy(out->level_marking, hdr->level_marking, sizeof(out->level_marking));
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&hdr->config_seq, memory_order_relaxed) == seq) {
      *seq_out = seq;
      return 0;
    }
  }
  return -EAGAIN;
}

/* A consistent copy the plugin cannot use (num_levels out of range) means the defaults. */
static void config_sanitize(struct fs_table_config* cfg) {
  if (cfg->num_levels == 0 || cfg->num_levels > FS_TABLE_MAX_LEVELS) {
    config_defaults(cfg);
    return;
  }
  cfg->from_table = 1;
  if (cfg->num_class_map > FS_TABLE_MAX_CLASS_MAP) {
    cfg->num_class_map = FS_TABLE_MAX_CLASS_MAP;
  }
}

/* The cached config, refreshed first if config_seq moved; NULL when no table is mapped or no
 * consistent copy was ever read. Caller holds config_lock. */
static const struct fs_table_config* config_current_locked(void) {
  const struct fs_table_header* hdr = table_header();
  if (hdr == NULL) {
    return NULL;
  }
  uint32_t seq = atomic_load_explicit(&hdr->config_seq, memory_order_relaxed);
  if (fs_table.config_valid && seq == fs_table.config_seq && fs_table.config_hdr == hdr) {
    return &fs_table.config;
  }
  struct fs_table_config fresh;
  uint32_t read_at = 0;
  if (config_copy(hdr, &fresh, &read_at) == 0) {
    config_sanitize(&fresh);
    fs_table.config = fresh;
    fs_table.config_seq = read_at;
    fs_table.config_hdr = hdr;
    fs_table.config_valid = 1;
  }
  /* else: the agent is rewriting the area; keep using the previous copy */
  return fs_table.config_valid ? &fs_table.config : NULL;
}

void fs_table_config(struct fs_table_config* out) {
  pthread_mutex_lock(&fs_table.config_lock);
  const struct fs_table_config* cur = config_current_locked();
  if (cur != NULL) {
    *out = *cur;
  } else {
    config_defaults(out);
  }
  pthread_mutex_unlock(&fs_table.config_lock);
}

int fs_table_class_for_traffic_class(const struct fs_table_config* cfg, int32_t traffic_class) {
  if (traffic_class == -1) {
    return -1;
  }
  for (uint32_t i = 0; i < cfg->num_class_map; i++) {
    if (cfg->class_map[i].traffic_class == traffic_class &&
        cfg->class_map[i].class_id < FS_TABLE_MAX_CLASSES) {
      return (int)cfg->class_map[i].class_id;
    }
  }
  return -1;
}

/* An agent is alive when it set its pid and refreshed its heartbeat within the last second. */
static int agent_alive(void) {
  const struct fs_table_header* hdr = table_header();
  uint64_t beat = atomic_load_explicit(&hdr->heartbeat_ns, memory_order_relaxed);
  return hdr->agent_pid != 0 && beat != 0 && fs_now_ns() - beat < 1000000000ull;
}

/* CAS one slot from `from` to CLAIMED, scanning from a per-process cursor. The pid is written
 * after the CAS (slot_fill): until then the slot names its previous owner, which the agent's
 * reaper allows for. */
static struct fs_table_slot* slot_claim_from(uint32_t from) {
  uint32_t n = fs_table.num_slots;
  uint32_t start = (atomic_fetch_add(&fs_table.claim_cursor, 1) + (uint32_t)getpid() * 7919u) % n;
  for (uint32_t i = 0; i < n; i++) {
    struct fs_table_slot* slot = table_slot((start + i) % n);
    uint32_t expected = from;
    if (atomic_load_explicit(&slot->state, memory_order_relaxed) == from &&
        atomic_compare_exchange_strong(&slot->state, &expected, FS_SLOT_CLAIMED)) {
      return slot;
    }
  }
  return NULL;
}

/* The inode of this process's pid namespace, 0 when /proc cannot say. A job in a pid namespace
 * of its own (a container without hostPID) writes pids of that namespace; the agent maps
 * (namespace, pid) to the pid it sees through /proc (flowsched/shm/pidns.py). Read at every
 * claim, not cached: a forked child may have entered another namespace. */
static uint64_t own_pid_namespace(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* Reads a small /proc file whole into buf, NUL-terminated; its length, -1 when unreadable. */
static ssize_t read_small(const char* path, char* buf, size_t size) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  size_t len = 0;
  while (len < size - 1) {
    ssize_t n = read(fd, buf + len, size - 1 - len);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    len += (size_t)n;
  }
  close(fd);
  buf[len] = '\0';
  return (ssize_t)len;
}

/* The boottime offset of this process's time namespace, in clock ticks, into *ticks (0 on a
 * kernel without time namespaces). 0 on success, -1 when it is unreadable, not a whole
 * number of ticks, or not shown (/proc shows an unsharer its children's): the process's
 * starts then cannot be compared with the host's. */
static int boottime_offset_ticks(long long* ticks) {
  long long sec, nsec;
  *ticks = 0;
  if (!timens_offsets_own()) return -1; /* after unshare(CLONE_NEWTIME): another's offsets */
  if (timens_offset("boottime", "7", &sec, &nsec) != 0) return -1; /* 7: its clock id */
  long hz = sysconf(_SC_CLK_TCK);
  if (hz <= 0) hz = 100;
  long long part = nsec * hz; /* nsec < 1e9, hz <= 1e6: no overflow */
  if (part % 1000000000LL != 0) return -1;
  *ticks = sec * hz + part / 1000000000LL;
  return 0;
}

/* This process's start in clock ticks after boot as the host counts them, 0 when /proc cannot
 * say: field 22 of /proc/self/stat, less its time namespace's boottime offset (within such a
 * namespace, /proc shows every start shifted by it). With the pid, it lets an agent that may
 * not read this process's namespace link find it (flowsched/shm/pidns.py). Read at every
 * claim, as the namespace is: a forked child has a start of its own. */
static uint64_t own_start_ticks(void) {
  char buf[1024];
  if (read_small("/proc/self/stat", buf, sizeof(buf)) <= 0) return 0;
  const char* field = strrchr(buf, ')'); /* the command name, field 2, may hold anything */
  for (int n = 2; field != NULL && n < 22; n++) {
    field = strchr(field + 1, ' '); /* the space before field n + 1 */
  }
  if (field == NULL) return 0;
  char* end;
  unsigned long long ticks = strtoull(field + 1, &end, 10);
  long long offset;
  if (end == field + 1 || boottime_offset_ticks(&offset) != 0) return 0;
  return (long long)ticks > offset ? (uint64_t)((long long)ticks - offset) : 0;
}

static void slot_fill(struct fs_table_slot* slot, const struct fs_flow_info* info) {
  uint64_t now = fs_now_ns();
  slot->pid_ns = own_pid_namespace(); /* with the pid, before ACTIVE: the agent reads them */
  slot->start_ticks = own_start_ticks();
  slot->pid = (uint32_t)getpid();
  atomic_fetch_add(&slot->claim_seq, 1);
  slot->comm_id = info->comm_id;
  atomic_store_explicit(&slot->peer_rank, info->peer_rank, memory_order_relaxed);
  slot->traffic_class = info->traffic_class;
  atomic_store_explicit(&slot->level, FS_LEVEL_UNSET, memory_order_relaxed);
  slot->class_id = info->class_id;
  slot->direction = info->direction;
  slot->flags = 0;
  atomic_store_explicit(&slot->bytes, 0, memory_order_relaxed);
  atomic_store_explicit(&slot->messages, 0, memory_order_relaxed);
  slot->open_ns = now;
  atomic_store_explicit(&slot->last_ns, now, memory_order_relaxed);
  atomic_store_explicit(&slot->net_op, info->net_op, memory_order_relaxed);
  atomic_store_explicit(&slot->net_algo, info->net_algo, memory_order_relaxed);
  atomic_store_explicit(&slot->net_proto, info->net_proto, memory_order_relaxed);
  atomic_store_explicit(&slot->applied_level, FS_LEVEL_UNSET, memory_order_relaxed);
  atomic_store_explicit(&slot->applied_ns, 0, memory_order_relaxed);
  atomic_store_explicit(&slot->level_set_ns, 0, memory_order_relaxed);
  slot->dev = info->dev;
}

/* A slot of the mapped table for a connection, CLAIMED; NULL when the table is full. Caller
 * holds `lock` and has checked that a table is mapped. */
static struct fs_table_slot* slot_claim_locked(void) {
  struct fs_table_slot* slot = slot_claim_from(FS_SLOT_FREE);
  if (slot == NULL && !agent_alive()) {
    /* Only with no live agent: a live agent frees CLOSED slots itself after reporting them,
     * and taking one here could race its CLOSED -> FREE store. */
    slot = slot_claim_from(FS_SLOT_CLOSED);
  }
  if (slot == NULL) {
    FS_WARN_ONCE(fs_table.warned_full, "flow table full: new connections are not reported");
  }
  return slot;
}

void fs_flow_open(struct fs_flow* flow, const struct fs_flow_info* info) {
  memset(flow, 0, sizeof(*flow));
  fs_clock_refresh(); /* at every claim, as the pid namespace: a forked child's may differ */
  struct fs_table_slot* slot = NULL;
  pthread_mutex_lock(&fs_table.lock);
  if (fs_table.base != NULL) {
    slot = slot_claim_locked();
  }
  struct fs_table_header* hdr = table_header();
  flow->config_seq = hdr != NULL ? &hdr->config_seq : &fs_no_table_config_seq;
  flow->table_epoch = atomic_load(&fs_table_epoch);
  pthread_mutex_unlock(&fs_table.lock);
  flow->slot = slot != NULL ? slot : &flow->local;
  slot_fill(flow->slot, info);
  atomic_store_explicit(&flow->slot->state, FS_SLOT_ACTIVE, memory_order_release);
  flow->seen_level = FS_LEVEL_UNSET;
  flow->seen_config_seq = FS_CONFIG_SEQ_NONE;
  flow->class_id = info->class_id;
}

/* The class a moved connection takes in the table it moves to: the one that table's class map
 * gives its NCCL traffic class, else the one it had (from FLOWSCHED_CLASS or the defaults:
 * which of those applied when it was made is not kept). Caller holds `lock`. */
static uint16_t moved_class(const struct fs_table_slot* old) {
  struct fs_table_config cfg;
  fs_table_config(&cfg); /* `lock` before `config_lock`: the documented order */
  int cls = cfg.from_table ? fs_table_class_for_traffic_class(&cfg, old->traffic_class) : -1;
  return cls >= 0 ? (uint16_t)cls : old->class_id;
}

/* Move `flow` into the table published since it was bound: claim a slot there, fill it with
 * what the connection's slot says, counters and applied level included, and mark it MOVED;
 * the old slot (in a replaced table, or private) is CLOSED. Runs on the thread that drives
 * the connection (its completed messages), so nothing else reads flow->slot meanwhile. A
 * connection already in the current table (one that found it full at its opening), or that
 * finds it full now, stays where it is. The level is re-applied at the next level check:
 * seen_config_seq is reset, and the new slot's level is the agent's to write. */
void fs_flow_rebind(struct fs_flow* flow) {
  pthread_mutex_lock(&fs_table.lock);
  flow->table_epoch = atomic_load(&fs_table_epoch);
  struct fs_table_header* hdr = table_header();
  struct fs_table_slot* slot = NULL;
  if (hdr != NULL && flow->config_seq != &hdr->config_seq) {
    slot = slot_claim_locked();
  }
  if (slot == NULL) {
    pthread_mutex_unlock(&fs_table.lock);
    return;
  }
  struct fs_table_slot* old = flow->slot;
  struct fs_flow_info info = {
      .comm_id = old->comm_id,
      .peer_rank = atomic_load_explicit(&old->peer_rank, memory_order_relaxed),
      .traffic_class = old->traffic_class,
      .class_id = moved_class(old),
      .direction = old->direction,
      .dev = old->dev,
      .net_op = atomic_load_explicit(&old->net_op, memory_order_relaxed),
      .net_algo = atomic_load_explicit(&old->net_algo, memory_order_relaxed),
      .net_proto = atomic_load_explicit(&old->net_proto, memory_order_relaxed),
  };
  flow->config_seq = &hdr->config_seq;
  pthread_mutex_unlock(&fs_table.lock);
  slot_fill(slot, &info);
  slot->flags = FS_SLOT_FLAG_MOVED;
  slot->open_ns = old->open_ns;
#define FS_CARRY(field) \
  atomic_store_explicit(&slot->field, atomic_load_explicit(&old->field, memory_order_relaxed), \
                        memory_order_relaxed)
  FS_CARRY(bytes);
  FS_CARRY(messages);
  FS_CARRY(last_ns);
  FS_CARRY(applied_level); /* still what the sockets carry */
  FS_CARRY(applied_ns);
#undef FS_CARRY
  atomic_store_explicit(&slot->state, FS_SLOT_ACTIVE, memory_order_release);
  if (old != &flow->local) {
    atomic_store_explicit(&old->state, FS_SLOT_CLOSED, memory_order_release);
  }
  flow->slot = slot;
  flow->class_id = info.class_id;
  flow->seen_config_seq = FS_CONFIG_SEQ_NONE;
}

/* Look for a table that appeared, or replaced the mapped one, since the last look: at most
 * once per FS_TABLE_RECHECK_NS per process (one thread wins the deadline), never waiting for
 * `lock` (a connection setup holding it looks itself). Runs on an NCCL progress thread: a
 * stat() per second, and open and mmap once when a table is found. */
void fs_table_recheck(uint64_t now_ns) {
  uint64_t due = atomic_load(&fs_table_recheck_ns);
  if (now_ns < due ||
      !atomic_compare_exchange_strong(&fs_table_recheck_ns, &due, now_ns + FS_TABLE_RECHECK_NS)) {
    return;
  }
  if (pthread_mutex_trylock(&fs_table.lock) != 0) {
    return;
  }
  table_refresh_path(NULL);
  if (fs_table.base == NULL) {
    table_map(fs_table.path);
  } else if (table_replaced(fs_table.path)) {
    table_follow(fs_table.path);
  }
  pthread_mutex_unlock(&fs_table.lock);
}

void fs_flow_close(struct fs_flow* flow) {
  if (flow->slot != NULL) {
    atomic_store_explicit(&flow->slot->state, FS_SLOT_CLOSED, memory_order_release);
  }
}

static uint32_t level_resolve(const struct fs_table_config* cfg, uint16_t class_id, uint32_t raw,
                              struct fs_level_marking* marking) {
  uint32_t level = raw;
  if (level == FS_LEVEL_UNSET) {
    level = class_id < FS_TABLE_MAX_CLASSES ? cfg->default_level[class_id] : 0;
  }
  if (level >= cfg->num_levels) {
    level = cfg->num_levels - 1;
  }
  *marking = cfg->level_marking[level];
  return level;
}

/* Resolved in place on the cached config (no copy of the area per level change). */
uint32_t fs_flow_effective_level(const struct fs_flow* flow, uint32_t raw,
                                 struct fs_level_marking* marking, uint32_t* config_seq) {
  struct fs_table_config defaults;
  pthread_mutex_lock(&fs_table.config_lock);
  const struct fs_table_config* cfg = config_current_locked();
  const struct fs_table_header* hdr = table_header();
  if (flow->config_seq == &fs_no_table_config_seq) {
    *config_seq = 0; /* the constant it watches: nothing to re-apply */
  } else if (hdr == NULL || flow->config_seq != &hdr->config_seq) {
    /* a replaced table that had no room for it in the new one: the seq it watches moves no
     * more, so taking it as seen stops a recompute at every message */
    *config_seq = atomic_load_explicit(flow->config_seq, memory_order_relaxed);
  } else {
    *config_seq = cfg != NULL ? fs_table.config_seq : FS_CONFIG_SEQ_NONE;
  }
  if (cfg == NULL) {
    config_defaults(&defaults);
    cfg = &defaults;
  }
  uint32_t level = level_resolve(cfg, flow->class_id, raw, marking);
  pthread_mutex_unlock(&fs_table.config_lock);
  return level;
}

void fs_flow_applied(struct fs_flow* flow, uint32_t level) {
  atomic_store_explicit(&flow->slot->applied_level, level, memory_order_relaxed);
  atomic_store_explicit(&flow->slot->applied_ns, fs_now_ns(), memory_order_relaxed);
}
