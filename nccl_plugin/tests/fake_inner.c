/* SPDX-License-Identifier: Apache-2.0
 * A recording fake NCCL net plugin: the inner plugin of the wrapper tests. It moves no data;
 * it records every call with every argument (fake_inner.h), returns distinctive properties
 * and handles, and fails on request, so test_wrap_fake.c can prove what the wrapper forwards.
 * Built for table version FAKE_VERSION (12 by default; 10 and 8 exercise the adapters). */
#include "fake_inner.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nccl/net_v10.h"
#include "nccl/net_v12.h"
#include "nccl/net_v8.h"

#ifndef FAKE_VERSION
#define FAKE_VERSION 12
#endif

__attribute__((visibility("default"))) struct fake_state fake_state = {.version = FAKE_VERSION,
                                                                       .complete_sends = 1};

struct fake_req {
  int is_send;
  int n;
  size_t sizes[FAKE_MAX_N];
};

/* NCCL calls a plugin from several threads (each communicator's init on its own): the slot
 * is taken under a lock, and each caller then fills in its own. */
static struct fake_call* rec(const char* fn) {
  static struct fake_call overflow;
  static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&lock);
  struct fake_call* c = fake_state.ncalls < FAKE_MAX_CALLS ? &fake_state.calls[fake_state.ncalls++]
                                                           : &overflow;
  memset(c, 0, sizeof(*c));
  strncpy(c->fn, fn, sizeof(c->fn) - 1);
  c->tc = -2;
  pthread_mutex_unlock(&lock);
  return c;
}

static int token_listen, token_send, token_recv;

/* An init that is slow to finish: wait while the test holds block_init. */
static void init_wait_if_blocked(void) {
  if (!atomic_load(&fake_state.block_init)) {
    return;
  }
  atomic_store(&fake_state.init_blocked, 1);
  while (atomic_load(&fake_state.block_init)) {
    nanosleep(&(struct timespec){.tv_nsec = 100000}, NULL);
  }
  atomic_store(&fake_state.init_blocked, 0);
}

/* Every init keeps the logger it was given and logs through it at once, as IBext's v11 init
 * does (IBext calls it unchecked: a NULL logger would crash it; the fake records it instead). */
static ncclResult_t f_init12(void** ctx, uint64_t comm_id, ncclNetCommConfig_v12_t* config,
                             ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  struct fake_call* c = rec("init");
  c->logger = l;
  c->prof = p;
  if (l != NULL) {
    l(NCCL_LOG_INFO, NCCL_INIT, __FILE__, __LINE__, "fake inner init %d", fake_state.ncalls);
  }
  c->comm_id = comm_id;
  c->tc = config != NULL ? config->trafficClass : -3;
  init_wait_if_blocked();
  *ctx = fake_state.fail_init ? NULL : malloc(16);
  c->ctx = *ctx;
  return (ncclResult_t)fake_state.fail_init;
}

static ncclResult_t f_init10(ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  void* ctx = NULL;
  ncclResult_t res = f_init12(&ctx, 0, NULL, l, p);
  free(ctx);
  return res;
}

static ncclResult_t f_init8(ncclDebugLogger_t l) {
  return f_init10(l, NULL);
}

static ncclResult_t f_finalize(void* ctx) {
  rec("finalize")->ctx = ctx;
  free(ctx);
  return ncclSuccess;
}

static ncclResult_t f_devices(int* ndev) {
  rec("devices");
  *ndev = 2;
  return ncclSuccess;
}

static char fake_names[2][8] = {"fake0", "fake1"};
static char fake_pci[] = "/sys/devices/fake";

static void props_fill(int dev, ncclNetProperties_v12_t* p) {
  memset(p, 0, sizeof(*p));
  p->name = fake_names[dev & 1];
  p->pciPath = fake_pci;
  p->guid = 0x1234500 + (uint64_t)dev;
  p->ptrSupport = NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF;
  p->regIsGlobal = 1;
  p->forceFlush = 1;
  p->speed = 400000;
  p->port = 3;
  p->latency = 1.5f;
  p->maxComms = 777;
  p->maxRecvs = 8;
  p->netDeviceType = NCCL_NET_DEVICE_HOST;
  p->netDeviceVersion = 0;
  p->vProps.ndevs = 1;
  p->vProps.devs[0] = dev;
  p->maxP2pBytes = 1ULL << 33;
  p->maxCollBytes = 1ULL << 29;
  p->maxMultiRequestSize = 4;
  p->railId = 2;
  p->planeId = 1;
}

static ncclResult_t f_props12(int dev, ncclNetProperties_v12_t* props) {
  rec("getProperties")->dev = dev;
  props_fill(dev, props);
  return ncclSuccess;
}

static ncclResult_t f_props10(int dev, ncclNetProperties_v10_t* props) {
  ncclNetProperties_v12_t p;
  f_props12(dev, &p);
  memcpy(props, &p, sizeof(*props)); /* v10 is v12's prefix up to vProps.devs[4] */
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = dev;
  props->maxP2pBytes = p.maxP2pBytes;
  props->maxCollBytes = p.maxCollBytes;
  return ncclSuccess;
}

static ncclResult_t f_props8(int dev, ncclNetProperties_v8_t* props) {
  ncclNetProperties_v12_t p;
  f_props12(dev, &p);
  *props = (ncclNetProperties_v8_t){.name = p.name, .pciPath = p.pciPath, .guid = p.guid,
                                    .ptrSupport = p.ptrSupport, .regIsGlobal = p.regIsGlobal,
                                    .speed = p.speed, .port = p.port, .latency = p.latency,
                                    .maxComms = p.maxComms, .maxRecvs = p.maxRecvs,
                                    .netDeviceType = p.netDeviceType, .netDeviceVersion = 0};
  return ncclSuccess;
}

static ncclResult_t f_listen12(void* ctx, int dev, void* handle, void** lcomm) {
  struct fake_call* c = rec("listen");
  c->ctx = ctx;
  c->dev = dev;
  c->handle = handle;
  memset(handle, 0x5a, 64);
  *lcomm = &token_listen;
  c->comm = *lcomm;
  return ncclSuccess;
}

static ncclResult_t f_listen8(int dev, void* handle, void** lcomm) {
  return f_listen12(NULL, dev, handle, lcomm);
}

static int connect_calls;

static ncclResult_t f_connect_common(struct fake_call* c, int dev, void* handle, void** scomm,
                                     ncclNetDeviceHandle_t** dh) {
  c->dev = dev;
  c->handle = handle;
  c->devcomm = dh;
  *scomm = NULL;
  if (fake_state.fail_connect) {
    return (ncclResult_t)fake_state.fail_connect;
  }
  if (connect_calls++ < fake_state.connect_nulls) {
    return ncclSuccess;
  }
  connect_calls = 0;
  *scomm = &token_send;
  c->comm = *scomm;
  return ncclSuccess;
}

static ncclResult_t f_connect12(void* ctx, int dev, void* handle, void** scomm,
                                ncclNetDeviceHandle_t** dh) {
  struct fake_call* c = rec("connect");
  c->ctx = ctx;
  return f_connect_common(c, dev, handle, scomm, dh);
}

static ncclResult_t f_connect10(int dev, ncclNetCommConfig_v10_t* config, void* handle,
                                void** scomm, ncclNetDeviceHandle_t** dh) {
  struct fake_call* c = rec("connect");
  c->tc = config != NULL ? config->trafficClass : -3;
  return f_connect_common(c, dev, handle, scomm, dh);
}

static ncclResult_t f_connect8(int dev, void* handle, void** scomm, ncclNetDeviceHandle_t** dh) {
  return f_connect_common(rec("connect"), dev, handle, scomm, dh);
}

static ncclResult_t f_accept(void* lcomm, void** rcomm, ncclNetDeviceHandle_t** dh) {
  struct fake_call* c = rec("accept");
  c->comm = lcomm;
  c->devcomm = dh;
  *rcomm = &token_recv;
  return ncclSuccess;
}

static uintptr_t next_mh = 0xA000;

static ncclResult_t f_reg_mr(void* comm, void* data, size_t size, int type, void** mh) {
  struct fake_call* c = rec("regMr");
  c->comm = comm;
  c->data = data;
  c->size = size;
  c->type = type;
  *mh = (void*)(next_mh += 0x10);
  c->mhandle = *mh;
  return ncclSuccess;
}

static ncclResult_t f_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset,
                                    int fd, void** mh) {
  struct fake_call* c = rec("regMrDmaBuf");
  c->comm = comm;
  c->data = data;
  c->size = size;
  c->type = type;
  c->offset = offset;
  c->fd = fd;
  *mh = (void*)(next_mh += 0x10);
  c->mhandle = *mh;
  return ncclSuccess;
}

static ncclResult_t f_dereg_mr(void* comm, void* mh) {
  struct fake_call* c = rec("deregMr");
  c->comm = comm;
  c->mhandle = mh;
  return ncclSuccess;
}

static ncclResult_t f_isend12(void* scomm, void* data, size_t size, int tag, void* mh, void* ph,
                              void** req) {
  struct fake_call* c = rec("isend");
  c->comm = scomm;
  c->data = data;
  c->size = size;
  c->tag = tag;
  c->mhandle = mh;
  c->phandle = ph;
  if (fake_state.defer_isends > 0) {
    fake_state.defer_isends--;
    *req = NULL;
    return ncclSuccess;
  }
  struct fake_req* r = calloc(1, sizeof(*r));
  r->is_send = 1;
  r->n = 1;
  r->sizes[0] = size;
  *req = r;
  c->request = r;
  return ncclSuccess;
}

static ncclResult_t f_isend8(void* scomm, void* data, int size, int tag, void* mh, void** req) {
  return f_isend12(scomm, data, (size_t)size, tag, mh, NULL, req);
}

static ncclResult_t f_irecv12(void* rcomm, int n, void** data, size_t* sizes, int* tags, void** mhs,
                              void** phs, void** req) {
  struct fake_call* c = rec("irecv");
  c->comm = rcomm;
  c->n = n;
  c->request_in = *req;
  struct fake_req* r = calloc(1, sizeof(*r));
  r->n = n;
  for (int i = 0; i < n && i < FAKE_MAX_N; i++) {
    c->datas[i] = data[i];
    c->sizes[i] = sizes[i];
    c->tags[i] = tags[i];
    c->mhandles[i] = mhs[i];
    c->phandles[i] = phs != NULL ? phs[i] : NULL;
    r->sizes[i] = sizes[i] / 2; /* "received" half of each buffer */
  }
  *req = r;
  c->request = r;
  return ncclSuccess;
}

static ncclResult_t f_irecv8(void* rcomm, int n, void** data, int* sizes, int* tags, void** mhs,
                             void** req) {
  size_t wide[FAKE_MAX_N];
  for (int i = 0; i < n && i < FAKE_MAX_N; i++) wide[i] = (size_t)sizes[i];
  ncclResult_t res = f_irecv12(rcomm, n, data, wide, tags, mhs, NULL, req);
  struct fake_call* c = &fake_state.calls[fake_state.ncalls - 1];
  for (int i = 0; i < n && i < FAKE_MAX_N; i++) c->isizes[i] = sizes[i];
  return res;
}

static int flushes;

static ncclResult_t f_iflush(void* rcomm, int n, void** data, int* sizes, void** mhs, void** req) {
  struct fake_call* c = rec("iflush");
  c->comm = rcomm;
  c->n = n;
  for (int i = 0; i < n && i < FAKE_MAX_N; i++) {
    c->datas[i] = data[i];
    c->isizes[i] = sizes[i];
    c->mhandles[i] = mhs[i];
  }
  /* every other flush has nothing to wait for (NULL request: "done") */
  *req = (flushes++ & 1) ? NULL : calloc(1, sizeof(struct fake_req));
  c->request = *req;
  return ncclSuccess;
}

static ncclResult_t f_test(void* req, int* done, int* sizes) {
  struct fake_call* c = rec("test");
  c->request = req;
  struct fake_req* r = req;
  if (r->is_send && !fake_state.complete_sends) {
    *done = 0;
    return ncclSuccess;
  }
  *done = 1;
  for (int i = 0; sizes != NULL && i < r->n; i++) {
    sizes[i] = (int)r->sizes[i];
  }
  free(r);
  return ncclSuccess;
}

static ncclResult_t f_close(void* comm) {
  rec("close")->comm = comm;
  return ncclSuccess;
}

static ncclResult_t f_close_listen(void* comm) {
  rec("closeListen")->comm = comm;
  return ncclSuccess;
}

static ncclResult_t f_get_device_mr(void* comm, void* mh, void** dptr) {
  struct fake_call* c = rec("getDeviceMr");
  c->comm = comm;
  c->mhandle = mh;
  *dptr = (void*)0xD0D0;
  return ncclSuccess;
}

static ncclResult_t f_irecv_consumed(void* rcomm, int n, void* req) {
  struct fake_call* c = rec("irecvConsumed");
  c->comm = rcomm;
  c->n = n;
  c->request = req;
  return ncclSuccess;
}

static ncclResult_t f_make_vdevice12(int* d, ncclNetVDeviceProps_v12_t* props) {
  struct fake_call* c = rec("makeVDevice");
  c->vdevs = props->ndevs;
  for (int i = 0; i < props->ndevs && i < FAKE_MAX_N; i++) c->tags[i] = props->devs[i];
  *d = 2;
  return ncclSuccess;
}

static ncclResult_t f_make_vdevice10(int* d, ncclNetVDeviceProps_v10_t* props) {
  ncclNetVDeviceProps_v12_t p = {.ndevs = props->ndevs};
  for (int i = 0; i < props->ndevs && i < 4; i++) p.devs[i] = props->devs[i];
  return f_make_vdevice12(d, &p);
}

static ncclResult_t f_set_net_attr(void* ctx, ncclNetAttr_v12_t* attr) {
  struct fake_call* c = rec("setNetAttr");
  c->ctx = ctx;
  c->op = attr->op;
  c->algo = attr->algo;
  c->proto = attr->proto;
  return ncclSuccess;
}

#define EXPORT __attribute__((visibility("default")))

/* A companion table NCCL would look for in the net plugin's library: the wrapper must say that
 * NCCL cannot see it through flowsched (only its name matters here). */
EXPORT const char ncclTunerPlugin_v3[] = "fake tuner";

#if FAKE_VERSION == 12
EXPORT const ncclNet_v12_t ncclNetPlugin_v12 = {
    .name = "Fake", .init = f_init12, .devices = f_devices, .getProperties = f_props12,
    .listen = f_listen12, .connect = f_connect12, .accept = f_accept, .regMr = f_reg_mr,
    .regMrDmaBuf = f_reg_mr_dmabuf, .deregMr = f_dereg_mr, .isend = f_isend12,
    .irecv = f_irecv12, .iflush = f_iflush, .test = f_test, .closeSend = f_close,
    .closeRecv = f_close, .closeListen = f_close_listen, .getDeviceMr = f_get_device_mr,
    .irecvConsumed = f_irecv_consumed, .makeVDevice = f_make_vdevice12,
    .finalize = f_finalize, .setNetAttr = f_set_net_attr};
#elif FAKE_VERSION == 10
EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    .name = "Fake", .init = f_init10, .devices = f_devices, .getProperties = f_props10,
    .listen = f_listen8, .connect = f_connect10, .accept = f_accept, .regMr = f_reg_mr,
    .regMrDmaBuf = f_reg_mr_dmabuf, .deregMr = f_dereg_mr, .isend = f_isend12,
    .irecv = f_irecv12, .iflush = f_iflush, .test = f_test, .closeSend = f_close,
    .closeRecv = f_close, .closeListen = f_close_listen, .getDeviceMr = f_get_device_mr,
    .irecvConsumed = f_irecv_consumed, .makeVDevice = f_make_vdevice10};
#else
EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = "Fake", .init = f_init8, .devices = f_devices, .getProperties = f_props8,
    .listen = f_listen8, .connect = f_connect8, .accept = f_accept, .regMr = f_reg_mr,
    .regMrDmaBuf = f_reg_mr_dmabuf, .deregMr = f_dereg_mr, .isend = f_isend8,
    .irecv = f_irecv8, .iflush = f_iflush, .test = f_test, .closeSend = f_close,
    .closeRecv = f_close, .closeListen = f_close_listen, .getDeviceMr = f_get_device_mr,
    .irecvConsumed = f_irecv_consumed};
#endif
