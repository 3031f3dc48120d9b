/* SPDX-License-Identifier: Apache-2.0
 * The wrapping mode against the recording fake inner plugin (fake_inner.c):
 *
 *   test_wrap_fake OUTER.so FAKE12.so FAKE10.so FAKE8.so
 *
 *  - forwarding: every call reaches the inner with every argument (comms and contexts
 *    unwrapped, handles, mhandles, device handles, phandles, the arrays of a grouped receive,
 *    the 0x1 receive hint, iflush, getDeviceMr, irecvConsumed, makeVDevice, setNetAttr,
 *    finalize), through the exported v12 table and through v10 and v8 (conversions);
 *  - properties pass through (ptrSupport CUDA|DMABUF, speed, latency, maxRecvs, ...), and
 *    the optional entries are present exactly when the inner has them;
 *  - the inner gets the traffic class of the connection's class (ToS of its level's DSCP);
 *  - inner tables v10 and v8 (trafficClass at connect; int sizes, hint cleared);
 *  - a failing inner init or connect is NCCL's error code, and a missing inner too;
 *  - concurrent first inits over a v10 inner: the second waits for the inner's init, and
 *    fails with it when it fails;
 *  - four first inits at once through the exported table: none of them reads what another's
 *    fill of the table writes (ThreadSanitizer, make tsan-check);
 *  - connects in progress (more than 64) keep their communicator's context alive past its
 *    finalize, until the last of them is over;
 *  - the permit: deferral while a more urgent send is in flight, lifted by a promotion (a
 *    level written into the flow table) and by completion, the age bound, the share guard;
 *    a connection closed with a send in flight gives its permit back;
 *  - every inner init (also the extra inner contexts made for another traffic class) gets
 *    the logger and profiler callback NCCL gave our init, and such an extra context the
 *    context's last setNetAttr hint before its first connect.
 * Exit status 0 when every check passed. */
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "fake_inner.h"
#include "flow_table.h"
#include "nccl/net_v10.h"
#include "nccl/net_v12.h"
#include "nccl/net_v8.h"

#define CHECK(cond, ...)                                                    \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);       \
      fprintf(stderr, __VA_ARGS__);                                         \
      fprintf(stderr, "\n");                                                \
      exit(1);                                                              \
    }                                                                       \
  } while (0)
#define OK(call) CHECK((call) == ncclSuccess, "%s", #call)

static const char* g_outer;
static struct fake_state* g_fake;
static void* g_fake_lib;
static void* g_outer_lib;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Load the fake (ours to steer) and a fresh copy of the outer library reading the env now. */
static void* load(const char* fake, const char* sym) {
  setenv("FLOWSCHED_NET_INNER", fake, 1);
  g_fake_lib = dlopen(fake, RTLD_NOW | RTLD_LOCAL);
  CHECK(g_fake_lib != NULL, "dlopen fake: %s", dlerror());
  g_fake = dlsym(g_fake_lib, "fake_state");
  CHECK(g_fake != NULL, "fake_state");
  g_fake->ncalls = 0;
  g_outer_lib = dlopen(g_outer, RTLD_NOW | RTLD_LOCAL);
  CHECK(g_outer_lib != NULL, "dlopen outer: %s", dlerror());
  void* table = dlsym(g_outer_lib, sym);
  CHECK(table != NULL, "%s", sym);
  return table;
}

static void unload(void) {
  CHECK(dlclose(g_outer_lib) == 0, "dlclose outer");
  CHECK(dlclose(g_fake_lib) == 0, "dlclose fake");
  unsetenv("FLOWSCHED_NET_INNER");
}

/* The last recorded call named `fn`. */
static struct fake_call* last(const char* fn) {
  for (int i = g_fake->ncalls - 1; i >= 0; i--) {
    if (strcmp(g_fake->calls[i].fn, fn) == 0) return &g_fake->calls[i];
  }
  CHECK(0, "no call to %s recorded", fn);
  return NULL;
}

static int count(const char* fn) {
  int n = 0;
  for (int i = 0; i < g_fake->ncalls; i++) n += strcmp(g_fake->calls[i].fn, fn) == 0;
  return n;
}

static void* connect12(const ncclNet_v12_t* net, void* ctx, char* handle, void** inner_comm) {
  void* scomm = NULL;
  ncclNetDeviceHandle_t* dh = NULL;
  int calls = 0;
  while (scomm == NULL) {
    OK(net->connect(ctx, 1, handle, &scomm, &dh));
    struct fake_call* c = last("connect");
    CHECK(c->handle == handle && c->dev == 1 && c->devcomm == &dh, "connect args");
    CHECK(++calls < 10, "connect never completed");
  }
  *inner_comm = last("connect")->comm;
  return scomm;
}

/* ---- the exported v12 table over a v12 inner: every call, every argument ---------------- */

static void check_props12(const ncclNetProperties_v12_t* p, int dev) {
  CHECK(strcmp(p->name, dev ? "fake1" : "fake0") == 0 && strcmp(p->pciPath, "/sys/devices/fake") == 0,
        "names");
  CHECK(p->guid == 0x1234500u + (uint64_t)dev && p->ptrSupport == 7 && p->regIsGlobal == 1 &&
            p->forceFlush == 1 && p->speed == 400000 && p->port == 3 && p->latency == 1.5f &&
            p->maxComms == 777 && p->maxRecvs == 8 && p->netDeviceType == NCCL_NET_DEVICE_HOST,
        "props of dev %d", dev);
  CHECK(p->vProps.ndevs == 1 && p->vProps.devs[0] == dev && p->maxP2pBytes == 1ULL << 33 &&
            p->maxCollBytes == 1ULL << 29 && p->maxMultiRequestSize == 4 && p->railId == 2 &&
            p->planeId == 1,
        "v9+ props of dev %d", dev);
}

static void forwarding_v12(const char* fake) {
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  CHECK(strcmp(net->name, "flowsched") == 0, "name");
  ncclNetCommConfig_v12_t cfg = {.trafficClass = 2}; /* param_sync: level 2, DSCP 34 */
  void* ctx = NULL;
  OK(net->init(&ctx, 0xC0FFEE, &cfg, NULL, NULL));
  struct fake_call* init = last("init");
  CHECK(init->comm_id == 0xC0FFEE && init->tc == 34 << 2, "inner init tc %d", init->tc);
  void* ictx = init->ctx;
  CHECK(net->regMrDmaBuf && net->getDeviceMr && net->irecvConsumed && net->makeVDevice &&
            net->setNetAttr,
        "optional entries of an inner that has them");
  int ndev = 0;
  OK(net->devices(&ndev));
  CHECK(ndev == 2, "ndev %d", ndev);
  for (int d = 0; d < ndev; d++) {
    ncclNetProperties_v12_t p;
    OK(net->getProperties(d, &p));
    check_props12(&p, d);
  }
  ncclNetAttr_v12_t attr;
  memset(&attr, 0xff, sizeof(attr));
  attr.op = 0x60;
  attr.algo = 2;
  attr.proto = 4;
  OK(net->setNetAttr(ctx, &attr));
  struct fake_call* a = last("setNetAttr");
  CHECK(a->ctx == ictx && a->op == 0x60 && a->algo == 2 && a->proto == 4, "setNetAttr");
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lcomm = NULL;
  OK(net->listen(ctx, 1, handle, &lcomm));
  CHECK(last("listen")->ctx == ictx && last("listen")->handle == handle && (unsigned char)handle[0] == 0x5a,
        "listen args");
  g_fake->connect_nulls = 2; /* the inner answers NULL twice: NCCL's retry with the same handle */
  void* iscomm = NULL;
  void* scomm = connect12(net, ctx, handle, &iscomm);
  CHECK(count("connect") == 3 && last("connect")->ctx == ictx, "connect retried on the inner ctx");
  void* rcomm = NULL;
  ncclNetDeviceHandle_t* dh = NULL;
  OK(net->accept(lcomm, &rcomm, &dh));
  CHECK(rcomm != NULL && last("accept")->comm == last("listen")->comm &&
            last("accept")->devcomm == &dh,
        "accept gets the inner listen comm and NCCL's device-handle pointer");
  OK(net->closeListen(lcomm));
  CHECK(last("closeListen")->comm == last("listen")->comm, "closeListen");

  /* registration: the comm is unwrapped, the mhandle is the inner's own */
  char buf[4096];
  void* mh = NULL;
  OK(net->regMr(scomm, buf, sizeof(buf), NCCL_PTR_CUDA, &mh));
  struct fake_call* r = last("regMr");
  CHECK(r->comm == iscomm && r->data == buf && r->size == sizeof(buf) && r->type == NCCL_PTR_CUDA &&
            mh == r->mhandle,
        "regMr");
  void* mh2 = NULL;
  OK(net->regMrDmaBuf(rcomm, buf, 100, NCCL_PTR_CUDA, 4096, 17, &mh2));
  r = last("regMrDmaBuf");
  CHECK(r->comm != iscomm && r->offset == 4096 && r->fd == 17 && r->size == 100 && mh2 == r->mhandle,
        "regMrDmaBuf");
  void* irecv_comm = r->comm;
  void* dptr = NULL;
  OK(net->getDeviceMr(rcomm, mh2, &dptr));
  CHECK(last("getDeviceMr")->comm == irecv_comm && last("getDeviceMr")->mhandle == mh2 &&
            dptr == (void*)0xD0D0,
        "getDeviceMr");

  /* isend: every argument, a boxed request, the size at test */
  int phandle_target;
  void* req = NULL;
  OK(net->isend(scomm, buf, 3000, 5, mh, &phandle_target, &req));
  r = last("isend");
  CHECK(req != NULL && req != r->request && r->comm == iscomm && r->data == buf && r->size == 3000 &&
            r->tag == 5 && r->mhandle == mh && r->phandle == &phandle_target,
        "isend args");
  int done = 0, size = -1;
  OK(net->test(req, &done, &size));
  CHECK(done && size == 3000 && last("test")->request == r->request, "test of the send");

  /* irecv n=3 with the 0x1 hint: arrays and hint reach the inner as they are */
  void* datas[3] = {buf, buf + 100, buf + 200};
  size_t sizes[3] = {100, 60, 40};
  int tags[3] = {1, 2, 3};
  void* mhs[3] = {mh2, mh2, mh2};
  int ph[3];
  void* phs[3] = {&ph[0], &ph[1], &ph[2]};
  req = (void*)NCCL_NET_OPTIONAL_RECV_COMPLETION;
  OK(net->irecv(rcomm, 3, datas, sizes, tags, mhs, phs, &req));
  r = last("irecv");
  CHECK(r->n == 3 && r->comm == irecv_comm && r->request_in == (void*)0x1 && req != NULL &&
            req != (void*)0x1 && req != r->request,
        "irecv");
  for (int i = 0; i < 3; i++) {
    CHECK(r->datas[i] == datas[i] && r->sizes[i] == sizes[i] && r->tags[i] == tags[i] &&
              r->mhandles[i] == mh2 && r->phandles[i] == phs[i],
          "irecv element %d", i);
  }
  void* inner_rreq = r->request;
  int rsizes[64] = {0};
  OK(net->test(req, &done, rsizes));
  CHECK(done && rsizes[0] == 50 && rsizes[1] == 30 && rsizes[2] == 20, "grouped sizes");
  OK(net->irecvConsumed(rcomm, 3, req)); /* NCCL passes the cached request after test */
  CHECK(last("irecvConsumed")->request == inner_rreq && last("irecvConsumed")->comm == irecv_comm &&
            last("irecvConsumed")->n == 3,
        "irecvConsumed gets the inner's request");

  /* iflush: a request to test, then NULL (nothing to wait for) passed on as NULL */
  int fsizes[2] = {10, 20};
  OK(net->iflush(rcomm, 2, datas, fsizes, mhs, &req));
  CHECK(req != NULL && last("iflush")->isizes[1] == 20 && last("iflush")->datas[1] == datas[1], "iflush");
  OK(net->test(req, &done, NULL));
  CHECK(done, "flush done");
  req = (void*)0x99;
  OK(net->iflush(rcomm, 2, datas, fsizes, mhs, &req));
  CHECK(req == NULL, "a NULL iflush request stays NULL");

  ncclNetVDeviceProps_v12_t vp = {.ndevs = 2, .devs = {0, 1}};
  int vdev = -1;
  OK(net->makeVDevice(&vdev, &vp));
  CHECK(vdev == 2 && last("makeVDevice")->vdevs == 2 && last("makeVDevice")->tags[1] == 1, "makeVDevice");
  OK(net->deregMr(scomm, mh));
  CHECK(last("deregMr")->comm == iscomm && last("deregMr")->mhandle == mh, "deregMr");
  OK(net->closeSend(scomm));
  CHECK(last("close")->comm == iscomm, "closeSend");
  OK(net->closeRecv(rcomm));
  CHECK(last("close")->comm == irecv_comm, "closeRecv");
  OK(net->finalize(ctx));
  CHECK(last("finalize")->ctx == ictx, "finalize reaches the inner ctx");

  /* failures: the inner's code, never a crash */
  g_fake->fail_init = ncclSystemError;
  void* bad = (void*)0x1;
  CHECK(net->init(&bad, 1, &cfg, NULL, NULL) == ncclSystemError && bad == NULL, "failing init");
  OK(net->finalize(bad));
  g_fake->fail_init = 0;
  OK(net->init(&ctx, 2, NULL, NULL, NULL));
  CHECK(last("init")->tc == 46 << 2, "no config: tp, level 0, DSCP 46");
  g_fake->fail_connect = ncclRemoteError;
  void* none = (void*)0x1;
  CHECK(net->connect(ctx, 0, handle, &none, NULL) == ncclRemoteError && none == NULL, "failing connect");
  g_fake->fail_connect = 0;
  OK(net->finalize(ctx));
  unload();
  printf("ok forwarding (exported v12, inner v12)\n");
}

/* ---- exported v8 over the v12 inner: int sizes, v8 properties, no optional extras ------- */

static void forwarding_v8_export(const char* fake) {
  const ncclNet_v8_t* net = load(fake, "ncclNetPlugin_v8");
  OK(net->init(NULL));
  CHECK(net->getDeviceMr != NULL && net->irecvConsumed != NULL, "v8 optional entries");
  ncclNetProperties_v8_t p;
  OK(net->getProperties(1, &p));
  CHECK(p.ptrSupport == 7 && p.regIsGlobal == 1 && p.speed == 400000 && p.maxRecvs == 8 &&
            p.latency == 1.5f && p.guid == 0x1234501u,
        "v8 props");
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lcomm = NULL, *scomm = NULL, *rcomm = NULL;
  OK(net->listen(0, handle, &lcomm));
  while (scomm == NULL) OK(net->connect(0, handle, &scomm, NULL));
  CHECK(last("init")->tc == 46 << 2, "v8 export: the inner still gets the class's TC");
  OK(net->accept(lcomm, &rcomm, NULL));
  char buf[64];
  void* req = NULL;
  OK(net->isend(scomm, buf, 33, 4, NULL, &req));
  CHECK(req != NULL && last("isend")->size == 33 && last("isend")->phandle == NULL, "v8 isend");
  int done = 0, size = 0;
  OK(net->test(req, &done, &size));
  void* datas[2] = {buf, buf + 32};
  int sizes[2] = {32, 30};
  int tags[2] = {0, 1};
  void* mhs[2] = {NULL, NULL};
  OK(net->irecv(rcomm, 2, datas, sizes, tags, mhs, &req));
  CHECK(last("irecv")->sizes[1] == 30 && last("irecv")->n == 2, "v8 irecv sizes widened");
  int got[2] = {0, 0};
  OK(net->test(req, &done, got));
  CHECK(done && got[0] == 16 && got[1] == 15, "v8 sizes");
  OK(net->irecvConsumed(rcomm, 2, req));
  OK(net->closeSend(scomm));
  OK(net->closeRecv(rcomm));
  OK(net->closeListen(lcomm));
  unload();
  printf("ok forwarding (exported v8, inner v12)\n");
}

/* ---- older inners: v10 takes the TC at connect; v8 has int sizes and no hint ------------- */

static void inner_v10(const char* fake) {
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  ncclNetCommConfig_v12_t cfg = {.trafficClass = 5}; /* bulk: level 7, DSCP 1 */
  void* ctx = NULL;
  OK(net->init(&ctx, 9, &cfg, NULL, NULL));
  CHECK(net->setNetAttr != NULL && net->makeVDevice != NULL, "v10 inner: makeVDevice kept");
  ncclNetProperties_v12_t p;
  OK(net->getProperties(0, &p));
  CHECK(p.speed == 400000 && p.maxP2pBytes == 1ULL << 33 && p.railId == -1 && p.planeId == -1 &&
            p.maxMultiRequestSize == 1,
        "v10 inner props: v12 defaults for the new fields");
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* iscomm = NULL;
  void* scomm = connect12(net, ctx, handle, &iscomm);
  CHECK(last("connect")->tc == 1 << 2, "v10 inner gets the class's TC at connect (%d)", last("connect")->tc);
  OK(net->closeSend(scomm));
  OK(net->finalize(ctx));
  unload();
  printf("ok inner v10 (trafficClass at connect)\n");
}

static void inner_v8(const char* fake) {
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  void* ctx = NULL;
  OK(net->init(&ctx, 9, NULL, NULL, NULL));
  CHECK(net->makeVDevice == NULL && net->irecvConsumed != NULL, "v8 inner: no makeVDevice");
  ncclNetProperties_v12_t p;
  OK(net->getProperties(1, &p));
  CHECK(p.maxP2pBytes == 1ULL << 30 && p.vProps.ndevs == 1 && p.vProps.devs[0] == 1 &&
            p.forceFlush == 0 && p.regIsGlobal == 1,
        "v8 inner props");
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* iscomm = NULL;
  void* scomm = connect12(net, ctx, handle, &iscomm);
  void *lcomm = NULL, *rcomm = NULL;
  OK(net->listen(ctx, 0, handle, &lcomm));
  OK(net->accept(lcomm, &rcomm, NULL));
  char buf[64];
  void* req = NULL;
  OK(net->isend(scomm, buf, 40, 1, NULL, NULL, &req));
  CHECK(last("isend")->size == 40, "v8 isend");
  int done = 0, size = 0;
  OK(net->test(req, &done, &size));
  CHECK(net->isend(scomm, buf, (2ULL << 30), 1, NULL, NULL, &req) == ncclInternalError && req == NULL,
        "a v8 inner cannot carry 2 GiB");
  void* datas[1] = {buf};
  size_t sizes[1] = {64};
  int tags[1] = {1};
  void* mhs[1] = {NULL};
  req = (void*)NCCL_NET_OPTIONAL_RECV_COMPLETION;
  OK(net->irecv(rcomm, 1, datas, sizes, tags, mhs, NULL, &req));
  CHECK(last("irecv")->request_in == NULL && last("irecv")->isizes[0] == 64, "v8: hint cleared");
  OK(net->test(req, &done, &size));
  OK(net->irecvConsumed(rcomm, 1, req));
  OK(net->closeSend(scomm));
  OK(net->closeRecv(rcomm));
  OK(net->closeListen(lcomm));
  OK(net->finalize(ctx));
  unload();
  printf("ok inner v8 (int sizes, hint cleared, v12 defaults)\n");
}

static void missing_inner(void) {
  setenv("FLOWSCHED_NET_INNER", "surely-not-a-plugin", 1);
  void* lib = dlopen(g_outer, RTLD_NOW | RTLD_LOCAL);
  CHECK(lib != NULL, "dlopen outer");
  const ncclNet_v12_t* net = dlsym(lib, "ncclNetPlugin_v12");
  void* ctx = (void*)0x1;
  CHECK(net->init(&ctx, 1, NULL, NULL, NULL) == ncclInvalidUsage && ctx == NULL, "missing inner");
  CHECK(net->devices == NULL, "a failed init leaves the table unfilled");
  dlclose(lib);
  setenv("FLOWSCHED_NET_INNER", g_outer, 1); /* itself: refused, no recursion */
  lib = dlopen(g_outer, RTLD_NOW | RTLD_LOCAL);
  net = dlsym(lib, "ncclNetPlugin_v12");
  CHECK(net->init(&ctx, 1, NULL, NULL, NULL) == ncclInvalidUsage, "wrapping itself");
  dlclose(lib);
  /* longer than a string knob holds: still wrapping mode, refused, never the TCP transport
   * in place of the inner plugin the user asked for */
  char long_name[400];
  memset(long_name, 'x', sizeof(long_name) - 1);
  long_name[sizeof(long_name) - 1] = '\0';
  setenv("FLOWSCHED_NET_INNER", long_name, 1);
  lib = dlopen(g_outer, RTLD_NOW | RTLD_LOCAL);
  net = dlsym(lib, "ncclNetPlugin_v12");
  ctx = (void*)0x1;
  ncclResult_t res = net->init(&ctx, 1, NULL, NULL, NULL);
  CHECK(res == ncclInvalidUsage && ctx == NULL,
        "a %zu-byte FLOWSCHED_NET_INNER: init returned %d (the TCP transport instead?)",
        strlen(long_name), (int)res);
  dlclose(lib);
  unsetenv("FLOWSCHED_NET_INNER");
  printf("ok missing, recursive or too long inner: ncclInvalidUsage\n");
}

/* ---- concurrent first inits over a legacy (v8-v10) inner ------------------------------------ */

/* One communicator's init on its own thread (NCCL 2.27+ initialises each communicator on the
 * thread that creates it). */
struct init_try {
  const ncclNet_v12_t* net;
  uint64_t comm_id;
  void* ctx;
  ncclResult_t res;
  _Atomic int tid;
  _Atomic int done;
  pthread_t thread;
};

static void* init_try_run(void* arg) {
  struct init_try* t = arg;
  atomic_store(&t->tid, (int)syscall(SYS_gettid));
  t->res = t->net->init(&t->ctx, t->comm_id, NULL, NULL, NULL);
  atomic_store(&t->done, 1);
  return NULL;
}

static void init_try_start(struct init_try* t, const ncclNet_v12_t* net, uint64_t comm_id) {
  *t = (struct init_try){.net = net, .comm_id = comm_id};
  CHECK(pthread_create(&t->thread, NULL, init_try_run, t) == 0, "pthread_create");
}

/* Whether thread `tid` of this process is blocked on a lock (state S in a futex wait; where
 * the kernel hides wchan, any interruptible sleep). */
static int thread_blocked(int tid) {
  char path[64], text[512] = "";
  snprintf(path, sizeof(path), "/proc/self/task/%d/stat", tid);
  FILE* f = fopen(path, "r");
  if (f == NULL) return 0;
  size_t n = fread(text, 1, sizeof(text) - 1, f);
  fclose(f);
  text[n] = '\0';
  const char* state = strrchr(text, ')');
  if (state == NULL || state[1] != ' ' || state[2] != 'S') return 0;
  char wchan[64] = "";
  snprintf(path, sizeof(path), "/proc/self/task/%d/wchan", tid);
  f = fopen(path, "r");
  if (f != NULL) {
    n = fread(wchan, 1, sizeof(wchan) - 1, f);
    wchan[n] = '\0';
    fclose(f);
  }
  return wchan[0] == '\0' || strcmp(wchan, "0") == 0 || strstr(wchan, "futex") != NULL;
}

static void wait_until(_Atomic int* flag, const char* what) {
  double deadline = now_s() + 30;
  while (!atomic_load(flag)) {
    CHECK(now_s() < deadline, "%s", what);
    nanosleep(&(struct timespec){.tv_nsec = 100000}, NULL);
  }
}

/* Two communicators initialise at once over a v10 inner, whose init runs once per process
 * (refcounted). While the first thread is inside the inner's init, the second must wait: it
 * may neither return success (the inner is not initialised yet, or never will be) nor run
 * the inner's init a second time. When the inner's init fails, both fail, and a later init
 * tries the inner's init again (the failure left nothing behind). */
static void concurrent_first_init(const char* fake10) {
  static const struct {
    const char* name;
    ncclResult_t inner_res;
  } cases[] = {{"the inner's init succeeds", ncclSuccess},
               {"the inner's init fails", ncclSystemError}};
  for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
    const ncclNet_v12_t* net = load(fake10, "ncclNetPlugin_v12");
    g_fake->fail_init = (int)cases[k].inner_res;
    atomic_store(&g_fake->block_init, 1);
    struct init_try first, second;
    init_try_start(&first, net, 0xA1);
    wait_until(&g_fake->init_blocked, "the first init never reached the inner");
    init_try_start(&second, net, 0xA2);
    double deadline = now_s() + 30;
    while (!atomic_load(&second.done) &&
           (atomic_load(&second.tid) == 0 || !thread_blocked(atomic_load(&second.tid)))) {
      CHECK(now_s() < deadline, "%s: the second init neither returned nor waited", cases[k].name);
      sched_yield();
    }
    CHECK(!atomic_load(&second.done),
          "%s: the second init returned %d while the inner's first init was still running",
          cases[k].name, (int)second.res);
    atomic_store(&g_fake->block_init, 0);
    CHECK(pthread_join(first.thread, NULL) == 0 && pthread_join(second.thread, NULL) == 0, "join");
    CHECK(first.res == cases[k].inner_res && second.res == cases[k].inner_res,
          "%s: the inits returned %d and %d, want %d", cases[k].name, (int)first.res,
          (int)second.res, (int)cases[k].inner_res);
    if (cases[k].inner_res == ncclSuccess) {
      CHECK(count("init") == 1, "%s: the inner's init ran %d times", cases[k].name, count("init"));
      OK(net->finalize(first.ctx));
      OK(net->finalize(second.ctx));
    } else {
      CHECK(first.ctx == NULL && second.ctx == NULL, "%s: a context after a failed init",
            cases[k].name);
      CHECK(count("init") == 2, "%s: the second init did not try the inner's init itself",
            cases[k].name);
      g_fake->fail_init = 0;
      void* ctx = NULL;
      OK(net->init(&ctx, 0xA3, NULL, NULL, NULL));
      CHECK(count("init") == 3, "%s: a later init did not run the inner's init again",
            cases[k].name);
      OK(net->finalize(ctx));
    }
    unload();
  }
  printf("ok concurrent first inits over a v10 inner wait for its init (success, failure)\n");
}

/* ---- four first inits at once: the exported table ------------------------------------------ */

#define CONCURRENT_INITS 4

struct table_init {
  const ncclNet_v12_t* net;
  pthread_barrier_t* start;
  uint64_t comm_id;
  ncclResult_t res;
};

/* What NCCL does on each communicator's thread: read the table's init, call it, then use the
 * table's entries. */
static void* table_init_run(void* arg) {
  struct table_init* t = arg;
  pthread_barrier_wait(t->start);
  void* ctx = NULL;
  t->res = t->net->init(&ctx, t->comm_id, NULL, NULL, NULL);
  int ndev = 0;
  if (t->res == ncclSuccess) t->res = t->net->devices(&ndev);
  if (t->res == ncclSuccess) t->res = t->net->finalize(ctx);
  return NULL;
}

/* Communicators initialise on their own threads (NCCL 2.27+), each reading the exported
 * table's name and init while another's first init may be filling the table in: the fill
 * must write nothing they read (ThreadSanitizer reports it under `make tsan-check`). */
static void concurrent_table_inits(const char* fake10) {
  for (int round = 0; round < 20; round++) {
    const ncclNet_v12_t* net = load(fake10, "ncclNetPlugin_v12");
    pthread_barrier_t start;
    CHECK(pthread_barrier_init(&start, NULL, CONCURRENT_INITS) == 0, "barrier");
    struct table_init inits[CONCURRENT_INITS];
    pthread_t threads[CONCURRENT_INITS];
    for (int i = 0; i < CONCURRENT_INITS; i++) {
      inits[i] = (struct table_init){.net = net, .start = &start, .comm_id = 0xB0 + (uint64_t)i};
      CHECK(pthread_create(&threads[i], NULL, table_init_run, &inits[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < CONCURRENT_INITS; i++) {
      CHECK(pthread_join(threads[i], NULL) == 0, "join");
      CHECK(inits[i].res == ncclSuccess, "round %d: init %d returned %d", round, i,
            (int)inits[i].res);
    }
    CHECK(strcmp(net->name, "flowsched") == 0 && net->init != NULL && net->devices != NULL,
          "round %d: the table after the inits", round);
    pthread_barrier_destroy(&start);
    unload();
  }
  printf("ok %d concurrent first inits through the exported table\n", CONCURRENT_INITS);
}

/* ---- connects in progress outlive a finalize ---------------------------------------------- */

#define MANY_CONNECTS 70 /* more than the 64 connects in progress the wrapper once tracked */

/* NCCL's abort path may finalize a communicator while connects are still in progress. Each of
 * them holds a context reference: the context (and the inner's) must survive until the last
 * one is over, however many there are. The first 64 complete and close (the context would be
 * freed here if the others held no reference), then the others retry (a use-after-free then,
 * which ASan reports) and complete; the inner context is finalized by the last close only. */
static void connects_in_progress_outlive_finalize(const char* fake) {
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  void* ctx = NULL;
  OK(net->init(&ctx, 0xF1, NULL, NULL, NULL));
  static char handles[MANY_CONNECTS][NCCL_NET_HANDLE_MAXSIZE];
  void* scomms[MANY_CONNECTS] = {0};
  g_fake->connect_nulls = 1 << 20; /* every connect stays in progress */
  for (int i = 0; i < MANY_CONNECTS; i++) {
    OK(net->connect(ctx, 0, handles[i], &scomms[i], NULL));
    CHECK(scomms[i] == NULL, "connect %d in progress", i);
  }
  OK(net->finalize(ctx));
  g_fake->connect_nulls = 0; /* the next retry of each completes */
  for (int i = 0; i < 64; i++) {
    OK(net->connect(ctx, 0, handles[i], &scomms[i], NULL));
    CHECK(scomms[i] != NULL, "connect %d completes", i);
    OK(net->closeSend(scomms[i]));
  }
  CHECK(count("finalize") == 0, "the inner context was finalized with %d connects in progress",
        MANY_CONNECTS - 64);
  g_fake->ncalls = 0; /* the fake records at most FAKE_MAX_CALLS */
  for (int i = 64; i < MANY_CONNECTS; i++) {
    OK(net->connect(ctx, 0, handles[i], &scomms[i], NULL));
    CHECK(scomms[i] != NULL, "connect %d completes after the finalize", i);
  }
  for (int i = 64; i < MANY_CONNECTS; i++) {
    CHECK(count("finalize") == 0, "finalized before the last close");
    OK(net->closeSend(scomms[i]));
  }
  CHECK(count("finalize") == 1, "the last close finalizes the inner context");
  unload();
  printf("ok %d connects in progress outlive a finalize\n", MANY_CONNECTS);
}

/* ---- the permit ---------------------------------------------------------------------------- */

/* A flow table as the agent writes it (no live agent), to promote a connection. */
static struct fs_table_header* table_create(const char* path, int nslots) {
  size_t size = FS_TABLE_HEADER_SIZE + (size_t)nslots * FS_TABLE_SLOT_SIZE;
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
  CHECK(fd >= 0 && ftruncate(fd, (off_t)size) == 0, "table file");
  struct fs_table_header* h = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  CHECK(h != MAP_FAILED, "mmap");
  static const uint8_t dscp[8] = {46, 40, 34, 26, 18, 10, 8, 1};
  static const uint8_t defaults[6] = {0, 3, 2, 1, 2, 7};
  h->magic = FS_TABLE_MAGIC;
  h->version = FS_TABLE_VERSION;
  h->header_size = FS_TABLE_HEADER_SIZE;
  h->slot_size = FS_TABLE_SLOT_SIZE;
  h->num_slots = (uint32_t)nslots;
  h->num_levels = 8;
  h->num_class_map = 6;
  for (uint32_t i = 0; i < 6; i++) {
    h->class_map[i] = (struct fs_class_map_entry){.traffic_class = (int32_t)i, .class_id = i};
    h->default_level[i] = defaults[i];
  }
  for (int i = 0; i < 8; i++) h->level_marking[i].dscp = dscp[i];
  atomic_store(&h->config_seq, 2);
  return h;
}

/* A 16-slot table in a new file `path` (a mkstemp template), named by FLOWSCHED_TABLE for the
 * plugins loaded next; table_drop undoes all three. */
static struct fs_table_header* table_install(char* path) {
  int fd = mkstemp(path);
  CHECK(fd >= 0, "mkstemp");
  close(fd);
  struct fs_table_header* h = table_create(path, 16);
  setenv("FLOWSCHED_TABLE", path, 1);
  return h;
}

static void table_drop(struct fs_table_header* h, const char* path) {
  unsetenv("FLOWSCHED_TABLE");
  munmap(h, FS_TABLE_HEADER_SIZE + 16 * FS_TABLE_SLOT_SIZE);
  unlink(path);
}

static struct fs_table_slot* slot_of(struct fs_table_header* h, int32_t tc) {
  for (uint32_t i = 0; i < h->num_slots; i++) {
    struct fs_table_slot* s =
        (struct fs_table_slot*)((char*)h + FS_TABLE_HEADER_SIZE + i * FS_TABLE_SLOT_SIZE);
    if (atomic_load(&s->state) == FS_SLOT_ACTIVE && s->traffic_class == tc && s->direction == FS_DIR_SEND) {
      return s;
    }
  }
  CHECK(0, "no send slot with trafficClass %d", tc);
  return NULL;
}

static void* send_comm(const ncclNet_v12_t* net, int tc, void** ctx) {
  ncclNetCommConfig_v12_t cfg = {.trafficClass = tc};
  OK(net->init(ctx, (uint64_t)tc + 100, &cfg, NULL, NULL));
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* inner = NULL;
  return connect12(net, *ctx, handle, &inner);
}

static int isend_count(void) { return count("isend"); }

static void permit(const char* fake) {
  char path[] = "/tmp/fs-wrap-table-XXXXXX";
  struct fs_table_header* h = table_install(path);
  setenv("FLOWSCHED_GATE_MIN_SHARE", "0", 1);
  setenv("FLOWSCHED_GATE_MAX_DEFER_US", "30000", 1);
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  void *hctx, *lctx;
  void* hs = send_comm(net, 0, &hctx); /* tp: level 0 */
  void* ls = send_comm(net, 5, &lctx); /* bulk: level 7 */
  char buf[256];
  g_fake->complete_sends = 0;
  void *hreq = NULL, *lreq = NULL;
  OK(net->isend(hs, buf, 100, 0, NULL, NULL, &hreq));
  CHECK(hreq != NULL, "the urgent send starts");
  int before = isend_count();
  OK(net->isend(ls, buf, 100, 0, NULL, NULL, &lreq));
  CHECK(lreq == NULL && isend_count() == before, "deferred without reaching the inner");
  /* promotion: the agent writes level 0 into the bulk connection's slot */
  struct fs_table_slot* lslot = slot_of(h, 5);
  atomic_store(&lslot->level, 0);
  OK(net->isend(ls, buf, 100, 0, NULL, NULL, &lreq));
  CHECK(lreq != NULL && atomic_load(&lslot->applied_level) == 0, "a promotion lifts the deferral");
  int done = 0, size = 0;
  g_fake->complete_sends = 1;
  OK(net->test(lreq, &done, &size));
  g_fake->complete_sends = 0;
  /* demoted again: the age bound lets it through after 30 ms */
  atomic_store(&lslot->level, 7);
  double t0 = now_s();
  lreq = NULL;
  int tries = 0;
  while (lreq == NULL) {
    OK(net->isend(ls, buf, 100, 0, NULL, NULL, &lreq));
    tries++;
    CHECK(now_s() - t0 < 5, "the age bound never fired");
  }
  double waited = now_s() - t0;
  CHECK(waited >= 0.029 && tries > 1, "age bound after %.3f s, %d tries", waited, tries);
  g_fake->complete_sends = 1;
  OK(net->test(lreq, &done, &size));
  /* completion of the urgent send lifts the deferral at once */
  lreq = NULL;
  OK(net->test(hreq, &done, &size));
  CHECK(done, "urgent send done");
  OK(net->isend(ls, buf, 100, 0, NULL, NULL, &lreq));
  CHECK(lreq != NULL, "nothing urgent in flight: no deferral");
  OK(net->test(lreq, &done, &size));
  OK(net->closeSend(hs));
  OK(net->closeSend(ls));
  OK(net->finalize(hctx));
  OK(net->finalize(lctx));
  unload();
  printf("ok permit: deferral, promotion, age bound (%.1f ms), completion\n", waited * 1e3);

  /* the share guard alone: a level below its share of the device's bytes may send */
  setenv("FLOWSCHED_GATE_MIN_SHARE", "500", 1);
  setenv("FLOWSCHED_GATE_MAX_DEFER_US", "0", 1);
  net = load(fake, "ncclNetPlugin_v12");
  hs = send_comm(net, 0, &hctx);
  ls = send_comm(net, 5, &lctx);
  g_fake->complete_sends = 0;
  OK(net->isend(hs, buf, 200, 0, NULL, NULL, &hreq));
  OK(net->isend(ls, buf, 200, 0, NULL, NULL, &lreq));
  CHECK(lreq != NULL, "no bytes yet for bulk: the share guard lets it through");
  void* lreq2 = NULL;
  for (int i = 0; i < 100; i++) {
    OK(net->isend(ls, buf, 200, 0, NULL, NULL, &lreq2));
    CHECK(lreq2 == NULL, "at its share (50%%) bulk is deferred (try %d)", i);
  }
  g_fake->complete_sends = 1;
  OK(net->test(hreq, &done, &size));
  OK(net->test(lreq, &done, &size));
  OK(net->closeSend(hs));
  OK(net->closeSend(ls));
  OK(net->finalize(hctx));
  OK(net->finalize(lctx));
  unload();
  unsetenv("FLOWSCHED_GATE_MIN_SHARE");
  unsetenv("FLOWSCHED_GATE_MAX_DEFER_US");
  printf("ok permit: share guard\n");

  /* the policy file's [gating] (in the table's config area): off, unless the env says on */
  h->gate_mode = FS_GATE_MODE_OFF;
  atomic_store(&h->config_seq, 4);
  for (int env_on = 0; env_on < 2; env_on++) {
    if (env_on) setenv("FLOWSCHED_GATING", "1", 1);
    net = load(fake, "ncclNetPlugin_v12");
    hs = send_comm(net, 0, &hctx);
    ls = send_comm(net, 5, &lctx);
    g_fake->complete_sends = 0;
    OK(net->isend(hs, buf, 200, 0, NULL, NULL, &hreq));
    OK(net->isend(ls, buf, 200, 0, NULL, NULL, &lreq));
    CHECK((lreq != NULL) == !env_on, "policy gating off, env %s", env_on ? "on" : "unset");
    g_fake->complete_sends = 1;
    OK(net->test(hreq, &done, &size));
    if (lreq != NULL) OK(net->test(lreq, &done, &size));
    OK(net->closeSend(hs));
    OK(net->closeSend(ls));
    OK(net->finalize(hctx));
    OK(net->finalize(lctx));
    unload();
  }
  unsetenv("FLOWSCHED_GATING");
  table_drop(h, path);
  printf("ok permit: the policy's gating off, the environment wins\n");
}

/* closeSend with a permitted send still in flight (ncclCommAbort and NCCL's error paths do
 * this) gives the permit back: a less urgent send on the same device then starts at once.
 * Neither guard is on, so a leaked in-flight count would defer it for good. */
static void permit_close_in_flight(const char* fake) {
  setenv("FLOWSCHED_GATE_MIN_SHARE", "0", 1);
  setenv("FLOWSCHED_GATE_MAX_DEFER_US", "0", 1);
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  void *hctx, *lctx;
  void* hs = send_comm(net, 0, &hctx); /* tp: level 0 */
  void* ls = send_comm(net, 5, &lctx); /* bulk: level 7 */
  char buf[256];
  g_fake->complete_sends = 0;
  void *hreq = NULL, *lreq = NULL;
  OK(net->isend(hs, buf, 100, 0, NULL, NULL, &hreq));
  CHECK(hreq != NULL, "the urgent send starts");
  void* inner_hreq = last("isend")->request;
  OK(net->isend(ls, buf, 100, 0, NULL, NULL, &lreq));
  CHECK(lreq == NULL, "deferred while the urgent send is in flight");
  OK(net->closeSend(hs)); /* never tested to completion */
  free(inner_hreq);       /* the fake's request (a real inner frees it at close) */
  OK(net->finalize(hctx));
  for (int i = 0; i < 100 && lreq == NULL; i++) {
    OK(net->isend(ls, buf, 100, 0, NULL, NULL, &lreq));
  }
  CHECK(lreq != NULL, "the closed connection's send still defers bulk on its device");
  g_fake->complete_sends = 1;
  int done = 0, size = 0;
  OK(net->test(lreq, &done, &size));
  CHECK(done, "bulk send done");
  OK(net->closeSend(ls));
  OK(net->finalize(lctx));
  unload();
  unsetenv("FLOWSCHED_GATE_MIN_SHARE");
  unsetenv("FLOWSCHED_GATE_MAX_DEFER_US");
  printf("ok permit: a close with a send in flight gives the permit back\n");
}

/* ---- the logger and profiler callback of every inner init ------------------------------ */

static int g_fake_logs;

/* NCCL's logger stands in: counts the fake's own "init" lines. */
static void test_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                        const char* fmt, ...) {
  (void)level;
  (void)flags;
  (void)file;
  (void)line;
  g_fake_logs += strncmp(fmt, "fake inner init", 15) == 0;
}

static ncclResult_t test_prof(void** handle, int type, void* phandle, int64_t id, void* data) {
  (void)handle;
  (void)type;
  (void)phandle;
  (void)id;
  (void)data;
  return ncclSuccess;
}

/* Every inner init recorded so far got our init's logger and profiler callback (and logged). */
static void check_inits_logged(int expected, const char* what) {
  CHECK(count("init") == expected, "%s: %d inner inits, want %d", what, count("init"), expected);
  for (int i = 0; i < g_fake->ncalls; i++) {
    const struct fake_call* c = &g_fake->calls[i];
    if (strcmp(c->fn, "init") == 0) {
      CHECK(c->logger == test_logger && c->prof == test_prof,
            "%s: inner init (tc %d) got logger %p, profiler %p", what, c->tc,
            (void*)(uintptr_t)c->logger, (void*)(uintptr_t)c->prof);
    }
  }
  CHECK(g_fake_logs == expected, "%s: the inner logged %d times, want %d", what, g_fake_logs,
        expected);
}

/* v10 export (one process-wide context): another class at a later listen, and another
 * trafficClass at a connect, each make a new inner context. */
static void logger_inner_inits_v10(const char* fake) {
  const ncclNet_v10_t* n10 = load(fake, "ncclNetPlugin_v10");
  g_fake_logs = 0;
  setenv("FLOWSCHED_CLASS", "tp", 1);
  OK(n10->init(test_logger, test_prof));
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *l1 = NULL, *l2 = NULL, *s = NULL;
  OK(n10->listen(0, handle, &l1));
  setenv("FLOWSCHED_CLASS", "bulk", 1); /* the next group's class */
  OK(n10->listen(0, handle, &l2));
  unsetenv("FLOWSCHED_CLASS");
  ncclNetCommConfig_v10_t c10 = {.trafficClass = 2}; /* param_sync */
  ncclNetDeviceHandle_t* dh = NULL;
  while (s == NULL) OK(n10->connect(0, &c10, handle, &s, &dh));
  check_inits_logged(3, "v10 export");
  OK(n10->closeSend(s));
  OK(n10->closeListen(l1));
  OK(n10->closeListen(l2));
  unload();
}

/* v12 export: the agent gives the class's level another DSCP between init and listen. */
static void logger_inner_inits_v12(const char* fake) {
  char path[] = "/tmp/fs-wrap-table-XXXXXX";
  struct fs_table_header* h = table_install(path);
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  g_fake_logs = 0;
  ncclNetCommConfig_v12_t cfg = {.trafficClass = 0}; /* tp: level 0 */
  void* ctx = NULL;
  OK(net->init(&ctx, 0xE, &cfg, test_logger, test_prof));
  atomic_store(&h->config_seq, 3); /* the agent's seqlock: odd while it writes */
  h->level_marking[0].dscp = 40;
  atomic_store(&h->config_seq, 4);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lcomm = NULL;
  OK(net->listen(ctx, 0, handle, &lcomm));
  CHECK(last("init")->tc == 40 << 2, "the new DSCP makes a new inner context (tc %d)",
        last("init")->tc);
  check_inits_logged(2, "v12 export");
  OK(net->closeListen(lcomm));
  OK(net->finalize(ctx));
  unload();
  table_drop(h, path);
  printf("ok logger: every inner init gets NCCL's logger and profiler callback\n");
}

/* ---- class per communicator, peer rank from what is known ------------------------------- */

static struct fs_table_slot* slot_by(struct fs_table_header* h, uint64_t comm_id, int direction) {
  for (uint32_t i = 0; i < h->num_slots; i++) {
    struct fs_table_slot* s =
        (struct fs_table_slot*)((char*)h + FS_TABLE_HEADER_SIZE + i * FS_TABLE_SLOT_SIZE);
    if (atomic_load(&s->state) == FS_SLOT_ACTIVE && s->comm_id == comm_id && s->direction == direction) {
      return s;
    }
  }
  CHECK(0, "no active slot of comm 0x%llx, direction %d", (unsigned long long)comm_id, direction);
  return NULL;
}

/* FLOWSCHED_CLASS is read per communicator (flowsched.torch.new_group sets it around one group's
 * creation), and a slot's peer_rank is the remote rank or -1, never our own isend tag. */
static void class_and_peer(const char* fake) {
  char path[] = "/tmp/fs-wrap-table-XXXXXX";
  struct fs_table_header* h = table_install(path);
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  ncclNetCommConfig_v12_t cfg = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
  void *actx = NULL, *bctx = NULL;
  setenv("FLOWSCHED_CLASS", "param_sync", 1);
  OK(net->init(&actx, 0xA, &cfg, NULL, NULL));
  CHECK(last("init")->tc == 34 << 2, "param_sync group: inner tc %d", last("init")->tc);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lcomm = NULL;
  OK(net->listen(actx, 0, handle, &lcomm));
  setenv("FLOWSCHED_CLASS", "bulk", 1); /* a later group; A's connections keep param_sync */
  OK(net->init(&bctx, 0xB, &cfg, NULL, NULL));
  CHECK(last("init")->tc == 1 << 2, "bulk group: inner tc %d (class read once per process?)",
        last("init")->tc);
  unsetenv("FLOWSCHED_CLASS");
  void* inner = NULL;
  void* as = connect12(net, actx, handle, &inner);
  void* bs = connect12(net, bctx, handle, &inner);
  void* ar = NULL;
  ncclNetDeviceHandle_t* dh = NULL;
  OK(net->accept(lcomm, &ar, &dh));
  CHECK(ar != NULL, "accept");
  struct fs_table_slot* a_send = slot_by(h, 0xA, FS_DIR_SEND);
  struct fs_table_slot* a_recv = slot_by(h, 0xA, FS_DIR_RECV);
  struct fs_table_slot* b_send = slot_by(h, 0xB, FS_DIR_SEND);
  CHECK(a_send->class_id == 2 && a_recv->class_id == 2, "group A is param_sync (%u, %u)",
        a_send->class_id, a_recv->class_id);
  CHECK(b_send->class_id == 5, "group B is bulk (%u)", b_send->class_id);

  /* NCCL's isend tag is the sender's own rank: not the destination */
  char buf[256];
  void* req = NULL;
  int done = 0, size = 0;
  OK(net->isend(as, buf, 100, 3, NULL, NULL, &req));
  CHECK(req != NULL, "isend");
  OK(net->test(req, &done, &size));
  CHECK(atomic_load(&a_send->peer_rank) == -1, "send slot's peer is unknown, not our rank (%d)",
        atomic_load(&a_send->peer_rank));
  /* the irecv tag is the remote sender's rank */
  void* datas[1] = {buf};
  size_t sizes[1] = {sizeof(buf)};
  int tags[1] = {7};
  void* mhs[1] = {NULL};
  req = NULL;
  OK(net->irecv(ar, 1, datas, sizes, tags, mhs, NULL, &req));
  CHECK(req != NULL, "irecv");
  CHECK(atomic_load(&a_recv->peer_rank) == 7, "recv slot's peer is the sender (%d)",
        atomic_load(&a_recv->peer_rank));
  int rsize = 0;
  OK(net->test(req, &done, &rsize));
  if (done) OK(net->irecvConsumed(ar, 1, req));
  OK(net->closeSend(as));
  OK(net->closeSend(bs));
  OK(net->closeRecv(ar));
  OK(net->closeListen(lcomm));
  OK(net->finalize(actx));
  OK(net->finalize(bctx));
  unload();

  /* v10 export (one process-wide context): the class is read at each listen/connect */
  const ncclNet_v10_t* n10 = load(fake, "ncclNetPlugin_v10");
  OK(n10->init(NULL, NULL));
  ncclNetCommConfig_v10_t c10 = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
  setenv("FLOWSCHED_CLASS", "kv", 1);
  OK(n10->listen(0, handle, &lcomm));
  void* s10 = NULL;
  while (s10 == NULL) OK(n10->connect(0, &c10, handle, &s10, &dh));
  setenv("FLOWSCHED_CLASS", "experience", 1);
  void* s10b = NULL;
  while (s10b == NULL) OK(n10->connect(0, &c10, handle, &s10b, &dh));
  unsetenv("FLOWSCHED_CLASS");
  void* r10 = NULL;
  OK(n10->accept(lcomm, &r10, &dh));
  CHECK(r10 != NULL, "v10 accept");
  uint16_t classes[2] = {0, 0};
  int nsend = 0;
  struct fs_table_slot* r_slot = slot_by(h, 0, FS_DIR_RECV);
  for (uint32_t i = 0; i < h->num_slots; i++) {
    struct fs_table_slot* s =
        (struct fs_table_slot*)((char*)h + FS_TABLE_HEADER_SIZE + i * FS_TABLE_SLOT_SIZE);
    if (atomic_load(&s->state) == FS_SLOT_ACTIVE && s->direction == FS_DIR_SEND && nsend < 2) {
      classes[nsend++] = s->class_id;
    }
  }
  CHECK(nsend == 2 && ((classes[0] == 3 && classes[1] == 1) || (classes[0] == 1 && classes[1] == 3)),
        "v10: the two connections are kv and experience (%u, %u)", classes[0], classes[1]);
  CHECK(r_slot->class_id == 3, "v10: the accepted connection has its listen's class (%u)",
        r_slot->class_id);
  OK(n10->closeSend(s10));
  OK(n10->closeSend(s10b));
  OK(n10->closeRecv(r10));
  OK(n10->closeListen(lcomm));
  unload();
  table_drop(h, path);
  printf("ok class per communicator (v12 init, v10 listen/connect), peer rank from irecv only\n");
}

/* A connect NCCL retries (NULL comm, same handle) keeps the inner traffic class of its first
 * call: the agent may rewrite the table's DSCPs (or start) between two retries, and the inner
 * must not see one connection's handshake continued on another inner context (v11/v12 inner)
 * or with another trafficClass (v10 inner). */
static void connect_retries_keep_their_class(const char* fake12, const char* fake10) {
  static const struct {
    const char* what;
    int fake_is_v10;
  } cases[] = {{"v12 inner", 0}, {"v10 inner", 1}};
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    char path[] = "/tmp/fs-wrap-table-XXXXXX";
    struct fs_table_header* h = table_install(path);
    const ncclNet_v12_t* net = load(cases[i].fake_is_v10 ? fake10 : fake12, "ncclNetPlugin_v12");
    ncclNetCommConfig_v12_t cfg = {.trafficClass = 0}; /* tp: level 0 */
    void* ctx = NULL;
    OK(net->init(&ctx, 0xC0, &cfg, NULL, NULL));
    int inits = count("init");
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    void* scomm = NULL;
    ncclNetDeviceHandle_t* dh = NULL;
    g_fake->connect_nulls = 2;
    int first = g_fake->ncalls;
    OK(net->connect(ctx, 0, handle, &scomm, &dh));
    CHECK(scomm == NULL, "%s: the connect is in progress", cases[i].what);
    h->level_marking[0].dscp = 40; /* the agent rewrites the config meanwhile */
    atomic_store(&h->config_seq, 4);
    for (int tries = 0; scomm == NULL; tries++) {
      CHECK(tries < 10, "%s: the connect never completed", cases[i].what);
      OK(net->connect(ctx, 0, handle, &scomm, &dh));
    }
    struct fake_call* call0 = NULL;
    for (int c = first; c < g_fake->ncalls; c++) {
      struct fake_call* call = &g_fake->calls[c];
      if (strcmp(call->fn, "connect") != 0) continue;
      if (call0 == NULL) call0 = call;
      CHECK(call->ctx == call0->ctx && call->tc == call0->tc,
            "%s: a retry of the same connect went to inner context %p with trafficClass %d, "
            "the first call to %p with %d", cases[i].what, call->ctx, call->tc, call0->ctx,
            call0->tc);
    }
    CHECK(count("init") == inits, "%s: an inner init in the middle of a connect",
          cases[i].what);
    OK(net->closeSend(scomm));
    OK(net->finalize(ctx));
    unload();
    table_drop(h, path);
  }
  printf("ok a connect's retries keep the inner context and trafficClass of its first call\n");
}

/* NCCL calls setNetAttr on a context right before a connect (and before each operation):
 * an inner context the wrapper makes in the middle of that connect, for a traffic class the
 * agent's new DSCP gives the connection, must have had that hint before the inner's connect,
 * as the inner contexts that already existed did (IBext reads it when it connects). */
static void net_attr_reaches_new_inner_context(const char* fake) {
  char path[] = "/tmp/fs-wrap-table-XXXXXX";
  struct fs_table_header* h = table_install(path);
  const ncclNet_v12_t* net = load(fake, "ncclNetPlugin_v12");
  ncclNetCommConfig_v12_t cfg = {.trafficClass = 0}; /* tp: level 0 */
  void* ctx = NULL;
  OK(net->init(&ctx, 0xF0, &cfg, NULL, NULL));
  void* first_ictx = last("init")->ctx;
  ncclNetAttr_v12_t attr = {.op = 0x61, .algo = 3, .proto = 5};
  OK(net->setNetAttr(ctx, &attr));
  h->level_marking[0].dscp = 40; /* the agent's config gives tp another queue meanwhile */
  atomic_store(&h->config_seq, 4);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* inner = NULL;
  void* scomm = connect12(net, ctx, handle, &inner);
  int connect_at = -1, attr_at = -1;
  void* ictx = last("connect")->ctx;
  CHECK(ictx != first_ictx, "the new DSCP makes a new inner context");
  for (int c = 0; c < g_fake->ncalls; c++) {
    const struct fake_call* call = &g_fake->calls[c];
    if (call->ctx != ictx) continue;
    if (strcmp(call->fn, "connect") == 0 && connect_at < 0) connect_at = c;
    if (strcmp(call->fn, "setNetAttr") == 0 && attr_at < 0 && call->op == 0x61 &&
        call->algo == 3 && call->proto == 5) {
      attr_at = c;
    }
  }
  CHECK(attr_at >= 0 && attr_at < connect_at,
        "the inner context made for the connect never got the setNetAttr hint before its "
        "connect (hint at call %d, connect at call %d)", attr_at, connect_at);
  OK(net->closeSend(scomm));
  OK(net->finalize(ctx));
  unload();
  table_drop(h, path);
  printf("ok an inner context made for a connect gets the context's setNetAttr hint first\n");
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s OUTER.so FAKE12.so FAKE10.so FAKE8.so\n", argv[0]);
    return 2;
  }
  g_outer = argv[1];
  forwarding_v12(argv[2]);
  forwarding_v8_export(argv[2]);
  inner_v10(argv[3]);
  inner_v8(argv[4]);
  concurrent_first_init(argv[3]);
  concurrent_table_inits(argv[3]);
  missing_inner();
  connects_in_progress_outlive_finalize(argv[2]);
  permit(argv[2]);
  permit_close_in_flight(argv[2]);
  logger_inner_inits_v10(argv[2]);
  logger_inner_inits_v12(argv[2]);
  class_and_peer(argv[2]);
  connect_retries_keep_their_class(argv[2], argv[3]);
  net_attr_reaches_new_inner_context(argv[2]);
  return 0;
}
