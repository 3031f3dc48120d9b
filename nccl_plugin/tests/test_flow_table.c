/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the flow table's look for a table that appeared or was re-created
 * (fs_table_recheck) and of what the cached config is read from, driven directly, in one
 * thread, with a hand-made table:
 *  - a default path re-decided at each look (fs_table_resolve_path_with): a non-root job that
 *    started before a root agent first resolves its own per-user path, then the agent's;
 *  - a config read between a re-created table's invalidation and its publication (another
 *    progress thread's level change; here the logger, called in that window) must not keep
 *    the old table's config when both tables show the same config_seq;
 *  - a connection the new table had no room for keeps watching its old table's config_seq,
 *    and does not recompute its level at every message;
 *  - a process in a time namespace (faked offsets file) writes the host's CLOCK_MONOTONIC
 *    into open_ns and judges the agent's heartbeat on it: a live agent's CLOSED slots are
 *    not taken from a full table; a child forked into a new time namespace reads its own
 *    offset, not its parent's cached one; a process that unshares a time namespace keeps its
 *    own offset, though /proc shows it the new namespace's (a real namespace, where allowed).
 *
 *   test_flow_table   exit status 0 when every check holds
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "flow_table.h"
#include "log.h"

static int failures;

#define EXPECT(cond, ...)               \
  do {                                  \
    if (!(cond)) {                      \
      fprintf(stderr, "FAIL: ");        \
      fprintf(stderr, __VA_ARGS__);     \
      fprintf(stderr, "\n");            \
      failures++;                       \
    }                                   \
  } while (0)

/* A table as an agent that wrote its config `writes` times leaves it (config_seq 2 x writes),
 * renamed into place at `path`; trafficClass 9 maps to `class_for_tc9`. */
static struct fs_table_header* table_create(const char* path, uint32_t nslots,
                                            uint32_t class_for_tc9, uint32_t writes) {
  char staged[512];
  snprintf(staged, sizeof(staged), "%s.staged", path);
  size_t size = FS_TABLE_HEADER_SIZE + (size_t)nslots * FS_TABLE_SLOT_SIZE;
  int fd = open(staged, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    perror(staged);
    exit(2);
  }
  struct fs_table_header* hdr = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (hdr == MAP_FAILED) {
    perror("mmap");
    exit(2);
  }
  hdr->magic = FS_TABLE_MAGIC;
  hdr->version = FS_TABLE_VERSION;
  hdr->header_size = FS_TABLE_HEADER_SIZE;
  hdr->slot_size = FS_TABLE_SLOT_SIZE;
  hdr->num_slots = nslots;
  hdr->num_levels = 8;
  hdr->num_class_map = 1;
  hdr->class_map[0] = (struct fs_class_map_entry){.traffic_class = 9, .class_id = class_for_tc9};
  for (uint32_t i = 0; i < FS_TABLE_MAX_CLASSES; i++) {
    hdr->default_level[i] = (uint8_t)(i % 8);
  }
  atomic_store(&hdr->config_seq, 2 * writes);
  if (rename(staged, path) != 0) {
    perror(path);
    exit(2);
  }
  return hdr;
}

static struct fs_table_slot* table_slot_at(struct fs_table_header* hdr, uint32_t i) {
  return (struct fs_table_slot*)((uint8_t*)hdr + FS_TABLE_HEADER_SIZE +
                                 (size_t)i * FS_TABLE_SLOT_SIZE);
}

static int active_slots(struct fs_table_header* hdr) {
  int n = 0;
  for (uint32_t i = 0; i < hdr->num_slots; i++) {
    n += atomic_load(&table_slot_at(hdr, i)->state) == FS_SLOT_ACTIVE;
  }
  return n;
}

/* A completed message, as the progress thread accounts it, a look's interval later than the
 * previous one: the once-a-second look is due at every call. */
static void message_later(struct fs_flow* flow) {
  static uint64_t now;
  if (now == 0) now = fs_now_ns();
  now += 2 * FS_TABLE_RECHECK_NS;
  fs_flow_account(flow, 100, now);
}

static const struct fs_flow_info k_info = {
    .comm_id = 7, .peer_rank = 1, .traffic_class = 9, .class_id = 0, .direction = FS_DIR_SEND};

/* ---- a default path re-decided at each look ---------------------------------------------- */

static char g_resolved[512];

static void resolve_default(char* out, size_t cap) { snprintf(out, cap, "%s", g_resolved); }

static void test_default_path_re_decided(const char* dir) {
  char own[512], shared[512];
  snprintf(own, sizeof(own), "%s/own-table", dir);
  snprintf(shared, sizeof(shared), "%s/shared-table", dir);
  snprintf(g_resolved, sizeof(g_resolved), "%s", own); /* nothing exists yet: the job's own */
  fs_table_resolve_path_with(resolve_default);
  EXPECT(fs_table_attach(own) != 0, "a table was mapped before any existed");
  struct fs_flow flow;
  fs_flow_open(&flow, &k_info);
  message_later(&flow);
  EXPECT(flow.slot == &flow.local, "the connection left its private slot with no table");
  struct fs_table_header* hdr = table_create(shared, 4, 3, 1);
  snprintf(g_resolved, sizeof(g_resolved), "%s", shared); /* the root agent's now exists */
  message_later(&flow);
  EXPECT(active_slots(hdr) == 1 && flow.slot != &flow.local,
         "the connection did not move into the table its resolved path names");
  EXPECT(flow.slot->flags == FS_SLOT_FLAG_MOVED && atomic_load(&flow.slot->bytes) == 200,
         "moved slot: flags %u, %llu bytes (want MOVED, 200)", flow.slot->flags,
         (unsigned long long)atomic_load(&flow.slot->bytes));
  EXPECT(flow.slot->class_id == 3, "moved slot class %u, the table maps tc 9 to 3",
         flow.slot->class_id);
  fs_flow_close(&flow);
  fs_table_detach();
  fs_table_resolve_path_with(NULL);
  munmap(hdr, FS_TABLE_HEADER_SIZE + 4 * FS_TABLE_SLOT_SIZE);
  unlink(shared);
}

/* ---- a config read in the window of a re-creation ---------------------------------------- */

static int g_window_reads;

static void read_config_in_the_window(ncclDebugLogLevel level, unsigned long flags,
                                      const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line;
  va_list ap;
  va_start(ap, fmt);
  char text[512];
  vsnprintf(text, sizeof(text), fmt, ap);
  va_end(ap);
  if (strstr(text, "was re-created") != NULL) { /* logged between invalidation and publish */
    struct fs_table_config cfg;
    fs_table_config(&cfg);
    g_window_reads++;
  }
}

static void test_config_of_a_re_created_table(const char* dir) {
  char path[512];
  snprintf(path, sizeof(path), "%s/table", dir);
  struct fs_table_header* old = table_create(path, 4, 2, 1);
  fs_log_set_logger(read_config_in_the_window);
  EXPECT(fs_table_attach(path) == 0, "the first table was not mapped");
  struct fs_table_config cfg;
  fs_table_config(&cfg);
  EXPECT(fs_table_class_for_traffic_class(&cfg, 9) == 2, "old table: tc 9 not class 2");
  struct fs_table_header* new = table_create(path, 4, 5, 1); /* config_seq 2 as well */
  fs_table_attach(path);                                  /* follows it */
  fs_table_config(&cfg);
  EXPECT(g_window_reads == 1, "the config was read %d times in the window", g_window_reads);
  EXPECT(fs_table_class_for_traffic_class(&cfg, 9) == 5,
         "after the re-creation tc 9 resolves to class %d, the new table says 5",
         fs_table_class_for_traffic_class(&cfg, 9));
  fs_log_set_logger(NULL);
  fs_table_detach();
  munmap(old, FS_TABLE_HEADER_SIZE + 4 * FS_TABLE_SLOT_SIZE);
  munmap(new, FS_TABLE_HEADER_SIZE + 4 * FS_TABLE_SLOT_SIZE);
  unlink(path);
}

/* ---- a connection left in a replaced table -------------------------------------------------- */

static void test_connection_left_in_a_replaced_table(const char* dir) {
  char path[512];
  snprintf(path, sizeof(path), "%s/table", dir);
  struct fs_table_header* old = table_create(path, 4, 2, 1);
  fs_table_attach(path);
  struct fs_flow flow, other;
  fs_flow_open(&flow, &k_info);
  struct fs_table_header* full = table_create(path, 1, 2, 2); /* another config_seq */
  fs_table_attach(path);
  fs_flow_open(&other, &k_info); /* takes the new table's only slot */
  message_later(&flow);          /* no room: stays in the old table */
  EXPECT(active_slots(old) == 1 && active_slots(full) == 1, "slots: %d old, %d new",
         active_slots(old), active_slots(full));
  int recomputes = 0;
  for (int i = 0; i < 100; i++) {
    uint32_t raw;
    if (fs_flow_level_changed(&flow, &raw)) {
      struct fs_level_marking marking;
      uint32_t seq;
      fs_flow_effective_level(&flow, raw, &marking, &seq);
      flow.seen_level = raw;
      flow.seen_config_seq = seq;
      recomputes++;
    }
  }
  EXPECT(recomputes == 1, "%d level recomputes in 100 messages (want 1)", recomputes);
  fs_flow_close(&flow);
  fs_flow_close(&other);
  fs_table_detach();
  munmap(old, FS_TABLE_HEADER_SIZE + 4 * FS_TABLE_SLOT_SIZE);
  munmap(full, FS_TABLE_HEADER_SIZE + FS_TABLE_SLOT_SIZE);
  unlink(path);
}

/* ---- a process in a time namespace ---------------------------------------------------------- */

static uint64_t own_monotonic_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Write a faked offsets file: the namespace's monotonic (and boottime) offset `offset_s`. */
static void write_offsets(const char* offsets, long long offset_s) {
  FILE* f = fopen(offsets, "w");
  if (f == NULL) {
    perror(offsets);
    exit(2);
  }
  fprintf(f, "monotonic %20lld %9d\nboottime %20lld %9d\n", offset_s, 0, offset_s, 0);
  fclose(f);
}

static void test_time_namespace(const char* dir, long long offset_s) {
  char path[512], offsets[512];
  snprintf(path, sizeof(path), "%s/table", dir);
  snprintf(offsets, sizeof(offsets), "%s/timens_offsets", dir);
  write_offsets(offsets, offset_s);
  fs_timens_offsets_path = offsets;
  /* what the host's clock reads: this process's, less the namespace's offset */
  uint64_t offset_ns = (uint64_t)(offset_s * 1000000000LL);
  struct fs_table_header* hdr = table_create(path, 1, 2, 1);
  hdr->agent_pid = (uint32_t)getpid();
  atomic_store(&hdr->heartbeat_ns, own_monotonic_ns() - offset_ns); /* a live agent's */
  fs_table_attach(path);
  struct fs_flow first, second;
  fs_flow_open(&first, &k_info);
  uint64_t host = own_monotonic_ns() - offset_ns;
  uint64_t opened = first.slot->open_ns;
  EXPECT(opened <= host && host - opened < 1000000000ull,
         "offset %llds: open_ns %llu, the host's clock %llu", offset_s,
         (unsigned long long)opened, (unsigned long long)host);
  fs_flow_close(&first); /* CLOSED, not reported yet: the live agent's to free */
  atomic_store(&hdr->heartbeat_ns, own_monotonic_ns() - offset_ns);
  fs_flow_open(&second, &k_info);
  EXPECT(second.slot == &second.local && atomic_load(&first.slot->state) == FS_SLOT_CLOSED,
         "offset %llds: a live agent's CLOSED slot was taken from a full table", offset_s);
  fs_flow_close(&second);
  fs_table_detach();
  fs_timens_offsets_path = "/proc/self/timens_offsets";
  fs_clock_refresh();
  munmap(hdr, FS_TABLE_HEADER_SIZE + FS_TABLE_SLOT_SIZE);
  unlink(path);
  unlink(offsets);
}

/* After unshare(CLONE_NEWTIME) only the caller's children are in the new namespace: a child
 * forked then has the new namespace's offset on its clock, and the offset its parent read
 * (and cached) for the old one. Faked: the offsets file changes between the parent's read and
 * the fork. The child's clock must be the host's from its first fs_now_ns on, before any
 * claim: a deadline taken then (a table look, a connect retry) would otherwise be off by the
 * difference once a claim re-read the offset. */
static void test_child_in_a_new_time_namespace(const char* dir) {
  static const struct {
    long long parent_s, child_s;
  } cases[] = {{0, 1000}, {-1000, 0}, {5, -7}};
  char offsets[512];
  snprintf(offsets, sizeof(offsets), "%s/timens_offsets", dir);
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    write_offsets(offsets, cases[i].parent_s);
    fs_timens_offsets_path = offsets;
    fs_clock_refresh();
    write_offsets(offsets, cases[i].child_s);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      uint64_t host = fs_now_ns();
      long long skew = (long long)(own_monotonic_ns() - host) - cases[i].child_s * 1000000000LL;
      if (skew < 0 || skew >= 1000000000LL) {
        fprintf(stderr,
                "FAIL: a child forked into a namespace %llds ahead (its parent's %llds): "
                "fs_now_ns %lld ms off the host's clock\n",
                cases[i].child_s, cases[i].parent_s, skew / 1000000);
        _exit(1);
      }
      _exit(0);
    }
    int status = 0;
    EXPECT(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
               WEXITSTATUS(status) == 0,
           "the child's clock (parent %llds, child %llds)", cases[i].parent_s, cases[i].child_s);
  }
  fs_timens_offsets_path = "/proc/self/timens_offsets";
  fs_clock_refresh();
  unlink(offsets);
}

/* A real time namespace: a process unshares one (CLONE_NEWTIME) with a monotonic offset of
 * 1000 s, and forks. Only the child is in it; /proc/self/timens_offsets shows the unsharer
 * the new namespace's offsets nonetheless (those of its time_for_children). Neither may take
 * another namespace's offset: the unsharer's clock (re-read at its next claim) and its
 * child's must stay the host's. Runs in a forked helper; skipped where namespaces cannot be
 * made. */
static void test_unshared_time_namespace(void) {
  fflush(NULL);
  pid_t helper = fork();
  if (helper == 0) {
    fs_clock_refresh();
    uint64_t before = fs_now_ns();
    if (unshare(CLONE_NEWTIME) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWTIME) != 0) {
      printf("skipped the unshared time namespace: %s\n", strerror(errno));
      _exit(0);
    }
    int fd = open("/proc/self/timens_offsets", O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "monotonic 1000 0\n", 17) != 17) {
      printf("skipped the unshared time namespace: offsets: %s\n", strerror(errno));
      _exit(0);
    }
    close(fd);
    fs_clock_refresh(); /* as the next claim does */
    long long unsharer = (long long)(fs_now_ns() - before);
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
      _exit(fs_now_ns() - before < 1000000000ull ? 0 : 1);
    }
    int status = 0;
    int child_ok = waitpid(child, &status, 0) == child && WIFEXITED(status) &&
                   WEXITSTATUS(status) == 0;
    if (unsharer < 0 || unsharer >= 1000000000LL || !child_ok) {
      fprintf(stderr,
              "FAIL: after unshare(CLONE_NEWTIME) with a 1000 s offset: the unsharer's clock "
              "moved %lld ms, its child's is %s\n",
              unsharer / 1000000, child_ok ? "the host's" : "not the host's");
      _exit(1);
    }
    _exit(0);
  }
  int status = 0;
  EXPECT(helper > 0 && waitpid(helper, &status, 0) == helper && WIFEXITED(status) &&
             WEXITSTATUS(status) == 0,
         "the clocks around an unshared time namespace");
}

int main(void) {
  char dir[] = "/tmp/fs-flow-table-XXXXXX";
  if (mkdtemp(dir) == NULL) {
    perror("mkdtemp");
    return 2;
  }
  test_default_path_re_decided(dir);
  test_config_of_a_re_created_table(dir);
  test_connection_left_in_a_replaced_table(dir);
  test_time_namespace(dir, 5);     /* more than the heartbeat's second ahead */
  test_time_namespace(dir, -1000); /* behind: an unsigned difference would wrap */
  test_child_in_a_new_time_namespace(dir);
  test_unshared_time_namespace();
  rmdir(dir);
  if (failures == 0) {
    printf("ok test_flow_table\n");
  }
  return failures == 0 ? 0 : 1;
}
