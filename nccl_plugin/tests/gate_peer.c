/* SPDX-License-Identifier: Apache-2.0
 * Two connections of different levels on one device, driven as NCCL drives them (one
 * progress thread per communicator, 8 requests in flight), for the permit's measurements:
 *
 *   gate_peer PLUGIN.so recv SECONDS
 *       two contexts (trafficClass 0 = tp, level 0 "high"; 5 = bulk, level 7 "low"), prints
 *       both listen handles (hex, one line each), accepts, receives until SECONDS or the
 *       peer closes, then prints {"high": {ms: bytes}, "low": {ms: bytes}} (CLOCK_MONOTONIC
 *       milliseconds, the same clock in every namespace)
 *   gate_peer PLUGIN.so send HIGH_HANDLE LOW_HANDLE SECONDS LOW_START_S [MSG_BYTES]
 *       the high flow for SECONDS, the low flow from LOW_START_S to SECONDS
 *   gate_peer PLUGIN.so deadlock TIMEOUT_S
 *       one process, loopback: a high send too large to complete until the receiver reads
 *       it, while the receiver first waits for a low message that the permit defers (the
 *       cross-node dependency of rdma-wrapping.md §5). Prints {"completed": bool,
 *       "seconds": s, "low_deferred_calls": n}; exit 0 if it completed, 3 if not.
 * The plugin is used through its v11 table; wrapping mode comes from FLOWSCHED_NET_INNER.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl/net_v11.h"

#define INFLIGHT 8
#define CHECK(cond, what)                                   \
  do {                                                      \
    if (!(cond)) {                                          \
      fprintf(stderr, "gate_peer: %s failed\n", (what));    \
      exit(1);                                              \
    }                                                       \
  } while (0)
#define OK(call) CHECK((call) == ncclSuccess, #call)

static const ncclNet_v11_t* net;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void* init_ctx(int tc) {
  ncclNetCommConfig_v11_t cfg = {.trafficClass = tc};
  void* ctx = NULL;
  OK(net->init(&ctx, 0x6A7E0000u + (uint64_t)tc, &cfg, NULL, NULL));
  int ndev = 0;
  OK(net->devices(&ndev));
  CHECK(ndev > 0, "devices");
  return ctx;
}

static void hex_print(const unsigned char* h) {
  for (int i = 0; i < NCCL_NET_HANDLE_MAXSIZE; i++) printf("%02x", h[i]);
  printf("\n");
}

static void hex_parse(const char* text, unsigned char* h) {
  CHECK(strlen(text) == 2 * NCCL_NET_HANDLE_MAXSIZE, "handle length");
  for (int i = 0; i < NCCL_NET_HANDLE_MAXSIZE; i++) sscanf(text + 2 * i, "%2hhx", &h[i]);
}

/* ---- streaming ------------------------------------------------------------------------------ */

struct flow {
  void* comm;
  int is_send;
  size_t msg;
  double start, end; /* absolute CLOCK_MONOTONIC seconds */
  long* bins;        /* receive: bytes per millisecond since t0 */
  long nbins;
  double t0;
  long calls_null; /* send: isend calls answered with a NULL request (deferred or busy) */
  int ended;       /* receive: the peer closed */
};

static void* post(struct flow* f, void* buf, void* mh) {
  void* req = NULL;
  if (f->is_send) {
    OK(net->isend(f->comm, buf, f->msg, 0, mh, NULL, &req));
    f->calls_null += req == NULL;
  } else {
    void* data[1] = {buf};
    size_t sizes[1] = {f->msg};
    int tags[1] = {0};
    void* mhs[1] = {mh};
    if (net->irecv(f->comm, 1, data, sizes, tags, mhs, NULL, &req) != ncclSuccess) {
      f->ended = 1; /* the sender finished and closed */
      return NULL;
    }
  }
  return req;
}

static void* flow_run(void* arg) {
  struct flow* f = arg;
  void* bufs[INFLIGHT];
  void* mhs[INFLIGHT];
  void* reqs[INFLIGHT] = {0};
  for (int i = 0; i < INFLIGHT; i++) {
    bufs[i] = calloc(1, f->msg);
    OK(net->regMr(f->comm, bufs[i], f->msg, NCCL_PTR_HOST, &mhs[i]));
  }
  while (now_s() < f->start) usleep(1000);
  long posted = 0, done = 0;
  while (now_s() < f->end && !f->ended) {
    int progressed = 0;
    if (posted - done < INFLIGHT) {
      int i = (int)(posted % INFLIGHT);
      reqs[i] = post(f, bufs[i], mhs[i]);
      if (reqs[i] != NULL) {
        posted++;
        progressed = 1;
      }
    }
    if (done < posted) {
      int fin = 0, size = 0;
      if (net->test(reqs[done % INFLIGHT], &fin, &size) != ncclSuccess) {
        CHECK(!f->is_send, "test of a send");
        break; /* the sender finished and closed: the receive side ends here */
      }
      if (fin) {
        if (!f->is_send) {
          long ms = (long)((now_s() - f->t0) * 1000);
          if (ms >= 0 && ms < f->nbins) f->bins[ms] += size;
        }
        done++;
        progressed = 1;
      }
    }
    if (!progressed) sched_yield(); /* like NCCL's progress thread */
  }
  for (int i = 0; i < INFLIGHT; i++) free(bufs[i]); /* mhandles die with the comm */
  return NULL;
}

static void print_bins(const char* name, const struct flow* f, int comma) {
  printf("\"%s\": {", name);
  int first = 1;
  for (long i = 0; i < f->nbins; i++) {
    if (f->bins[i] != 0) {
      printf("%s\"%ld\": %ld", first ? "" : ", ", (long)(f->t0 * 1000) + i, f->bins[i]);
      first = 0;
    }
  }
  printf("}%s", comma ? ", " : "");
}

static int do_recv(double seconds) {
  void* ctx[2] = {init_ctx(0), init_ctx(5)};
  void* lcomm[2];
  unsigned char handle[2][NCCL_NET_HANDLE_MAXSIZE];
  for (int c = 0; c < 2; c++) {
    OK(net->listen(ctx[c], 0, handle[c], &lcomm[c]));
    hex_print(handle[c]);
  }
  fflush(stdout);
  struct flow f[2];
  double t0 = now_s();
  for (int c = 0; c < 2; c++) {
    void* rcomm = NULL;
    while (rcomm == NULL) {
      OK(net->accept(lcomm[c], &rcomm, NULL));
      CHECK(now_s() - t0 < 30, "accept timed out");
    }
    OK(net->closeListen(lcomm[c]));
    long nbins = (long)(seconds * 1000) + 1000;
    f[c] = (struct flow){.comm = rcomm, .is_send = 0, .msg = 1 << 20, .start = 0,
                         .end = t0 + seconds, .bins = calloc((size_t)nbins, sizeof(long)),
                         .nbins = nbins, .t0 = t0};
  }
  pthread_t th[2];
  for (int c = 0; c < 2; c++) pthread_create(&th[c], NULL, flow_run, &f[c]);
  for (int c = 0; c < 2; c++) pthread_join(th[c], NULL);
  printf("{");
  print_bins("high", &f[0], 1);
  print_bins("low", &f[1], 0);
  printf("}\n");
  fflush(stdout);
  _exit(0); /* the sender may still be mid-message: no orderly close needed */
}

static int do_send(const char* hh, const char* lh, double seconds, double low_start, size_t msg) {
  void* ctx[2] = {init_ctx(0), init_ctx(5)};
  const char* handles[2] = {hh, lh};
  struct flow f[2];
  double t0 = now_s();
  for (int c = 0; c < 2; c++) {
    unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
    hex_parse(handles[c], handle);
    void* scomm = NULL;
    while (scomm == NULL) {
      OK(net->connect(ctx[c], 0, handle, &scomm, NULL));
      CHECK(now_s() - t0 < 30, "connect timed out");
    }
    f[c] = (struct flow){.comm = scomm, .is_send = 1, .msg = msg};
  }
  double start = now_s();
  f[0].start = start;
  f[0].end = start + seconds;
  f[1].start = start + low_start;
  f[1].end = start + seconds;
  pthread_t th[2];
  for (int c = 0; c < 2; c++) pthread_create(&th[c], NULL, flow_run, &f[c]);
  for (int c = 0; c < 2; c++) pthread_join(th[c], NULL);
  printf("{\"high_null_calls\": %ld, \"low_null_calls\": %ld}\n", f[0].calls_null, f[1].calls_null);
  fflush(stdout);
  _exit(0);
}

/* ---- the cross dependency ------------------------------------------------------------------ */

#define BIG (64u << 20)

struct dep {
  void* rcomm[2]; /* 0 high, 1 low */
  int ok;
};

/* The receiver reads the low message first, and only then posts the high receive. */
static void* dep_receiver(void* arg) {
  struct dep* d = arg;
  static char small[4096];
  char* big = malloc(BIG);
  struct flow lo = {.comm = d->rcomm[1], .msg = sizeof(small)};
  struct flow hi = {.comm = d->rcomm[0], .msg = BIG};
  void* req = NULL;
  while (req == NULL) req = post(&lo, small, NULL);
  int done = 0, size = 0;
  while (!done) OK(net->test(req, &done, &size));
  req = NULL;
  while (req == NULL) req = post(&hi, big, NULL);
  done = 0;
  while (!done) OK(net->test(req, &done, &size));
  free(big);
  d->ok = 1;
  return NULL;
}

static void* connect_pair(void* ctx, void** rcomm) {
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lcomm = NULL, *scomm = NULL;
  *rcomm = NULL;
  OK(net->listen(ctx, 0, handle, &lcomm));
  while (scomm == NULL || *rcomm == NULL) {
    if (scomm == NULL) OK(net->connect(ctx, 0, handle, &scomm, NULL));
    if (*rcomm == NULL) OK(net->accept(lcomm, rcomm, NULL));
  }
  OK(net->closeListen(lcomm));
  return scomm;
}

static int do_deadlock(double timeout) {
  void* ctx[2] = {init_ctx(0), init_ctx(5)};
  struct dep d = {0};
  void* scomm[2];
  for (int c = 0; c < 2; c++) scomm[c] = connect_pair(ctx[c], &d.rcomm[c]);
  pthread_t th;
  pthread_create(&th, NULL, dep_receiver, &d);
  char* big = calloc(1, BIG);
  static char small[4096];
  struct flow hi = {.comm = scomm[0], .is_send = 1, .msg = BIG};
  struct flow lo = {.comm = scomm[1], .is_send = 1, .msg = sizeof(small)};
  double t0 = now_s();
  void* hreq = NULL;
  while (hreq == NULL) hreq = post(&hi, big, NULL);
  void* lreq = NULL;
  int hdone = 0, ldone = 0, size = 0;
  while ((!hdone || !ldone) && now_s() - t0 < timeout) {
    if (lreq == NULL) lreq = post(&lo, small, NULL);
    if (!hdone) OK(net->test(hreq, &hdone, &size));
    if (lreq != NULL && !ldone) OK(net->test(lreq, &ldone, &size));
    sched_yield();
  }
  int completed = hdone && ldone;
  if (completed) pthread_join(th, NULL);
  printf("{\"completed\": %s, \"seconds\": %.3f, \"low_deferred_calls\": %ld}\n",
         completed && d.ok ? "true" : "false", now_s() - t0, lo.calls_null);
  fflush(stdout);
  _exit(completed ? 0 : 3);
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s PLUGIN.so recv SECONDS | send H L SECONDS LOW_START [MSG] | "
                    "deadlock TIMEOUT\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  CHECK(lib != NULL, "dlopen");
  net = dlsym(lib, "ncclNetPlugin_v11");
  CHECK(net != NULL, "ncclNetPlugin_v11");
  if (strcmp(argv[2], "recv") == 0) return do_recv(atof(argv[3]));
  if (strcmp(argv[2], "send") == 0 && argc >= 7) {
    return do_send(argv[3], argv[4], atof(argv[5]), atof(argv[6]),
                   argc > 7 ? (size_t)atol(argv[7]) : 65536);
  }
  if (strcmp(argv[2], "deadlock") == 0) return do_deadlock(atof(argv[3]));
  return 2;
}
