/* SPDX-License-Identifier: Apache-2.0
 * Micro-benchmark of the per-isend priority check: relaxed atomic loads of the slot's level
 * and of the header's config_seq from a mapped shared-memory table plus the compares, and the
 * same with the per-message accounting (two atomic adds and a store). Prints nanoseconds per
 * operation as JSON. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "flow_table.h"

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

int main(int argc, char** argv) {
  long iters = argc > 1 ? atol(argv[1]) : 50000000L;
  char path[] = "/dev/shm/flowsched-bench-XXXXXX";
  int fd = mkstemp(path);
  size_t size = FS_TABLE_HEADER_SIZE + 16 * FS_TABLE_SLOT_SIZE;
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    perror("table");
    return 1;
  }
  uint8_t* base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  unlink(path);
  struct fs_flow flow;
  memset(&flow, 0, sizeof(flow));
  flow.slot = (struct fs_table_slot*)(base + FS_TABLE_HEADER_SIZE + 3 * FS_TABLE_SLOT_SIZE);
  flow.config_seq = &((struct fs_table_header*)base)->config_seq; /* 0, as the flow last saw */
  atomic_store(&flow.slot->level, 2);
  flow.seen_level = 2;
  flow.seen_config_seq = 0;
  uint32_t raw = 0;
  long changed = 0;
  double t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    changed += fs_flow_level_changed(&flow, &raw);
  }
  double t1 = now_ns();
  for (long i = 0; i < iters; i++) {
    changed += fs_flow_level_changed(&flow, &raw);
    fs_flow_account(&flow, 4096, (uint64_t)i);
  }
  double t2 = now_ns();
  double empty0 = now_ns();
  volatile long sink = 0;
  for (long i = 0; i < iters; i++) {
    sink += i;
  }
  double empty1 = now_ns();
  printf("{\"iterations\": %ld, \"level_check_ns\": %.3f, \"level_check_and_account_ns\": %.3f, "
         "\"empty_loop_ns\": %.3f, \"changed\": %ld}\n",
         iters, (t1 - t0) / (double)iters, (t2 - t1) / (double)iters,
         (empty1 - empty0) / (double)iters, changed);
  munmap(base, size);
  return 0;
}
