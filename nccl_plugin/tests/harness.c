/* SPDX-License-Identifier: Apache-2.0
 * C harness that drives the plugin exactly as NCCL does, without NCCL or a GPU.
 *
 *   harness PLUGIN.so all                 every test below, for v8, v9, v10, v11 and v12
 *                                         (v8/v9 through a v10-shaped shim below; the
 *                                         table's name must be $HARNESS_PLUGIN_NAME, default
 *                                         "flowsched")
 *   harness PLUGIN.so transfer VERSION    two processes over the chosen interface: a
 *                                         "service" thread does listen/connect/accept/regMr,
 *                                         a "progress" thread keeps up to 8 isend/irecv in
 *                                         flight and polls test; 0 B .. 64 MiB, verified
 *                                         byte for byte, receive buffers larger than sends,
 *                                         irecv requests preset to 0x1, then 32 in flight
 *   harness PLUGIN.so alternate VERSION   one thread alternating connect and accept (NCCL's
 *                                         GDR probe pattern), then transfers in that thread
 *   harness PLUGIN.so contexts VERSION    two contexts (communicators) at once, one
 *                                         progress thread each (v11/v12), while the main
 *                                         (service) thread connects, transfers, closes and
 *                                         sends setNetAttr hints on the same contexts
 *   harness PLUGIN.so cycles VERSION      init/finalize cycles, then dlclose/dlopen cycles
 *   harness PLUGIN.so errors VERSION      misuse returns NCCL error codes, never crashes; accept
 *                                         with no file descriptor left is an error, not a NULL
 *                                         comm to retry forever
 *   harness PLUGIN.so lifetime VERSION    finalize before the context's listen comm, open
 *                                         connections or pending connect are closed: they
 *                                         keep working, and the context is freed by the last
 *                                         close (v11/v12; run under ASan+LSan by make check)
 *   harness PLUGIN.so gateleak VERSION    the permit (FLOWSCHED_GATING=1, no guard): a tp send
 *                                         still in flight when its connection is closed no
 *                                         longer defers a later bulk send on the device
 *   harness PLUGIN.so marking VERSION     after each level change written to a flow table, every
 *                                         connected socket's IP_TOS/IPV6_TCLASS and SO_PRIORITY
 *                                         (getsockopt) are the level's marking; connections
 *                                         made before the table existed move into it, and
 *                                         into a table re-created at the same path
 *   harness PLUGIN.so stale VERSION       peers that connect to a listener and send nothing (more
 *                                         of them than it has slots): once they age out
 *                                         (FLOWSCHED_ACCEPT_TIMEOUT_MS), a real connection is
 *                                         accepted and carries data
 *   harness PLUGIN.so deadpeers VERSION   peers that sent a valid hello and died fill the
 *                                         listener's half-built connections: a real
 *                                         connection still gets in (the stalest is evicted,
 *                                         its socket closed) and carries data
 *   harness PLUGIN.so closenote VERSION   a send connection closed right after its last
 *                                         completion, with the receiver's rank note unread
 *                                         and most of the message still queued: the receiver
 *                                         gets every byte (v11/v12, the transport only)
 *   harness PLUGIN.so exitlive VERSION    a child exits with a pair connected, a flow table
 *                                         mapped and a thread still sending: the plugin's
 *                                         destructors leave all in place (no SIGSEGV at exit)
 *   harness PLUGIN.so bw SIZE COUNT [V]   benchmark: streaming throughput (JSON line)
 *   harness PLUGIN.so rtt COUNT [V]       benchmark: 8-byte round trip (JSON line)
 *
 * Exit status 0 when every check passed.
 */
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl/net_v10.h"
#include "nccl/net_v11.h"
#include "nccl/net_v12.h"
#include "flow_table.h"
#include "nccl/net_v8.h"
#include "nccl/net_v9.h"
#include "transport.h"

#define STEPS 8
#define TIMEOUT_S 60

#define CHECK(cond, ...)                                                           \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      fprintf(stderr, "[pid %d] FAIL %s:%d: %s: ", getpid(), __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                \
      fprintf(stderr, "\n");                                                       \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)
#define NCHECK(call) CHECK((call) == ncclSuccess, "%s", #call)

/* ---- a version-neutral view of the exported tables -------------------------------------- */

struct net {
  int version;
  void* lib;
  const ncclNet_v10_t* v10;
  const ncclNet_v11_t* v11; /* v12 shares v11's layout for every entry we call through it */
  const ncclNet_v12_t* v12;
};

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                   const char* fmt, ...) {
  (void)flags;
  if (level != NCCL_LOG_WARN && getenv("HARNESS_VERBOSE") == NULL) {
    return;
  }
  va_list args;
  va_start(args, fmt);
  fprintf(stderr, "[pid %d] %s:%d ", getpid(), file, line);
  vfprintf(stderr, fmt, args);
  fprintf(stderr, "\n");
  va_end(args);
}

static const char* g_plugin_path;

/* ---- v8/v9: the same calls through a v10-shaped shim (NCCL's own shims do the same) ------ */

static const ncclNet_v8_t* g_v8;
static const ncclNet_v9_t* g_v9;

#define LEGACY(fn, ...) (g_v9 != NULL ? g_v9->fn(__VA_ARGS__) : g_v8->fn(__VA_ARGS__))

static ncclResult_t s_init(ncclDebugLogger_t log_fn, ncclProfilerCallback_t prof) {
  (void)prof;
  return LEGACY(init, log_fn);
}
static ncclResult_t s_devices(int* ndev) { return LEGACY(devices, ndev); }
static ncclResult_t s_props(int dev, ncclNetProperties_v10_t* out) {
  memset(out, 0, sizeof(*out));
  if (g_v9 != NULL) {
    ncclNetProperties_v9_t p;
    ncclResult_t res = g_v9->getProperties(dev, &p);
    memcpy(out, &p, sizeof(p)); /* v9 and v10 properties are the same struct */
    return res;
  }
  ncclNetProperties_v8_t p;
  ncclResult_t res = g_v8->getProperties(dev, &p);
  out->name = p.name;
  out->pciPath = p.pciPath;
  out->guid = p.guid;
  out->ptrSupport = p.ptrSupport;
  out->regIsGlobal = p.regIsGlobal;
  out->speed = p.speed;
  out->port = p.port;
  out->latency = p.latency;
  out->maxComms = p.maxComms;
  out->maxRecvs = p.maxRecvs;
  out->netDeviceType = p.netDeviceType;
  out->netDeviceVersion = p.netDeviceVersion;
  out->vProps.ndevs = 1; /* what NCCL's v8 shim fills in */
  out->vProps.devs[0] = dev;
  out->maxP2pBytes = NCCL_MAX_NET_SIZE_V8;
  out->maxCollBytes = NCCL_MAX_COLLNET_SIZE;
  return res;
}
static ncclResult_t s_listen(int dev, void* handle, void** l) { return LEGACY(listen, dev, handle, l); }
static ncclResult_t s_connect(int dev, ncclNetCommConfig_v10_t* cfg, void* handle, void** s,
                              ncclNetDeviceHandle_t** dh) {
  (void)cfg; /* v8/v9 carry no trafficClass */
  return LEGACY(connect, dev, handle, s, dh);
}
static ncclResult_t s_accept(void* l, void** r, ncclNetDeviceHandle_t** dh) {
  return LEGACY(accept, l, r, dh);
}
static ncclResult_t s_reg_mr(void* c, void* d, size_t sz, int type, void** mh) {
  return LEGACY(regMr, c, d, sz, type, mh);
}
static ncclResult_t s_dereg_mr(void* c, void* mh) { return LEGACY(deregMr, c, mh); }
static ncclResult_t s_isend(void* s, void* d, size_t size, int tag, void* mh, void* ph, void** req) {
  (void)ph;
  if (g_v9 != NULL) return g_v9->isend(s, d, size, tag, mh, req);
  return g_v8->isend(s, d, (int)size, tag, mh, req);
}
static ncclResult_t s_irecv(void* r, int n, void** d, size_t* sizes, int* tags, void** mhs,
                            void** phs, void** req) {
  (void)phs;
  if (g_v9 != NULL) return g_v9->irecv(r, n, d, sizes, tags, mhs, req);
  int isizes[8];
  for (int i = 0; i < n && i < 8; i++) isizes[i] = (int)sizes[i];
  *req = NULL; /* NCCL's v8 shim clears the optional-completion hint */
  return g_v8->irecv(r, n, d, isizes, tags, mhs, req);
}
static ncclResult_t s_iflush(void* r, int n, void** d, int* sizes, void** mhs, void** req) {
  return LEGACY(iflush, r, n, d, sizes, mhs, req);
}
static ncclResult_t s_test(void* req, int* done, int* sizes) { return LEGACY(test, req, done, sizes); }
static ncclResult_t s_close_send(void* c) { return LEGACY(closeSend, c); }
static ncclResult_t s_close_recv(void* c) { return LEGACY(closeRecv, c); }
static ncclResult_t s_close_listen(void* c) { return LEGACY(closeListen, c); }

static const ncclNet_v10_t g_legacy_shim = {
    .init = s_init, .devices = s_devices, .getProperties = s_props, .listen = s_listen,
    .connect = s_connect, .accept = s_accept, .regMr = s_reg_mr, .deregMr = s_dereg_mr,
    .isend = s_isend, .irecv = s_irecv, .iflush = s_iflush, .test = s_test,
    .closeSend = s_close_send, .closeRecv = s_close_recv, .closeListen = s_close_listen,
};

static const char* plugin_name(void) {
  const char* name = getenv("HARNESS_PLUGIN_NAME");
  return name != NULL ? name : "flowsched";
}

static void net_open(struct net* n, int version) {
  memset(n, 0, sizeof(*n));
  n->version = version < 10 ? 10 : version; /* v8/v9 run through the v10-shaped shim */
  n->lib = dlopen(g_plugin_path, RTLD_NOW | RTLD_LOCAL);
  CHECK(n->lib != NULL, "dlopen: %s", dlerror());
  char sym[32];
  snprintf(sym, sizeof(sym), "ncclNetPlugin_v%d", version);
  void* table = dlsym(n->lib, sym);
  CHECK(table != NULL, "%s missing", sym);
  g_v8 = version == 8 ? table : NULL;
  g_v9 = version == 9 ? table : NULL;
  const char* name = *(const char* const*)table; /* every version starts with its name */
  CHECK(strcmp(name, plugin_name()) == 0, "name %s", name);
  if (version < 10) {
    n->v10 = &g_legacy_shim;
  } else if (version == 10) {
    n->v10 = table;
  } else {
    n->v11 = table;
    n->v12 = version == 12 ? table : NULL;
  }
}

static void net_close(struct net* n) {
  CHECK(dlclose(n->lib) == 0, "dlclose: %s", dlerror());
}

#define CALL(n, fn, ...) ((n)->version == 10 ? (n)->v10->fn(__VA_ARGS__) : (n)->v11->fn(__VA_ARGS__))

/* init (+ devices + getProperties of every device, as NCCL does); returns the ctx. */
static void* net_init(struct net* n, uint64_t comm_id, int traffic_class) {
  void* ctx = NULL;
  if (n->version == 10) {
    NCHECK(n->v10->init(logger, NULL));
  } else {
    ncclNetCommConfig_v11_t cfg = {.trafficClass = traffic_class};
    NCHECK(n->v11->init(&ctx, comm_id, &cfg, logger, NULL));
    CHECK(ctx != NULL, "init gave no context");
  }
  int ndev = 0;
  NCHECK(CALL(n, devices, &ndev));
  CHECK(ndev > 0, "no device");
  for (int d = 0; d < ndev; d++) {
    /* what NCCL checks: a host device, and both size limits in (0, 1 TiB] (proxy setup) */
#define PROPS_CHECK(p)                                                                            \
  CHECK((p).netDeviceType == NCCL_NET_DEVICE_HOST && (p).ptrSupport == NCCL_PTR_HOST &&          \
            (p).maxRecvs == 1 && (p).vProps.ndevs == 1 && (p).vProps.devs[0] == d,               \
        "props of device %d", d);                                                                 \
  CHECK((p).maxP2pBytes > 0 && (p).maxP2pBytes <= NCCL_MAX_NET_SIZE_BYTES, "maxP2pBytes %zu",    \
        (size_t)(p).maxP2pBytes);                                                                 \
  CHECK((p).maxCollBytes > 0 && (p).maxCollBytes <= NCCL_MAX_NET_SIZE_BYTES, "maxCollBytes %zu", \
        (size_t)(p).maxCollBytes)
    if (n->version == 10) {
      ncclNetProperties_v10_t p;
      NCHECK(n->v10->getProperties(d, &p));
      PROPS_CHECK(p);
    } else if (n->version == 11) {
      ncclNetProperties_v11_t p;
      NCHECK(n->v11->getProperties(d, &p));
      PROPS_CHECK(p);
      CHECK(p.maxMultiRequestSize == 1, "maxMultiRequestSize");
    } else {
      ncclNetProperties_v12_t p;
      NCHECK(n->v12->getProperties(d, &p));
      PROPS_CHECK(p);
      CHECK(p.maxMultiRequestSize == 1 && p.railId == -1 && p.planeId == -1, "props v12");
    }
#undef PROPS_CHECK
  }
  return ctx;
}

static void net_finalize(struct net* n, void* ctx) {
  if (n->version != 10) {
    NCHECK(n->v11->finalize(ctx));
  }
}

static void net_listen(struct net* n, void* ctx, char* handle, void** lcomm) {
  if (n->version == 10) {
    NCHECK(n->v10->listen(0, handle, lcomm));
  } else {
    NCHECK(n->v11->listen(ctx, 0, handle, lcomm));
  }
  CHECK(*lcomm != NULL, "listen gave no comm");
}

/* One connect call (NULL comm = not finished yet: call again with the same handle). */
static ncclResult_t net_connect_step(struct net* n, void* ctx, char* handle, int tc, void** scomm) {
  ncclNetDeviceHandle_t* dev_handle = NULL;
  if (n->version == 10) {
    ncclNetCommConfig_v10_t cfg = {.trafficClass = tc};
    return n->v10->connect(0, &cfg, handle, scomm, &dev_handle);
  }
  return n->v11->connect(ctx, 0, handle, scomm, &dev_handle);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void* net_connect(struct net* n, void* ctx, char* handle, int tc) {
  void* scomm = NULL;
  double deadline = now_s() + TIMEOUT_S;
  while (scomm == NULL) {
    NCHECK(net_connect_step(n, ctx, handle, tc, &scomm));
    CHECK(now_s() < deadline, "connect timed out");
  }
  return scomm;
}

static void* net_accept(struct net* n, void* lcomm) {
  void* rcomm = NULL;
  ncclNetDeviceHandle_t* dev_handle = NULL;
  double deadline = now_s() + TIMEOUT_S;
  while (rcomm == NULL) {
    NCHECK(CALL(n, accept, lcomm, &rcomm, &dev_handle));
    CHECK(now_s() < deadline, "accept timed out");
  }
  NCHECK(CALL(n, closeListen, lcomm));
  return rcomm;
}

/* ---- message pattern -------------------------------------------------------------------- */

static const size_t k_sizes[] = {0,      1,           7,       8,          100,       1023,
                                 1024,   1025,        4096,    65539,      524288,    1 << 20,
                                 (1 << 20) + 1, 3 << 20, (16 << 20) + 5, 0, 64 << 20, 12345};
#define NSIZES (sizeof(k_sizes) / sizeof(k_sizes[0]))
#define SLACK 4096 /* receive buffers are larger than the sends */

static uint8_t pattern_byte(uint64_t seed, size_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  return (uint8_t)((x >> 29) ^ (x >> 47) ^ i);
}

static void pattern_fill(uint8_t* buf, size_t size, uint64_t seed) {
  for (size_t i = 0; i < size; i++) {
    buf[i] = pattern_byte(seed, i);
  }
}

static void pattern_check(const uint8_t* buf, size_t size, uint64_t seed) {
  for (size_t i = 0; i < size; i++) {
    CHECK(buf[i] == pattern_byte(seed, i), "byte %zu of message seed %llu differs", i,
          (unsigned long long)seed);
  }
}

/* ---- the progress side: keep STEPS requests in flight, as NCCL's proxy does ------------- */

struct stream {
  struct net* n;
  void* comm;
  int is_send;
  int tag;
  const size_t* sizes;
  size_t count;
  int inflight;
  uint64_t seed_base;
};

struct slot {
  void* request;
  uint8_t* buf;
  size_t size;
  void* mhandle;
  size_t index;
};

static void slot_post(struct stream* st, struct slot* s) {
  size_t cap = st->is_send ? s->size : s->size + SLACK;
  double deadline = now_s() + TIMEOUT_S;
  s->request = NULL;
  while (s->request == NULL) {
    if (st->is_send) {
      NCHECK(CALL(st->n, isend, st->comm, s->buf, s->size, st->tag, s->mhandle, NULL, &s->request));
    } else {
      void* data[1] = {s->buf};
      size_t sizes[1] = {cap};
      int tags[1] = {st->tag};
      void* mh[1] = {s->mhandle};
      s->request = (void*)NCCL_NET_OPTIONAL_RECV_COMPLETION; /* the 0x1 preset trap */
      NCHECK(CALL(st->n, irecv, st->comm, 1, data, sizes, tags, mh, NULL, &s->request));
      CHECK(s->request != (void*)NCCL_NET_OPTIONAL_RECV_COMPLETION, "irecv left *request=0x1");
    }
    CHECK(now_s() < deadline, "post timed out");
  }
}

/* One test() call; returns 1 when the slot's request completed. */
static int slot_test(struct stream* st, struct slot* s) {
  int done = 0;
  int size = -1;
  NCHECK(CALL(st->n, test, s->request, &done, &size));
  if (!done) {
    return 0;
  }
  CHECK((size_t)size == s->size, "test size %d, expected %zu", size, s->size);
  if (!st->is_send) {
    pattern_check(s->buf, s->size, st->seed_base + s->index);
  }
  return 1;
}

static void slot_prepare(struct stream* st, struct slot* s, size_t index) {
  s->index = index;
  s->size = st->sizes[index];
  size_t cap = s->size + SLACK;
  s->buf = malloc(cap);
  CHECK(s->buf != NULL, "malloc %zu", cap);
  if (st->is_send) {
    pattern_fill(s->buf, s->size, st->seed_base + index);
  } else {
    memset(s->buf, 0xEE, cap);
  }
  NCHECK(CALL(st->n, regMr, st->comm, s->buf, cap, NCCL_PTR_HOST, &s->mhandle));
}

static void slot_release(struct stream* st, struct slot* s) {
  NCHECK(CALL(st->n, deregMr, st->comm, s->mhandle));
  free(s->buf);
  s->buf = NULL;
}

static void* stream_run(void* arg) {
  struct stream* st = arg;
  struct slot slots[64];
  size_t posted = 0, done = 0;
  double deadline = now_s() + TIMEOUT_S * 2;
  while (done < st->count) {
    while (posted < st->count && posted - done < (size_t)st->inflight) {
      struct slot* s = &slots[posted % 64];
      slot_prepare(st, s, posted);
      slot_post(st, s);
      posted++;
    }
    struct slot* oldest = &slots[done % 64];
    if (slot_test(st, oldest)) {
      slot_release(st, oldest);
      done++;
    }
    CHECK(now_s() < deadline, "stream timed out (%zu/%zu done)", done, st->count);
  }
  return NULL;
}

static void stream_start(pthread_t* th, struct stream* st) {
  CHECK(pthread_create(th, NULL, stream_run, st) == 0, "pthread_create");
}

/* ---- two processes ---------------------------------------------------------------------- */

static void connect_alternating(struct net* n, void* ctx, void** scomm, void** rcomm);
static void pump_pair(struct net* n, void* scomm, void* rcomm, size_t size, uint64_t seed);

/* What NCCL's service thread does while the progress thread moves data on the same context:
 * more connections come and go, and setNetAttr hints arrive. */
static void service_churn(struct net* n, void* ctx) {
  for (int i = 0; i < 5; i++) {
    void *scomm, *rcomm;
    connect_alternating(n, ctx, &scomm, &rcomm);
    pump_pair(n, scomm, rcomm, 1000 + (size_t)i, 900 + (uint64_t)i);
    if (n->version != 10) {
      ncclNetAttr_v11_t attr;
      memset(&attr, 0xff, sizeof(attr));
      attr.op = 1u << (unsigned)i;
      NCHECK(n->v11->setNetAttr(ctx, &attr));
    }
    NCHECK(CALL(n, closeSend, scomm));
    NCHECK(CALL(n, closeRecv, rcomm));
  }
}

static void write_all(int fd, const void* buf, size_t len) {
  CHECK(write(fd, buf, len) == (ssize_t)len, "pipe write");
}

static void read_all(int fd, void* buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = read(fd, (char*)buf + got, len - got);
    CHECK(n > 0, "pipe read");
    got += (size_t)n;
  }
}

static size_t g_small[32];

static void run_streams(struct net* n, void* comm, int is_send) {
  struct stream st = {.n = n, .comm = comm, .is_send = is_send, .tag = 0, .sizes = k_sizes,
                      .count = NSIZES, .inflight = STEPS, .seed_base = 1000};
  pthread_t th;
  stream_start(&th, &st); /* the "progress" thread */
  pthread_join(th, NULL);
  for (size_t i = 0; i < 32; i++) {
    g_small[i] = (i * 37) % 300;
  }
  struct stream burst = {.n = n, .comm = comm, .is_send = is_send, .tag = 0, .sizes = g_small,
                         .count = 32, .inflight = 32, .seed_base = 5000};
  stream_start(&th, &burst); /* 32 requests in flight at once */
  pthread_join(th, NULL);
}

static void side_receiver(int version, int handle_fd, int nctx) {
  struct net n;
  net_open(&n, version);
  void* ctx[2];
  void* rcomm[2];
  char handle[2][NCCL_NET_HANDLE_MAXSIZE];
  for (int c = 0; c < nctx; c++) {
    ctx[c] = net_init(&n, 0xC0FFEE00u + (uint64_t)c, -1);
    void* lcomm = NULL;
    net_listen(&n, ctx[c], handle[c], &lcomm);
    write_all(handle_fd, handle[c], sizeof(handle[c]));
    rcomm[c] = net_accept(&n, lcomm);
  }
  pthread_t th[2];
  struct stream st[2];
  for (int c = 0; c < nctx; c++) {
    st[c] = (struct stream){.n = &n, .comm = rcomm[c], .is_send = 0, .sizes = k_sizes,
                            .count = NSIZES, .inflight = STEPS, .seed_base = 1000};
  }
  if (nctx == 1) {
    run_streams(&n, rcomm[0], 0);
  } else {
    for (int c = 0; c < nctx; c++) stream_start(&th[c], &st[c]);
    service_churn(&n, ctx[0]);
    for (int c = 0; c < nctx; c++) pthread_join(th[c], NULL);
  }
  for (int c = 0; c < nctx; c++) {
    NCHECK(CALL(&n, closeRecv, rcomm[c]));
    net_finalize(&n, ctx[c]);
  }
  net_close(&n);
}

static void side_sender(int version, int handle_fd, int nctx) {
  struct net n;
  net_open(&n, version);
  void* ctx[2];
  void* scomm[2];
  for (int c = 0; c < nctx; c++) {
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    ctx[c] = net_init(&n, 0xC0FFEE00u + (uint64_t)c, -1);
    read_all(handle_fd, handle, sizeof(handle));
    scomm[c] = net_connect(&n, ctx[c], handle, 2);
  }
  pthread_t th[2];
  struct stream st[2];
  for (int c = 0; c < nctx; c++) {
    st[c] = (struct stream){.n = &n, .comm = scomm[c], .is_send = 1, .sizes = k_sizes,
                            .count = NSIZES, .inflight = STEPS, .seed_base = 1000};
  }
  if (nctx == 1) {
    run_streams(&n, scomm[0], 1);
  } else {
    for (int c = 0; c < nctx; c++) stream_start(&th[c], &st[c]);
    service_churn(&n, ctx[1]);
    for (int c = 0; c < nctx; c++) pthread_join(th[c], NULL);
  }
  for (int c = 0; c < nctx; c++) {
    NCHECK(CALL(&n, closeSend, scomm[c]));
    net_finalize(&n, ctx[c]);
  }
  net_close(&n);
}

static int two_processes(int version, int nctx) {
  int fds[2];
  CHECK(pipe(fds) == 0, "pipe");
  pid_t child = fork();
  CHECK(child >= 0, "fork");
  if (child == 0) {
    close(fds[0]);
    alarm(TIMEOUT_S * 3);
    side_receiver(version, fds[1], nctx);
    _exit(0);
  }
  close(fds[1]);
  side_sender(version, fds[0], nctx);
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child, "waitpid");
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "receiver failed (status 0x%x)", status);
  close(fds[0]);
  return 0;
}

/* ---- one thread alternating connect and accept ------------------------------------------ */

static void pump_pair(struct net* n, void* scomm, void* rcomm, size_t size, uint64_t seed) {
  uint8_t* sbuf = malloc(size + 1);
  uint8_t* rbuf = malloc(size + SLACK);
  CHECK(sbuf && rbuf, "malloc");
  pattern_fill(sbuf, size, seed);
  void *smh, *rmh, *sreq = NULL, *rreq = NULL;
  NCHECK(CALL(n, regMr, scomm, sbuf, size + 1, NCCL_PTR_HOST, &smh));
  NCHECK(CALL(n, regMr, rcomm, rbuf, size + SLACK, NCCL_PTR_HOST, &rmh));
  void* data[1] = {rbuf};
  size_t sizes[1] = {size + SLACK};
  int tags[1] = {7};
  double deadline = now_s() + TIMEOUT_S;
  while (rreq == NULL) {
    NCHECK(CALL(n, irecv, rcomm, 1, data, sizes, tags, &rmh, NULL, &rreq));
  }
  while (sreq == NULL) {
    NCHECK(CALL(n, isend, scomm, sbuf, size, 7, smh, NULL, &sreq));
  }
  int sdone = 0, rdone = 0, ssize = -1, rsize = -1;
  while (!sdone || !rdone) {
    if (!sdone) NCHECK(CALL(n, test, sreq, &sdone, &ssize));
    if (!rdone) NCHECK(CALL(n, test, rreq, &rdone, &rsize));
    CHECK(now_s() < deadline, "single-thread transfer timed out");
  }
  CHECK((size_t)rsize == size && (size_t)ssize == size, "sizes %d %d", ssize, rsize);
  pattern_check(rbuf, size, seed);
  NCHECK(CALL(n, deregMr, scomm, smh));
  NCHECK(CALL(n, deregMr, rcomm, rmh));
  free(sbuf);
  free(rbuf);
}

/* Connect and accept alternately from this one thread; returns both comms. */
static void connect_alternating(struct net* n, void* ctx, void** scomm, void** rcomm) {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lcomm = NULL;
  net_listen(n, ctx, handle, &lcomm);
  ncclNetDeviceHandle_t* dev_handle = NULL;
  *scomm = *rcomm = NULL;
  double deadline = now_s() + TIMEOUT_S;
  while (*scomm == NULL || *rcomm == NULL) {
    if (*scomm == NULL) NCHECK(net_connect_step(n, ctx, handle, -1, scomm));
    /* the GDR probe passes NULL for the device handle pointer */
    if (*rcomm == NULL) NCHECK(CALL(n, accept, lcomm, rcomm, n->version == 10 ? &dev_handle : NULL));
    CHECK(now_s() < deadline, "alternating connect/accept timed out");
  }
  NCHECK(CALL(n, closeListen, lcomm));
}

static int test_alternate(int version) {
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 42, -1);
  void *scomm, *rcomm;
  connect_alternating(&n, ctx, &scomm, &rcomm);
  size_t sizes[] = {0, 5, 2048, 1 << 20, (4 << 20) + 3};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    pump_pair(&n, scomm, rcomm, sizes[i], 77 + i);
  }
  NCHECK(CALL(&n, closeSend, scomm));
  NCHECK(CALL(&n, closeRecv, rcomm));
  net_finalize(&n, ctx);
  net_close(&n);
  return 0;
}

/* ---- init/finalize cycles and dlclose/dlopen cycles ------------------------------------- */

static int test_cycles(int version) {
  for (int reload = 0; reload < 3; reload++) {
    struct net n;
    net_open(&n, version);
    int rounds = version <= 10 ? 1 : 4;
    for (int i = 0; i < rounds; i++) {
      void* ctx = net_init(&n, 100 + (uint64_t)i, -1);
      void *scomm, *rcomm;
      connect_alternating(&n, ctx, &scomm, &rcomm);
      pump_pair(&n, scomm, rcomm, 3000 + (size_t)i, (uint64_t)(reload * 10 + i));
      NCHECK(CALL(&n, closeSend, scomm));
      NCHECK(CALL(&n, closeRecv, rcomm));
      net_finalize(&n, ctx);
    }
    net_close(&n); /* NCCL 2.27+ unloads the plugin after the last communicator */
  }
  return 0;
}

/* ---- misuse: NCCL error codes, no crash ------------------------------------------------- */

/* accept when the process can open no more files (EMFILE): an error, on which NCCL aborts the
 * communicator, never a NULL comm that NCCL would retry forever. The connect side completes
 * in the kernel's backlog first; then the open-file limit is lowered to the lowest free
 * descriptor for the accept calls only. */
static void errors_accept_emfile(struct net* n, void* ctx) {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lcomm = NULL;
  net_listen(n, ctx, handle, &lcomm);
  void* scomm = net_connect(n, ctx, handle, -1);
  struct rlimit saved;
  CHECK(getrlimit(RLIMIT_NOFILE, &saved) == 0, "getrlimit");
  int lowest = open("/dev/null", O_RDONLY | O_CLOEXEC);
  CHECK(lowest >= 0, "open /dev/null");
  close(lowest);
  struct rlimit none_left = {.rlim_cur = (rlim_t)lowest, .rlim_max = saved.rlim_max};
  CHECK(setrlimit(RLIMIT_NOFILE, &none_left) == 0, "setrlimit");
  void* rcomm = NULL;
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < 100 && res == ncclSuccess && rcomm == NULL; i++) {
    res = CALL(n, accept, lcomm, &rcomm, NULL);
  }
  CHECK(setrlimit(RLIMIT_NOFILE, &saved) == 0, "setrlimit (restore)");
  CHECK(res == ncclSystemError && rcomm == NULL,
        "accept with no descriptor left: ncclResult %d, comm %p (a NULL forever hangs NCCL)",
        (int)res, rcomm);
  NCHECK(CALL(n, closeSend, scomm));
  NCHECK(CALL(n, closeListen, lcomm));
}

static int test_errors(int version) {
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 7, -1);
  void *scomm, *rcomm, *mh = NULL;
  connect_alternating(&n, ctx, &scomm, &rcomm);
  char buf[4096];
  CHECK(CALL(&n, regMr, scomm, buf, sizeof(buf), NCCL_PTR_CUDA, &mh) != ncclSuccess, "regMr CUDA");
  NCHECK(CALL(&n, regMr, rcomm, buf, sizeof(buf), NCCL_PTR_HOST, &mh));
  void* data[2] = {buf, buf};
  size_t sizes[2] = {100, 100};
  int tags[2] = {0, 0};
  void* mhs[2] = {mh, mh};
  void* req = (void*)0x1;
  CHECK(CALL(&n, irecv, rcomm, 2, data, sizes, tags, mhs, NULL, &req) != ncclSuccess, "irecv n=2");
  CHECK(req == NULL, "irecv must write *request even on error");
  /* a send larger than the posted receive: the receive fails with InvalidUsage */
  static char big[2000];
  void *sreq = NULL, *rreq = NULL;
  while (sreq == NULL) NCHECK(CALL(&n, isend, scomm, big, sizeof(big), 0, mh, NULL, &sreq));
  ncclResult_t res = ncclSuccess;
  while (rreq == NULL && res == ncclSuccess) {
    res = CALL(&n, irecv, rcomm, 1, data, sizes, tags, mhs, NULL, &rreq);
  }
  int done = 0, size = 0;
  double deadline = now_s() + TIMEOUT_S;
  while (res == ncclSuccess && !done) {
    int sdone = 0;
    if (sreq != NULL) {
      NCHECK(CALL(&n, test, sreq, &sdone, &size));
      sreq = sdone ? NULL : sreq;
    }
    if (res == ncclSuccess) res = CALL(&n, test, rreq, &done, &size);
    CHECK(now_s() < deadline, "truncation test timed out");
  }
  CHECK(res == ncclInvalidUsage, "truncated receive returned %d", (int)res);
  char junk[NCCL_NET_HANDLE_MAXSIZE] = {0};
  void* bad = NULL;
  CHECK(net_connect_step(&n, ctx, junk, -1, &bad) != ncclSuccess && bad == NULL, "junk handle");
  NCHECK(CALL(&n, closeSend, scomm));
  NCHECK(CALL(&n, closeRecv, rcomm));
  errors_accept_emfile(&n, ctx);
  net_finalize(&n, ctx);
  net_close(&n);
  return 0;
}

/* ---- context lifetime: finalize while the context is still in use ----------------------- */

/* finalize(owner) with a listen comm of `owner` open: a peer connects, accept still works on
 * the listen comm (it reads the context), and data flows on the accepted connection. */
static void lifetime_listen_outlives_finalize(struct net* n, void* peer) {
  void* owner = net_init(n, 0xA1, -1);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lcomm = NULL, *scomm = NULL, *rcomm = NULL;
  net_listen(n, owner, handle, &lcomm);
  net_finalize(n, owner);
  double deadline = now_s() + TIMEOUT_S;
  while (scomm == NULL || rcomm == NULL) {
    if (scomm == NULL) NCHECK(net_connect_step(n, peer, handle, -1, &scomm));
    if (rcomm == NULL) NCHECK(CALL(n, accept, lcomm, &rcomm, NULL));
    CHECK(now_s() < deadline, "connect/accept after finalize timed out");
  }
  NCHECK(CALL(n, closeListen, lcomm));
  pump_pair(n, scomm, rcomm, 5000, 31);
  NCHECK(CALL(n, closeSend, scomm));
  NCHECK(CALL(n, closeRecv, rcomm)); /* the owner context's last reference */
}

/* finalize(owner) with both ends of a connection open: they keep working until closed. */
static void lifetime_comms_outlive_finalize(struct net* n) {
  void* owner = net_init(n, 0xA2, -1);
  void *scomm, *rcomm;
  connect_alternating(n, owner, &scomm, &rcomm);
  net_finalize(n, owner);
  pump_pair(n, scomm, rcomm, 70000, 32);
  NCHECK(CALL(n, closeSend, scomm));
  NCHECK(CALL(n, closeRecv, rcomm)); /* the owner context's last reference */
}

/* finalize(owner) while its connect is still retrying a refused address: the pending
 * connection keeps the context; when the retries run out, the failure frees both. */
static void lifetime_pending_connect_outlives_finalize(struct net* n, void* peer) {
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lcomm = NULL;
  net_listen(n, peer, handle, &lcomm);
  NCHECK(CALL(n, closeListen, lcomm)); /* nothing listens there any more: refused */
  void* owner = net_init(n, 0xA3, -1);
  void* scomm = NULL;
  NCHECK(net_connect_step(n, owner, handle, -1, &scomm));
  CHECK(scomm == NULL, "a connect to a closed port completed");
  net_finalize(n, owner);
  ncclResult_t res = ncclSuccess;
  double deadline = now_s() + TIMEOUT_S;
  while (res == ncclSuccess) {
    res = net_connect_step(n, owner, handle, -1, &scomm); /* NCCL's retry, same arguments */
    CHECK(scomm == NULL, "a connect to a closed port completed");
    CHECK(now_s() < deadline, "refused connect never gave up");
  }
  CHECK(res == ncclRemoteError, "refused connect returned %d", (int)res);
}

static int test_lifetime(int version) {
  if (version <= 10) {
    return 0; /* one process-wide context, no finalize */
  }
  setenv("FLOWSCHED_CONNECT_RETRIES", "3", 1); /* read by the first init below */
  setenv("FSTCP_CONNECT_RETRIES", "3", 1);   /* the same for the wrapped fstcp */
  struct net n;
  net_open(&n, version);
  void* peer = net_init(&n, 0xB0, -1);
  lifetime_listen_outlives_finalize(&n, peer);
  lifetime_comms_outlive_finalize(&n);
  lifetime_pending_connect_outlives_finalize(&n, peer);
  net_finalize(&n, peer);
  net_close(&n);
  unsetenv("FLOWSCHED_CONNECT_RETRIES");
  unsetenv("FSTCP_CONNECT_RETRIES");
  return 0;
}

/* ---- the permit: a close with a permitted send in flight gives it back ------------------ */

static void wait_request(struct net* n, void* req);
static void* post_recv(struct net* n, void* comm, void* buf, size_t size, void* mh);

/* Post a receive and one send on the pair; the send must be permitted within 2 s. */
static void gateleak_bulk_message(struct net* n, void* scomm, void* rcomm) {
  static char sbuf[65536], rbuf[65536];
  void* rreq = post_recv(n, rcomm, rbuf, sizeof(rbuf), NULL);
  void* sreq = NULL;
  long deferred = 0;
  double deadline = now_s() + 2;
  while (sreq == NULL && now_s() < deadline) {
    NCHECK(CALL(n, isend, scomm, sbuf, sizeof(sbuf), 0, NULL, NULL, &sreq));
    deferred += sreq == NULL;
  }
  CHECK(sreq != NULL, "bulk send deferred for 2 s (%ld tries): a closed connection's send "
        "still holds the device", deferred);
  wait_request(n, sreq);
  wait_request(n, rreq);
}

/* NCCL closes comms with requests in flight on ncclCommAbort and on error paths. Here a tp
 * (level 0) send is accepted and its connection closed before a test saw it complete; then a
 * bulk (level 7) send on the same device must start at once. Neither starvation guard is on,
 * so a leaked in-flight count would defer it for good. The class comes from FLOWSCHED_CLASS
 * (at init on v11/v12, at listen/connect on v8-v10). */
static int test_gateleak(int version) {
  setenv("FLOWSCHED_GATING", "1", 1); /* the TCP transport's permit is off by default */
  setenv("FLOWSCHED_GATE_MIN_SHARE", "0", 1);
  setenv("FLOWSCHED_GATE_MAX_DEFER_US", "0", 1);
  struct net n;
  net_open(&n, version);
  setenv("FLOWSCHED_CLASS", "tp", 1);
  void* hctx = net_init(&n, 0x71, -1);
  void *hs, *hr, *ls, *lr;
  connect_alternating(&n, hctx, &hs, &hr);
  setenv("FLOWSCHED_CLASS", "bulk", 1);
  void* lctx = n.version == 10 ? hctx : net_init(&n, 0x72, -1);
  connect_alternating(&n, lctx, &ls, &lr);
  unsetenv("FLOWSCHED_CLASS");
  static char tp_buf[4096];
  void* hreq = NULL;
  while (hreq == NULL) NCHECK(CALL(&n, isend, hs, tp_buf, sizeof(tp_buf), 0, NULL, NULL, &hreq));
  void* lreq = NULL;
  NCHECK(CALL(&n, isend, ls, tp_buf, sizeof(tp_buf), 0, NULL, NULL, &lreq));
  CHECK(lreq == NULL, "the permit did not defer bulk behind an untested tp send");
  NCHECK(CALL(&n, closeSend, hs)); /* the tp send was never tested to completion */
  NCHECK(CALL(&n, closeRecv, hr));
  if (n.version != 10) net_finalize(&n, hctx);
  gateleak_bulk_message(&n, ls, lr);
  NCHECK(CALL(&n, closeSend, ls));
  NCHECK(CALL(&n, closeRecv, lr));
  if (n.version != 10) net_finalize(&n, lctx);
  net_close(&n);
  unsetenv("FLOWSCHED_GATING");
  unsetenv("FLOWSCHED_GATE_MIN_SHARE");
  unsetenv("FLOWSCHED_GATE_MAX_DEFER_US");
  return 0;
}

/* ---- levels on the wire: after a level change the sockets carry its marking ------------- */

#define MARK_LEVELS 5
static const uint8_t k_mark_dscp[MARK_LEVELS] = {46, 34, 26, 18, 10};
static const int k_mark_prio[MARK_LEVELS] = {6, 4, 3, 2, 1};

/* A flow table as the agent writes it: every slot FREE, five levels with distinct markings. */
static struct fs_table_header* marking_table_create(const char* path, size_t* size) {
  const uint32_t nslots = 16;
  *size = FS_TABLE_HEADER_SIZE + (size_t)nslots * FS_TABLE_SLOT_SIZE;
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  CHECK(fd >= 0 && ftruncate(fd, (off_t)*size) == 0, "cannot create %s", path);
  struct fs_table_header* hdr = mmap(NULL, *size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  CHECK(hdr != MAP_FAILED, "mmap %s", path);
  hdr->magic = FS_TABLE_MAGIC;
  hdr->version = FS_TABLE_VERSION;
  hdr->header_size = FS_TABLE_HEADER_SIZE;
  hdr->slot_size = FS_TABLE_SLOT_SIZE;
  hdr->num_slots = nslots;
  hdr->num_levels = MARK_LEVELS;
  for (int i = 0; i < MARK_LEVELS; i++) {
    hdr->level_marking[i].dscp = k_mark_dscp[i];
    hdr->level_marking[i].so_priority = (uint32_t)k_mark_prio[i];
  }
  atomic_store(&hdr->config_seq, 2); /* one complete write */
  return hdr;
}

static struct fs_table_slot* marking_slot(struct fs_table_header* hdr, uint32_t i) {
  return (struct fs_table_slot*)((uint8_t*)hdr + FS_TABLE_HEADER_SIZE + (size_t)i * FS_TABLE_SLOT_SIZE);
}

/* Every connected TCP socket of this process must carry `level`'s DSCP and SO_PRIORITY, as
 * the kernel reports them (getsockopt), not as the plugin says it applied them. */
static int sockets_check_marking(int level) {
  int checked = 0;
  for (int fd = 3; fd < 4096; fd++) {
    int type = 0;
    socklen_t len = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) {
      continue;
    }
    struct sockaddr_storage peer;
    socklen_t plen = sizeof(peer);
    if (getpeername(fd, (struct sockaddr*)&peer, &plen) != 0) {
      continue; /* a listener, or not connected */
    }
    int tos = -1, prio = -1;
    len = sizeof(tos);
    if (peer.ss_family == AF_INET6) {
      CHECK(getsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, &len) == 0, "IPV6_TCLASS");
    } else {
      CHECK(getsockopt(fd, IPPROTO_IP, IP_TOS, &tos, &len) == 0, "IP_TOS");
    }
    len = sizeof(prio);
    CHECK(getsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, &len) == 0, "SO_PRIORITY");
    CHECK((tos >> 2) == k_mark_dscp[level] && prio == k_mark_prio[level],
          "socket %d at level %d carries DSCP %d, SO_PRIORITY %d (expected %d, %d)", fd, level,
          tos >> 2, prio, k_mark_dscp[level], k_mark_prio[level]);
    checked++;
  }
  return checked;
}

static int active_slots(struct fs_table_header* hdr) {
  int active = 0;
  for (uint32_t s = 0; s < hdr->num_slots; s++) {
    active += atomic_load(&marking_slot(hdr, s)->state) == FS_SLOT_ACTIVE;
  }
  return active;
}

/* An agent re-creates the table at the same path (to resize it): the connections made after
 * that take slots in the new table and follow its levels; the earlier pair (`first`) keeps its
 * slots in the old one until its next messages, which move it to the new one. */
static void marking_recreated_table(struct net* n, void* ctx, const char* path,
                                    struct fs_table_header* old, void* const first[2]) {
  CHECK(unlink(path) == 0, "unlink %s", path);
  size_t size = 0;
  struct fs_table_header* hdr = marking_table_create(path, &size);
  void *scomm, *rcomm;
  connect_alternating(n, ctx, &scomm, &rcomm);
  CHECK(active_slots(hdr) == 2, "%d active slots in the new table, expected the new pair's 2",
        active_slots(hdr));
  CHECK(active_slots(old) == 2, "the old table lost the first pair's slots");
  pump_pair(n, first[0], first[1], 20000, 401); /* the new pair's setup found the table */
  CHECK(active_slots(hdr) == 4 && active_slots(old) == 0,
        "the first pair did not move: %d active slots in the new table, %d in the old",
        active_slots(hdr), active_slots(old));
  for (uint32_t s = 0; s < hdr->num_slots; s++) {
    if (atomic_load(&marking_slot(hdr, s)->state) == FS_SLOT_ACTIVE) {
      atomic_store(&marking_slot(hdr, s)->level, 2u);
    }
  }
  pump_pair(n, scomm, rcomm, 50000, 400);
  pump_pair(n, first[0], first[1], 50000, 402);
  for (uint32_t s = 0; s < hdr->num_slots; s++) {
    struct fs_table_slot* slot = marking_slot(hdr, s);
    if (atomic_load(&slot->state) == FS_SLOT_ACTIVE) {
      CHECK(atomic_load(&slot->applied_level) == 2u, "new table's level not applied");
    }
  }
  int checked = sockets_check_marking(2);
  CHECK(checked >= 8, "only %d connected sockets found", checked);
  NCHECK(CALL(n, closeSend, scomm));
  NCHECK(CALL(n, closeRecv, rcomm));
  munmap(hdr, size);
}

/* A job that started before the agent: the pair, made with no table, moves into the table
 * once it appears (the plugin looks for it at most once a second, from completed messages). */
static void marking_table_appears(struct net* n, void* scomm, void* rcomm, const char* path,
                                  struct fs_table_header** hdr, size_t* size) {
  pump_pair(n, scomm, rcomm, 30000, 299); /* private slots */
  *hdr = marking_table_create(path, size);
  double deadline = now_s() + TIMEOUT_S;
  for (uint64_t i = 0; active_slots(*hdr) < 2; i++) {
    CHECK(now_s() < deadline, "the pair never moved into the table that appeared");
    pump_pair(n, scomm, rcomm, 1000, 500 + i);
  }
  for (uint32_t s = 0; s < (*hdr)->num_slots; s++) {
    struct fs_table_slot* slot = marking_slot(*hdr, s);
    if (atomic_load(&slot->state) == FS_SLOT_ACTIVE) {
      CHECK(slot->flags == FS_SLOT_FLAG_MOVED && atomic_load(&slot->bytes) >= 30000,
            "a moved slot has flags %u and %llu bytes", slot->flags,
            (unsigned long long)atomic_load(&slot->bytes));
    }
  }
}

static int test_marking(int version) {
  if (getenv("FLOWSCHED_NET_INNER") != NULL) {
    return 0; /* wrapping mode: the inner plugin owns the sockets */
  }
  char path[64];
  snprintf(path, sizeof(path), "/dev/shm/flowsched-harness-%d", (int)getpid());
  unlink(path);
  size_t size = 0;
  struct fs_table_header* hdr = NULL;
  const char* saved = getenv("FLOWSCHED_TABLE");
  char* saved_copy = saved != NULL ? strdup(saved) : NULL;
  setenv("FLOWSCHED_TABLE", path, 1); /* read by the first init below */
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 0x3A4B, -1);
  void *scomm, *rcomm;
  connect_alternating(&n, ctx, &scomm, &rcomm);
  marking_table_appears(&n, scomm, rcomm, path, &hdr, &size);
  static const int levels[] = {3, 0, 4, 1};
  for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++) {
    int active = 0;
    for (uint32_t s = 0; s < hdr->num_slots; s++) {
      struct fs_table_slot* slot = marking_slot(hdr, s);
      if (atomic_load(&slot->state) == FS_SLOT_ACTIVE) {
        atomic_store(&slot->level, (uint32_t)levels[i]);
        active++;
      }
    }
    CHECK(active == 2, "%d active slots, expected the pair's 2", active);
    pump_pair(&n, scomm, rcomm, 100000 + i, 300 + i); /* the next messages on both ends */
    for (uint32_t s = 0; s < hdr->num_slots; s++) {
      struct fs_table_slot* slot = marking_slot(hdr, s);
      if (atomic_load(&slot->state) == FS_SLOT_ACTIVE) {
        CHECK(atomic_load(&slot->applied_level) == (uint32_t)levels[i], "applied_level");
      }
    }
    int checked = sockets_check_marking(levels[i]);
    CHECK(checked >= 4, "only %d connected sockets found", checked);
  }
  marking_recreated_table(&n, ctx, path, hdr, (void* const[2]){scomm, rcomm});
  NCHECK(CALL(&n, closeSend, scomm));
  NCHECK(CALL(&n, closeRecv, rcomm));
  net_finalize(&n, ctx);
  net_close(&n);
  munmap(hdr, size);
  unlink(path);
  if (saved_copy != NULL) {
    setenv("FLOWSCHED_TABLE", saved_copy, 1);
    free(saved_copy);
  } else {
    unsetenv("FLOWSCHED_TABLE");
  }
  return 0;
}

/* ---- benchmarks (bench/plugin_bench.py runs these next to bench/plain_tcp.c) ------------ */

/* Post-and-wait one request on `comm`; spins on test() like NCCL's progress thread. */
static void wait_request(struct net* n, void* req) {
  int done = 0, size = 0;
  for (;;) {
    NCHECK(CALL(n, test, req, &done, &size));
    if (done) break;
    sched_yield(); /* NCCL's progress thread also yields when a pass made no progress */
  }
}

static void* post_send(struct net* n, void* comm, void* buf, size_t size, void* mh) {
  void* req = NULL;
  while (req == NULL) NCHECK(CALL(n, isend, comm, buf, size, 0, mh, NULL, &req));
  return req;
}

static void* post_recv(struct net* n, void* comm, void* buf, size_t size, void* mh) {
  void* req = NULL;
  void* data[1] = {buf};
  size_t sizes[1] = {size};
  int tags[1] = {0};
  void* mhs[1] = {mh};
  while (req == NULL) NCHECK(CALL(n, irecv, comm, 1, data, sizes, tags, mhs, NULL, &req));
  return req;
}

struct bw_buffers {
  int depth;
  uint8_t* bufs[STEPS];
  void* mh[STEPS];
};

/* Allocate, touch and register the buffers before the clock starts. */
static void bw_buffers_init(struct net* n, void* comm, size_t size, struct bw_buffers* b) {
  b->depth = size >= (16u << 20) ? 2 : STEPS; /* bound memory for huge messages */
  for (int i = 0; i < b->depth; i++) {
    b->bufs[i] = malloc(size ? size : 1);
    memset(b->bufs[i], 0x5a, size ? size : 1);
    NCHECK(CALL(n, regMr, comm, b->bufs[i], size ? size : 1, NCCL_PTR_HOST, &b->mh[i]));
  }
}

static void bw_buffers_free(struct net* n, void* comm, struct bw_buffers* b) {
  for (int i = 0; i < b->depth; i++) {
    NCHECK(CALL(n, deregMr, comm, b->mh[i]));
    free(b->bufs[i]);
  }
}

/* Stream `count` messages of `size` bytes with up to b->depth in flight. */
static void bw_stream(struct net* n, void* comm, int is_send, size_t size, long count,
                      struct bw_buffers* b) {
  void* reqs[STEPS];
  long posted = 0, done = 0;
  while (done < count) {
    while (posted < count && posted - done < b->depth) {
      int i = (int)(posted % b->depth);
      reqs[i] = is_send ? post_send(n, comm, b->bufs[i], size, b->mh[i])
                        : post_recv(n, comm, b->bufs[i], size, b->mh[i]);
      posted++;
    }
    int fin = 0, got = 0;
    NCHECK(CALL(n, test, reqs[done % b->depth], &fin, &got));
    done += fin;
    if (!fin) sched_yield();
  }
}

static int bench_bw(int version, size_t size, long count) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pid_t child = fork();
  CHECK(child >= 0, "fork");
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 9, -1);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  struct bw_buffers b;
  char ready;
  if (child == 0) { /* sender */
    read_all(sv[1], handle, sizeof(handle));
    void* scomm = net_connect(&n, ctx, handle, -1);
    bw_buffers_init(&n, scomm, size, &b);
    read_all(sv[1], &ready, 1); /* the receiver has its buffers too */
    double t0 = now_s();
    bw_stream(&n, scomm, 1, size, count, &b);
    write_all(sv[1], &t0, sizeof(t0));
    read_all(sv[1], &ready, 1);
    bw_buffers_free(&n, scomm, &b);
    NCHECK(CALL(&n, closeSend, scomm));
    net_finalize(&n, ctx);
    _exit(0);
  }
  void* lcomm = NULL;
  net_listen(&n, ctx, handle, &lcomm);
  write_all(sv[0], handle, sizeof(handle));
  void* rcomm = net_accept(&n, lcomm);
  bw_buffers_init(&n, rcomm, size, &b);
  write_all(sv[0], "r", 1);
  bw_stream(&n, rcomm, 0, size, count, &b);
  double t1 = now_s(), t0 = 0;
  read_all(sv[0], &t0, sizeof(t0));
  write_all(sv[0], "k", 1);
  waitpid(child, NULL, 0);
  bw_buffers_free(&n, rcomm, &b);
  NCHECK(CALL(&n, closeRecv, rcomm));
  net_finalize(&n, ctx);
  printf("{\"mode\": \"bw\", \"size\": %zu, \"count\": %ld, \"seconds\": %.6f, \"MBps\": %.1f}\n",
         size, count, t1 - t0, (double)size * (double)count / (t1 - t0) / 1e6);
  return 0;
}

/* ---- stalled peers: sockets that connect to a listener and never send a hello ---------- */

/* The descriptors below 1024 that are listening sockets; returns how many (at most cap). */
static int listening_fds(int* fds, int cap) {
  int count = 0;
  for (int fd = 0; fd < 1024 && count < cap; fd++) {
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening) {
      fds[count++] = fd;
    }
  }
  return count;
}

/* The listening socket net_listen just opened: the one not in before[0..nbefore). */
static int new_listening_fd(const int* before, int nbefore) {
  int now[64];
  int nnow = listening_fds(now, 64);
  for (int i = 0; i < nnow; i++) {
    int seen = 0;
    for (int j = 0; j < nbefore; j++) seen |= now[i] == before[j];
    if (!seen) return now[i];
  }
  return -1;
}

/* net_listen on ctx, then the listening socket it opened and its address (for raw peers). */
static int listen_located(struct net* n, void* ctx, char* handle, void** lcomm,
                          struct sockaddr_storage* ss, socklen_t* len) {
  int before[64];
  int nbefore = listening_fds(before, 64);
  net_listen(n, ctx, handle, lcomm);
  int lfd = new_listening_fd(before, nbefore);
  CHECK(lfd >= 0, "the listener's socket not found");
  CHECK(getsockname(lfd, (struct sockaddr*)ss, len) == 0, "getsockname");
  return lfd;
}

#define STALLED_PEERS 40 /* more than the listener's pending slots (2 x (16 + 1)) */

static int test_stale(int version) {
  setenv("FLOWSCHED_ACCEPT_TIMEOUT_MS", "300", 1); /* read by the init below */
  setenv("FSTCP_ACCEPT_TIMEOUT_MS", "300", 1);     /* the same for the wrapped fstcp */
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 0x5A, -1);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lcomm = NULL, *scomm = NULL, *rcomm = NULL;
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  listen_located(&n, ctx, handle, &lcomm, &ss, &len);
  int stalled[STALLED_PEERS];
  for (int i = 0; i < STALLED_PEERS; i++) {
    stalled[i] = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(stalled[i] >= 0 && connect(stalled[i], (struct sockaddr*)&ss, len) == 0, "connect");
  }
  /* accept takes the stalled sockets first (they queued first) and fills its slots with
   * them; without an age limit it would never accept the real connection's sockets */
  NCHECK(CALL(&n, accept, lcomm, &rcomm, NULL));
  CHECK(rcomm == NULL, "accepted a connection before anyone connected for real");
  double deadline = now_s() + TIMEOUT_S;
  while (scomm == NULL || rcomm == NULL) {
    if (scomm == NULL) NCHECK(net_connect_step(&n, ctx, handle, -1, &scomm));
    if (rcomm == NULL) NCHECK(CALL(&n, accept, lcomm, &rcomm, NULL));
    CHECK(now_s() < deadline, "stalled peers kept a real connection out for %d s", TIMEOUT_S);
  }
  pump_pair(&n, scomm, rcomm, 70000, 34);
  for (int i = 0; i < STALLED_PEERS; i++) close(stalled[i]);
  NCHECK(CALL(&n, closeSend, scomm));
  NCHECK(CALL(&n, closeRecv, rcomm));
  NCHECK(CALL(&n, closeListen, lcomm));
  net_finalize(&n, ctx);
  net_close(&n);
  unsetenv("FLOWSCHED_ACCEPT_TIMEOUT_MS");
  unsetenv("FSTCP_ACCEPT_TIMEOUT_MS");
  return 0;
}

/* ---- dead peers: half-built connections of peers that died after their first hellos ------- */

struct knob {
  const char* name;
  const char* value;
  char saved[64];
  int was_set;
};

/* Set the knobs (and their FSTCP_ twins, for the wrapped fstcp), remembering what was there. */
static void knobs_set(struct knob* knobs, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const char* old = getenv(knobs[i].name);
    knobs[i].was_set = old != NULL;
    snprintf(knobs[i].saved, sizeof(knobs[i].saved), "%s", old != NULL ? old : "");
    char twin[96];
    snprintf(twin, sizeof(twin), "FSTCP_%s", knobs[i].name + strlen("FLOWSCHED_"));
    setenv(knobs[i].name, knobs[i].value, 1);
    setenv(twin, knobs[i].value, 1);
  }
}

static void knobs_restore(const struct knob* knobs, size_t n) {
  for (size_t i = 0; i < n; i++) {
    char twin[96];
    snprintf(twin, sizeof(twin), "FSTCP_%s", knobs[i].name + strlen("FLOWSCHED_"));
    unsetenv(twin);
    if (knobs[i].was_set) {
      setenv(knobs[i].name, knobs[i].saved, 1);
    } else {
      unsetenv(knobs[i].name);
    }
  }
}

/* Connections waiting in the listening socket's accept queue (TCP_INFO of a listener). */
static unsigned accept_queue_length(int lfd) {
  struct tcp_info info;
  socklen_t len = sizeof(info);
  CHECK(getsockopt(lfd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0, "TCP_INFO");
  return info.tcpi_unacked;
}

/* Bytes written on `fd` that the peer's kernel has not acknowledged yet. */
static int unacked_bytes(int fd) {
  int n = 0;
  CHECK(ioctl(fd, SIOCOUTQ, &n) == 0, "SIOCOUTQ");
  return n;
}

#define DEAD_PEERS FS_MAX_ASSEMBLIES /* as many half-built connections as a listener keeps */

/* Peers that connected one socket each, sent a valid hello (their connection has one data
 * socket and the control socket) and then died: two closed their socket, two went silent.
 * They fill the listener's half-built connections; a real connection that comes next must
 * still be accepted (the age limit is an hour here, so only an eviction lets it in) and carry
 * data, and the evicted connection's socket is closed. */
static int test_dead_peers(int version) {
  struct knob knobs[] = {{.name = "FLOWSCHED_SOCKET_NTHREADS", .value = "1"},
                         {.name = "FLOWSCHED_NSOCKS_PERTHREAD", .value = "1"},
                         {.name = "FLOWSCHED_MIN_CHUNK_SIZE", .value = "65536"},
                         {.name = "FLOWSCHED_INLINE_SIZE", .value = "65536"},
                         {.name = "FLOWSCHED_ACCEPT_TIMEOUT_MS", .value = "3600000"}};
  size_t nknobs = sizeof(knobs) / sizeof(knobs[0]);
  knobs_set(knobs, nknobs); /* read by the init below */
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 0x5B, -1);
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lcomm = NULL, *scomm = NULL, *rcomm = NULL;
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  int lfd = listen_located(&n, ctx, handle, &lcomm, &ss, &len);
  int peers[DEAD_PEERS];
  for (int i = 0; i < DEAD_PEERS; i++) {
    peers[i] = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(peers[i] >= 0 && connect(peers[i], (struct sockaddr*)&ss, len) == 0, "connect");
    struct fs_hello hello = {.magic = FS_HELLO_MAGIC, .index = 0, .nsocks = 1, .chunk = 65536,
                             .inline_max = 65536, .traffic_class = -1,
                             .nonce = 0xDEAD0000u + (uint64_t)i, .comm_id = 0x5B};
    write_all(peers[i], &hello, sizeof(hello));
  }
  double deadline = now_s() + TIMEOUT_S;
  int queued = 0;
  while (!queued) { /* every dead peer's socket and hello is in the listener's kernel */
    queued = accept_queue_length(lfd) == DEAD_PEERS;
    for (int i = 0; i < DEAD_PEERS; i++) queued = queued && unacked_bytes(peers[i]) == 0;
    CHECK(now_s() < deadline, "the dead peers' hellos never reached the listener");
    sched_yield();
  }
  for (int i = DEAD_PEERS / 2; i < DEAD_PEERS; i++) {
    close(peers[i]);
    peers[i] = -1;
  }
  NCHECK(CALL(&n, accept, lcomm, &rcomm, NULL)); /* takes them all: 4 half-built connections */
  CHECK(rcomm == NULL, "accepted a connection nobody completed");
  deadline = now_s() + TIMEOUT_S;
  while (scomm == NULL || rcomm == NULL) {
    if (scomm == NULL) NCHECK(net_connect_step(&n, ctx, handle, -1, &scomm));
    if (rcomm == NULL) NCHECK(CALL(&n, accept, lcomm, &rcomm, NULL));
    CHECK(now_s() < deadline, "half-built connections of dead peers kept a real one out");
  }
  pump_pair(&n, scomm, rcomm, 70000, 35);
  int evicted = 0;
  while (!evicted) { /* a silent peer's half-built connection made room: its socket is closed */
    for (int i = 0; i < DEAD_PEERS / 2; i++) {
      char byte;
      ssize_t got = recv(peers[i], &byte, 1, MSG_DONTWAIT);
      evicted |= got == 0 || (got < 0 && errno == ECONNRESET);
    }
    CHECK(now_s() < deadline, "no half-built connection was evicted");
    sched_yield();
  }
  for (int i = 0; i < DEAD_PEERS / 2; i++) close(peers[i]);
  NCHECK(CALL(&n, closeSend, scomm));
  NCHECK(CALL(&n, closeRecv, rcomm));
  NCHECK(CALL(&n, closeListen, lcomm));
  net_finalize(&n, ctx);
  net_close(&n);
  knobs_restore(knobs, nknobs);
  return 0;
}

/* ---- a send connection closed with the receiver's rank note unread -------------------- */

struct closenote_recv {
  struct net* n;
  void* comm;
  void* req; /* the first receive, posted already */
  int sender_ctrl; /* the sender's control socket, its rank note unread */
  uint8_t* buf;
  size_t cap;
  int done, size;
  ncclResult_t res;
};

/* The receiver's progress thread: finish the first receive, then post and finish the second
 * (until done or an error). */
static void* closenote_receiver(void* arg) {
  struct closenote_recv* r = arg;
  double deadline = now_s() + TIMEOUT_S;
  /* Read nothing until the sender's close began: it read the note, or closed the socket (then
   * the fd is gone; nothing opens one meanwhile). Else the receiver could take the whole
   * message before the close and the test would prove nothing. */
  int unread = 8;
  while (unread > 0 && ioctl(r->sender_ctrl, FIONREAD, &unread) == 0 && now_s() < deadline) {
    sched_yield();
  }
  for (int i = 0; i < 2 && r->res == ncclSuccess; i++) {
    if (i == 1) {
      r->req = NULL;
      void* data[1] = {r->buf};
      size_t sizes[1] = {r->cap};
      int tags[1] = {3};
      while (r->req == NULL && r->res == ncclSuccess) {
        r->res = CALL(r->n, irecv, r->comm, 1, data, sizes, tags, NULL, NULL, &r->req);
      }
    }
    r->done = 0;
    while (!r->done && r->res == ncclSuccess && now_s() < deadline) {
      r->res = CALL(r->n, test, r->req, &r->done, &r->size);
      sched_yield();
    }
  }
  return NULL;
}

/* A send completes once its bytes are in the kernel's send queue. Here the sender's two sends
 * (1 byte, then 1 MiB, all of it on the control socket) complete while most of the second is
 * still queued, the receiver having read nothing; then the receiver posts its first receive,
 * which writes its rank note (v11+: the context's rank is the tag of a send on it) and reads
 * no further than its control buffer, and the sender closes with that note unread while the
 * receiver waits on its own thread, to read once the close began. Linux answers a close() with unread bytes with RST and
 * drops the send queue: the receiver must still get every byte. The transport only (the note
 * is its wire); skipped where net.core.wmem_max keeps the message out of the send buffer. */
static int test_closenote(int version) {
  if (version <= 10 || getenv("FLOWSCHED_NET_INNER") != NULL ||
      strcmp(plugin_name(), "flowsched") != 0) {
    return 0; /* v10 sends no note; through the wrapper the comms are not the transport's */
  }
  struct knob knobs[] = {{.name = "FLOWSCHED_INLINE_SIZE", .value = "1048576"}};
  size_t nknobs = sizeof(knobs) / sizeof(knobs[0]);
  knobs_set(knobs, nknobs); /* whole messages on the control socket */
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 0xC105E, -1);
  void *scomm, *rcomm;
  connect_alternating(&n, ctx, &scomm, &rcomm);
  struct fs_comm* sc = scomm;
  int ctrl = sc->fds[sc->nsocks];
  int sndbuf = 4 << 20;
  socklen_t len = sizeof(sndbuf);
  CHECK(setsockopt(ctrl, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)) == 0 &&
            getsockopt(ctrl, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) == 0, "SO_SNDBUF");
  size_t size = 1 << 20;
  int ok = (size_t)sndbuf >= 2 * size;
  if (!ok) {
    printf("skip closenote: SO_SNDBUF is capped at %d bytes (net.core.wmem_max)\n", sndbuf);
  }
  uint8_t* sbuf = malloc(size);
  uint8_t* rbuf = malloc(size + SLACK);
  CHECK(sbuf && rbuf, "malloc");
  pattern_fill(sbuf, size, 0xC1);
  void* sreq[2] = {NULL, NULL};
  size_t ssize[2] = {1, size};
  double deadline = now_s() + TIMEOUT_S;
  for (int i = 0; i < 2 && ok; i++) {
    while (sreq[i] == NULL) NCHECK(CALL(&n, isend, scomm, sbuf, ssize[i], 3, NULL, NULL, &sreq[i]));
  }
  for (int i = 0; i < 2 && ok; i++) {
    int sdone = 0, sz = 0;
    while (!sdone) {
      NCHECK(CALL(&n, test, sreq[i], &sdone, &sz));
      CHECK(now_s() < deadline, "setup: the send did not fit in the socket buffers");
    }
  }
  struct closenote_recv r = {
      .n = &n, .comm = rcomm, .sender_ctrl = ctrl, .buf = rbuf, .cap = size + SLACK};
  if (ok) {
    r.req = post_recv(&n, rcomm, rbuf, size + SLACK, NULL);
  }
  int pending = 0;
  while (ok && pending < 8) { /* the note is in the sender's receive queue, unread */
    CHECK(ioctl(ctrl, FIONREAD, &pending) == 0, "FIONREAD");
    CHECK(now_s() < deadline, "setup: the receiver's rank note never reached the sender");
    sched_yield();
  }
  if (ok) {
    CHECK(unacked_bytes(ctrl) > (int)size / 2, "setup: the receiver's kernel took the message");
    pthread_t th;
    CHECK(pthread_create(&th, NULL, closenote_receiver, &r) == 0, "pthread_create");
    NCHECK(CALL(&n, closeSend, scomm));
    pthread_join(th, NULL);
    CHECK(r.res == ncclSuccess && r.done, "the receive failed (ncclResult %d, done %d) after "
          "the sender closed with the rank note unread", (int)r.res, r.done);
    CHECK((size_t)r.size == size, "received %d bytes of %zu", r.size, size);
    pattern_check(rbuf, size, 0xC1);
  } else {
    NCHECK(CALL(&n, closeSend, scomm));
  }
  NCHECK(CALL(&n, closeRecv, rcomm));
  net_finalize(&n, ctx);
  net_close(&n);
  free(sbuf);
  free(rbuf);
  knobs_restore(knobs, nknobs);
  return 0;
}

/* ---- exit() with connections alive -------------------------------------------------------- */

/* Message pairs the exitlive child's spinner completed. */
static _Atomic long g_exit_spins;

struct exitlive {
  struct net* n;
  void *scomm, *rcomm;
};

/* NCCL's proxy thread: one small message after another, through exit() and beyond. */
static void* exitlive_spin(void* arg) {
  struct exitlive* e = arg;
  static char sbuf[64], rbuf[64 + SLACK];
  for (;;) {
    void* rreq = post_recv(e->n, e->rcomm, rbuf, sizeof(rbuf), NULL);
    wait_request(e->n, post_send(e->n, e->scomm, sbuf, sizeof(sbuf), NULL));
    wait_request(e->n, rreq);
    atomic_fetch_add(&g_exit_spins, 1);
  }
  return NULL;
}

/* What exit() does to the plugin, run here so that the test can go on after it: the library's
 * destructors (its DT_FINI_ARRAY, last entry first; ld.so leaves that entry unrelocated). The
 * executable's own destructors would run before a dlopen'ed library's, too early to look. */
static void run_plugin_destructors(void* lib) {
  struct link_map* lm = NULL;
  CHECK(dlinfo(lib, RTLD_DI_LINKMAP, &lm) == 0 && lm != NULL, "dlinfo: %s", dlerror());
  ElfW(Addr) array = 0;
  size_t bytes = 0;
  for (const ElfW(Dyn)* d = lm->l_ld; d->d_tag != DT_NULL; d++) {
    if (d->d_tag == DT_FINI_ARRAY) array = d->d_un.d_ptr;
    if (d->d_tag == DT_FINI_ARRAYSZ) bytes = d->d_un.d_val;
  }
  CHECK(array != 0 && bytes > 0, "the plugin has no destructors");
  void (**fini)(void) = (void (**)(void))(lm->l_addr + array);
  for (size_t i = bytes / sizeof(*fini); i-- > 0;) {
    fini[i]();
  }
}

/* A process may exit() while its communicators are alive and NCCL's proxy thread is still
 * inside isend/test: the plugin's library destructors run then too, and must not pull the
 * table mapping (or the inner plugin) out from under that thread. A child connects a pair with
 * a flow table mapped, keeps a thread sending on it, runs the plugin's destructors as exit()
 * would and waits for 1000 more messages; it must end with status 0, not a SIGSEGV. */
static int test_exit_live(int version) {
  char path[64];
  snprintf(path, sizeof(path), "/dev/shm/flowsched-harness-exit-%d", (int)getpid());
  unlink(path);
  size_t size = 0;
  struct fs_table_header* hdr = marking_table_create(path, &size);
  fflush(NULL);
  pid_t child = fork();
  CHECK(child >= 0, "fork");
  if (child == 0) {
    setenv("FLOWSCHED_TABLE", path, 1); /* read by the init below */
    static struct net n;
    net_open(&n, version);
    void* ctx = net_init(&n, 0xE817, -1);
    static struct exitlive e;
    e.n = &n;
    connect_alternating(&n, ctx, &e.scomm, &e.rcomm);
    atomic_store(&g_exit_spins, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, exitlive_spin, &e) == 0, "pthread_create");
    double deadline = now_s() + TIMEOUT_S;
    while (atomic_load(&g_exit_spins) < 10) {
      CHECK(now_s() < deadline, "the spinner sent nothing");
      sched_yield();
    }
    /* exit() with the connections open and the spinner running: the destructors, then the
     * spinner must go on through the plugin (table mapped, connections intact) */
    run_plugin_destructors(n.lib);
    long from = atomic_load(&g_exit_spins);
    deadline = now_s() + TIMEOUT_S;
    while (atomic_load(&g_exit_spins) < from + 1000) {
      CHECK(now_s() < deadline, "the spinner stopped after the plugin's destructors");
      sched_yield();
    }
    _exit(0); /* the rest of exit() has nothing left to show */
  }
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child, "waitpid");
  munmap(hdr, size);
  unlink(path);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
        "exit with live connections: %s %d", WIFSIGNALED(status) ? "signal" : "status",
        WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
  return 0;
}

static int bench_rtt(int version, long count) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pid_t child = fork();
  CHECK(child >= 0, "fork");
  int me = child == 0 ? sv[1] : sv[0];
  struct net n;
  net_open(&n, version);
  void* ctx = net_init(&n, 10, -1);
  char mine[NCCL_NET_HANDLE_MAXSIZE], peer[NCCL_NET_HANDLE_MAXSIZE];
  void *lcomm = NULL, *scomm = NULL, *rcomm = NULL;
  net_listen(&n, ctx, mine, &lcomm);
  write_all(me, mine, sizeof(mine));
  read_all(me, peer, sizeof(peer));
  ncclNetDeviceHandle_t* dh = NULL;
  while (scomm == NULL || rcomm == NULL) {
    if (scomm == NULL) NCHECK(net_connect_step(&n, ctx, peer, -1, &scomm));
    if (rcomm == NULL) NCHECK(CALL(&n, accept, lcomm, &rcomm, &dh));
  }
  NCHECK(CALL(&n, closeListen, lcomm));
  uint64_t sbuf = 0, rbuf = 0;
  void *smh, *rmh;
  NCHECK(CALL(&n, regMr, scomm, &sbuf, 8, NCCL_PTR_HOST, &smh));
  NCHECK(CALL(&n, regMr, rcomm, &rbuf, 8, NCCL_PTR_HOST, &rmh));
  long warmup = count / 10;
  double t0 = 0;
  for (long i = 0; i < count + warmup; i++) {
    if (i == warmup) t0 = now_s();
    if (child != 0) { /* ping */
      void* r = post_recv(&n, rcomm, &rbuf, 8, rmh);
      wait_request(&n, post_send(&n, scomm, &sbuf, 8, smh));
      wait_request(&n, r);
    } else { /* pong */
      wait_request(&n, post_recv(&n, rcomm, &rbuf, 8, rmh));
      wait_request(&n, post_send(&n, scomm, &sbuf, 8, smh));
    }
  }
  double dt = now_s() - t0;
  NCHECK(CALL(&n, closeSend, scomm));
  NCHECK(CALL(&n, closeRecv, rcomm));
  net_finalize(&n, ctx);
  if (child == 0) _exit(0);
  waitpid(child, NULL, 0);
  printf("{\"mode\": \"rtt\", \"count\": %ld, \"rtt_us\": %.3f}\n", count, dt / (double)count * 1e6);
  return 0;
}

/* ---- driver ----------------------------------------------------------------------------- */

static int run_one(const char* name, int version) {
  double t0 = now_s();
  int rc;
  if (strcmp(name, "transfer") == 0) {
    rc = two_processes(version, 1);
  } else if (strcmp(name, "contexts") == 0) {
    rc = two_processes(version, version <= 10 ? 1 : 2);
  } else if (strcmp(name, "alternate") == 0) {
    rc = test_alternate(version);
  } else if (strcmp(name, "cycles") == 0) {
    rc = test_cycles(version);
  } else if (strcmp(name, "errors") == 0) {
    rc = test_errors(version);
  } else if (strcmp(name, "marking") == 0) {
    rc = test_marking(version);
  } else if (strcmp(name, "lifetime") == 0) {
    rc = test_lifetime(version);
  } else if (strcmp(name, "gateleak") == 0) {
    rc = test_gateleak(version);
  } else if (strcmp(name, "stale") == 0) {
    rc = test_stale(version);
  } else if (strcmp(name, "deadpeers") == 0) {
    rc = test_dead_peers(version);
  } else if (strcmp(name, "closenote") == 0) {
    rc = test_closenote(version);
  } else if (strcmp(name, "exitlive") == 0) {
    rc = test_exit_live(version);
  } else {
    fprintf(stderr, "unknown test %s\n", name);
    return 2;
  }
  printf("ok %-9s v%d  (%.2f s)\n", name, version, now_s() - t0);
  fflush(stdout);
  return rc;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr,
            "usage: %s PLUGIN.so "
            "all|transfer|alternate|contexts|cycles|errors|lifetime|gateleak|marking|stale|deadpeers|"
            "closenote|exitlive "
            "[VERSION]\n",
            argv[0]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  g_plugin_path = argv[1];
  if (strcmp(argv[2], "bw") == 0 && argc >= 5) {
    return bench_bw(argc > 5 ? atoi(argv[5]) : 11, strtoull(argv[3], NULL, 0), atol(argv[4]));
  }
  if (strcmp(argv[2], "rtt") == 0 && argc >= 4) {
    return bench_rtt(argc > 4 ? atoi(argv[4]) : 11, atol(argv[3]));
  }
  if (strcmp(argv[2], "all") != 0) {
    return run_one(argv[2], argc > 3 ? atoi(argv[3]) : 11);
  }
  static const char* const tests[] = {"transfer", "alternate", "contexts", "cycles", "errors",
                                      "lifetime", "gateleak", "marking", "stale", "deadpeers",
                                      "closenote", "exitlive"};
  for (int version = 8; version <= 12; version++) {
    for (size_t t = 0; t < sizeof(tests) / sizeof(tests[0]); t++) {
      if (run_one(tests[t], version) != 0) {
        return 1;
      }
    }
  }
  return 0;
}
