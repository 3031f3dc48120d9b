/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the permit's share decay against sends that add bytes at the same time
 * (permit.c, counter_halve). The progress threads of a process's connections add their sends'
 * bytes to the device's shares while the thread that won a window's end halves them: no added
 * byte may be lost. Each halving says what it took away, so the bytes must balance: what the
 * sends added = what the counter holds + what the halvings took.
 *
 *   test_permit_decay   exit status 0 when every counter balances
 */
#include "permit.c"

#include <pthread.h>
#include <stdio.h>

#define DEV 3
#define LEVEL 5
#define ADDERS 3
#define ADDS_PER_THREAD 200000

static _Atomic int adders_left = ADDERS;

/* One connection's progress thread: sends of varied sizes, each accepted at once. */
static void* adder(void* arg) {
  uint64_t* added = arg;
  for (uint64_t i = 0; i < ADDS_PER_THREAD; i++) {
    size_t bytes = (size_t)(1u << 20) + (size_t)(i % 4096);
    fs_gate_started(NULL, DEV, LEVEL, bytes);
    fs_gate_done(DEV, LEVEL);
    *added += bytes;
  }
  atomic_fetch_sub(&adders_left, 1);
  return NULL;
}

int main(void) {
  fs_gate_reset();
  struct gate_dev* d = &fs_gate.devs[DEV];
  pthread_t threads[ADDERS];
  uint64_t added[ADDERS] = {0};
  for (int i = 0; i < ADDERS; i++) {
    if (pthread_create(&threads[i], NULL, adder, &added[i]) != 0) {
      fprintf(stderr, "FAIL pthread_create\n");
      return 1;
    }
  }
  /* the window's ends, one after another while the sends go on */
  uint64_t taken_level = 0, taken_total = 0, halvings = 0;
  while (atomic_load(&adders_left) > 0) {
    taken_level += counter_halve(&d->bytes[LEVEL], 1);
    taken_total += counter_halve(&d->total, 1);
    halvings++;
  }
  uint64_t sum = 0;
  for (int i = 0; i < ADDERS; i++) {
    pthread_join(threads[i], NULL);
    sum += added[i];
  }
  const struct {
    const char* what;
    uint64_t held, taken;
  } counters[] = {
      {"the level's bytes", atomic_load(&d->bytes[LEVEL]), taken_level},
      {"the device's total", atomic_load(&d->total), taken_total},
  };
  int failures = 0;
  for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++) {
    if (counters[i].held + counters[i].taken != sum) {
      fprintf(stderr,
              "FAIL %s: sends added %llu bytes, the counter holds %llu and %llu halvings took "
              "%llu: %lld bytes lost\n",
              counters[i].what, (unsigned long long)sum, (unsigned long long)counters[i].held,
              (unsigned long long)halvings, (unsigned long long)counters[i].taken,
              (long long)(sum - counters[i].held - counters[i].taken));
      failures++;
    }
  }
  if (failures == 0) {
    printf("test_permit_decay: %llu bytes in %d threads balance over %llu halvings\n",
           (unsigned long long)sum, ADDERS, (unsigned long long)halvings);
  }
  return failures == 0 ? 0 : 1;
}
