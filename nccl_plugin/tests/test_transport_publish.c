/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the size hand-off between NCCL's progress thread and the helper threads
 * (request_publish_size / request_size_of): a data socket that had no chunk in a message may
 * reach it late, while the progress thread reuses its request slot for a message 64 later.
 * Whatever point of the publication the helper reads at, it must see the old message's size
 * or a mismatch, never the new message's size under the old sequence number (it would then
 * move a chunk that the peer does not expect on that socket: a corrupted stream).
 *
 * The publication is stepped store by store: the request is placed so that pub_seq and
 * pub_size lie on two pages, both made read-only; each store faults, the SIGSEGV handler reads
 * the slot as a helper would at that instant, then lets that store through and stops the next
 * one. Deterministic, no threads, no timing. The functions are static, so the file is
 * included; the rest of the plugin comes from the static internal library.
 *
 *   test_transport_publish   exit status 0 when no intermediate state is torn
 */
#include "transport_io.c"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static struct fs_request* g_req;
static uint8_t* g_page[2]; /* [0] holds pub_seq, [1] pub_size */
static size_t g_page_size;
static uint64_t g_old_seq, g_new_seq;
static size_t g_old_size, g_new_size;
static volatile sig_atomic_t g_stores; /* stores stepped through */
static volatile sig_atomic_t g_torn;   /* reads that returned a size of another message */

/* What a helper sees now for the message the slot held and for the one being published. */
static void read_as_helper(void) {
  size_t size = 0;
  if (request_size_of(g_req, g_old_seq, &size) && size != g_old_size) {
    g_torn++;
  }
  if (request_size_of(g_req, g_new_seq, &size) && size != g_new_size) {
    g_torn++;
  }
}

static void on_store(int sig, siginfo_t* info, void* uctx) {
  (void)uctx;
  uint8_t* at = info->si_addr;
  if (at < g_page[0] || at >= g_page[1] + g_page_size) {
    signal(sig, SIG_DFL); /* a real fault: crash on the retry */
    return;
  }
  int p = at >= g_page[1];
  g_stores++;
  read_as_helper(); /* the state every store before this one left */
  mprotect(g_page[p], g_page_size, PROT_READ | PROT_WRITE);
  mprotect(g_page[1 - p], g_page_size, PROT_READ);
}

static const struct {
  const char* what;
  uint64_t old_seq, new_seq; /* the slot held old_seq; new_seq is published into it */
  size_t old_size, new_size;
} k_cases[] = {
    {"slot reuse, larger message", 5, 5 + FS_MAX_REQUESTS, 0, 4u << 20},
    {"slot reuse, smaller message", 70, 70 + FS_MAX_REQUESTS, 3u << 20, 1},
    {"slot reuse, same size", 1000, 1000 + FS_MAX_REQUESTS, 65536, 65536},
};

int main(void) {
  g_page_size = (size_t)sysconf(_SC_PAGESIZE);
  uint8_t* base = mmap(NULL, 2 * g_page_size, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    perror("mmap");
    return 2;
  }
  g_page[0] = base;
  g_page[1] = base + g_page_size;
  /* pub_size starts the second page; pub_seq, just before it, ends the first */
  g_req = (struct fs_request*)(g_page[1] - offsetof(struct fs_request, pub_size));
  if ((uint8_t*)&g_req->pub_seq < g_page[0] || (uint8_t*)&g_req->pub_seq >= g_page[1]) {
    fprintf(stderr, "layout: pub_seq is not on the first page\n");
    return 2;
  }
  struct sigaction sa = {.sa_sigaction = on_store, .sa_flags = SA_SIGINFO};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, NULL);

  int failures = 0;
  for (size_t i = 0; i < sizeof(k_cases) / sizeof(k_cases[0]); i++) {
    g_old_seq = k_cases[i].old_seq;
    g_new_seq = k_cases[i].new_seq;
    g_old_size = k_cases[i].old_size;
    g_new_size = k_cases[i].new_size;
    request_publish_size(g_req, g_old_seq, g_old_size); /* what the slot held */
    g_stores = 0;
    g_torn = 0;
    mprotect(base, 2 * g_page_size, PROT_READ);
    request_publish_size(g_req, g_new_seq, g_new_size);
    mprotect(base, 2 * g_page_size, PROT_READ | PROT_WRITE);
    size_t size = 0;
    int old_gone = !request_size_of(g_req, g_old_seq, &size);
    int new_seen = request_size_of(g_req, g_new_seq, &size) && size == g_new_size;
    if (g_stores < 2 || g_torn != 0 || !old_gone || !new_seen) {
      fprintf(stderr,
              "FAIL %s: %d store(s) stepped, %d torn read(s), old message %s, new one %s\n",
              k_cases[i].what, (int)g_stores, (int)g_torn, old_gone ? "gone" : "still seen",
              new_seen ? "seen" : "not seen");
      failures++;
    }
  }
  if (failures == 0) {
    printf("test_transport_publish: %zu cases ok\n", sizeof(k_cases) / sizeof(k_cases[0]));
  }
  return failures == 0 ? 0 : 1;
}
