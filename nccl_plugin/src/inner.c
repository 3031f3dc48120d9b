/* SPDX-License-Identifier: Apache-2.0 */
#include "inner.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "nccl/net_v10.h"
#include "nccl/net_v11.h"
#include "nccl/net_v8.h"
#include "nccl/net_v9.h"

/* One inner plugin per process: the adapters below reach its table through these. */
static const ncclNet_v8_t* inner_v8;
static const ncclNet_v9_t* inner_v9;
static const ncclNet_v10_t* inner_v10;
static const ncclNet_v11_t* inner_v11;
static const ncclNet_v12_t* inner_v12;
/* Pre-v11 inners: init once per process (refcounted), and this marker as the context. The
 * count changes under the lock, and only once the inner's init has succeeded. */
static pthread_mutex_t legacy_lock = PTHREAD_MUTEX_INITIALIZER;
static int legacy_refs;
static int legacy_ctx_marker;
#define NCCL_PROXY_MAX_SUBS 64 /* the most receives NCCL groups into one irecv */

/* ---- property conversion: every version's fields, v12 defaults for the ones it lacks ---- */


#define FS_COPY_V9_PROPS(out, in)                                \
  do {                                                           \
    FS_COPY_V8_PROPS(out, in);                                   \
    (out)->forceFlush = (in)->forceFlush;                        \
    (out)->vProps.ndevs = (in)->vProps.ndevs;                    \
    for (int i_ = 0; i_ < 4 && i_ < (in)->vProps.ndevs; i_++) {  \
      (out)->vProps.devs[i_] = (in)->vProps.devs[i_];            \
    }                                                            \
    (out)->maxP2pBytes = (in)->maxP2pBytes;                      \
    (out)->maxCollBytes = (in)->maxCollBytes;                    \
  } while (0)

static void props_defaults(int dev, ncclNetProperties_v12_t* out) {
  memset(out, 0, sizeof(*out));
  out->vProps.ndevs = 1;
  out->vProps.devs[0] = dev;
  out->maxP2pBytes = NCCL_MAX_NET_SIZE_V8;
  out->maxCollBytes = NCCL_MAX_COLLNET_SIZE;
  out->maxMultiRequestSize = 1;
  out->railId = NCCL_NET_ID_UNDEF;
  out->planeId = NCCL_NET_ID_UNDEF;
}

static ncclResult_t props_v8(int dev, ncclNetProperties_v12_t* out) {
  ncclNetProperties_v8_t p;
  ncclResult_t res = inner_v8->getProperties(dev, &p);
  if (res == ncclSuccess) {
    props_defaults(dev, out);
    FS_COPY_V8_PROPS(out, &p);
  }
  return res;
}

static ncclResult_t props_v9(int dev, ncclNetProperties_v12_t* out) {
  ncclNetProperties_v9_t p;
  ncclResult_t res = inner_v9->getProperties(dev, &p);
  if (res == ncclSuccess) {
    props_defaults(dev, out);
    FS_COPY_V9_PROPS(out, &p);
  }
  return res;
}

static ncclResult_t props_v10(int dev, ncclNetProperties_v12_t* out) {
  ncclNetProperties_v10_t p;
  ncclResult_t res = inner_v10->getProperties(dev, &p);
  if (res == ncclSuccess) {
    props_defaults(dev, out);
    FS_COPY_V9_PROPS(out, &p);
  }
  return res;
}

static ncclResult_t props_v11(int dev, ncclNetProperties_v12_t* out) {
  ncclNetProperties_v11_t p;
  ncclResult_t res = inner_v11->getProperties(dev, &p);
  if (res == ncclSuccess) {
    props_defaults(dev, out);
    FS_COPY_V9_PROPS(out, &p);
    out->maxMultiRequestSize = p.maxMultiRequestSize;
  }
  return res;
}

/* v12 virtual-device props (8 slots) into an older struct's 4 slots. */
#define FS_VPROPS_DOWN(out, in)                  \
  do {                                           \
    if ((in)->ndevs < 0 || (in)->ndevs > 4) {    \
      return ncclInvalidUsage;                   \
    }                                            \
    (out).ndevs = (in)->ndevs;                   \
    for (int i_ = 0; i_ < (in)->ndevs; i_++) {   \
      (out).devs[i_] = (in)->devs[i_];           \
    }                                            \
  } while (0)

static ncclResult_t vdev_v9(int* d, ncclNetVDeviceProps_v12_t* props) {
  ncclNetVDeviceProps_v9_t p = {0};
  FS_VPROPS_DOWN(p, props);
  return inner_v9->makeVDevice(d, &p);
}

static ncclResult_t vdev_v10(int* d, ncclNetVDeviceProps_v12_t* props) {
  ncclNetVDeviceProps_v10_t p = {0};
  FS_VPROPS_DOWN(p, props);
  return inner_v10->makeVDevice(d, &p);
}

static ncclResult_t vdev_v11(int* d, ncclNetVDeviceProps_v12_t* props) {
  ncclNetVDeviceProps_v11_t p = {0};
  FS_VPROPS_DOWN(p, props);
  return inner_v11->makeVDevice(d, &p);
}

/* ---- init / finalize ---------------------------------------------------------------------- */

static void bind_once(void);

/* The first init runs the inner's own init under the lock, so a concurrent init (NCCL 2.27+
 * initialises each communicator on the thread that creates it) waits for it: it must neither
 * use the inner before its init finished nor count on an init that failed. A failed init
 * leaves nothing behind: the next init tries the inner's init again. */
static ncclResult_t legacy_init(void** ctx, ncclResult_t (*first)(ncclDebugLogger_t, ncclProfilerCallback_t),
                                ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  ncclResult_t res = ncclSuccess;
  pthread_mutex_lock(&legacy_lock);
  if (legacy_refs == 0) {
    res = first(logger, prof);
  }
  if (res == ncclSuccess) {
    legacy_refs++;
    bind_once();
  }
  pthread_mutex_unlock(&legacy_lock);
  *ctx = res == ncclSuccess ? &legacy_ctx_marker : NULL;
  return res;
}

static ncclResult_t first_v8(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  (void)prof;
  return inner_v8->init(logger);
}
static ncclResult_t first_v9(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  (void)prof;
  return inner_v9->init(logger);
}
static ncclResult_t first_v10(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  return inner_v10->init(logger, prof);
}

static ncclResult_t init_v8(void** ctx, uint64_t id, int tc, ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  (void)id;
  (void)tc;
  return legacy_init(ctx, first_v8, l, p);
}
static ncclResult_t init_v9(void** ctx, uint64_t id, int tc, ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  (void)id;
  (void)tc;
  return legacy_init(ctx, first_v9, l, p);
}
static ncclResult_t init_v10(void** ctx, uint64_t id, int tc, ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  (void)id;
  (void)tc; /* v10 takes it at connect */
  return legacy_init(ctx, first_v10, l, p);
}

static ncclResult_t init_v11(void** ctx, uint64_t id, int tc, ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  ncclNetCommConfig_v11_t cfg = {.trafficClass = tc}; /* never NULL: aws-ofi-nccl reads it */
  ncclResult_t res = inner_v11->init(ctx, id, &cfg, l, p);
  if (res == ncclSuccess) {
    bind_once();
  }
  return res;
}
static ncclResult_t init_v12(void** ctx, uint64_t id, int tc, ncclDebugLogger_t l, ncclProfilerCallback_t p) {
  ncclNetCommConfig_v12_t cfg = {.trafficClass = tc};
  ncclResult_t res = inner_v12->init(ctx, id, &cfg, l, p);
  if (res == ncclSuccess) {
    bind_once();
  }
  return res;
}

static ncclResult_t finalize_legacy(void* ctx) {
  (void)ctx;
  pthread_mutex_lock(&legacy_lock); /* pre-v11 plugins have no finalize: NCCL never unloads them mid-run */
  if (legacy_refs > 0) {
    legacy_refs--;
  }
  pthread_mutex_unlock(&legacy_lock);
  return ncclSuccess;
}

/* ---- listen / connect --------------------------------------------------------------------- */

static ncclResult_t listen_v8(void* ctx, int dev, void* handle, void** l) {
  (void)ctx;
  return inner_v8->listen(dev, handle, l);
}
static ncclResult_t listen_v9(void* ctx, int dev, void* handle, void** l) {
  (void)ctx;
  return inner_v9->listen(dev, handle, l);
}
static ncclResult_t listen_v10(void* ctx, int dev, void* handle, void** l) {
  (void)ctx;
  return inner_v10->listen(dev, handle, l);
}

static ncclResult_t connect_v8(void* ctx, int dev, int tc, void* handle, void** s,
                               ncclNetDeviceHandle_t** dh) {
  (void)ctx;
  (void)tc;
  return inner_v8->connect(dev, handle, s, dh);
}
static ncclResult_t connect_v9(void* ctx, int dev, int tc, void* handle, void** s,
                               ncclNetDeviceHandle_t** dh) {
  (void)ctx;
  (void)tc;
  return inner_v9->connect(dev, handle, s, dh);
}
static ncclResult_t connect_v10(void* ctx, int dev, int tc, void* handle, void** s,
                                ncclNetDeviceHandle_t** dh) {
  (void)ctx;
  ncclNetCommConfig_v10_t cfg = {.trafficClass = tc};
  return inner_v10->connect(dev, &cfg, handle, s, dh);
}
static ncclResult_t connect_v11(void* ctx, int dev, int tc, void* handle, void** s,
                                ncclNetDeviceHandle_t** dh) {
  (void)tc; /* given at init: the wrapper picks the inner context of the class */
  return inner_v11->connect(ctx, dev, handle, s, dh);
}
static ncclResult_t connect_v12(void* ctx, int dev, int tc, void* handle, void** s,
                                ncclNetDeviceHandle_t** dh) {
  (void)tc;
  return inner_v12->connect(ctx, dev, handle, s, dh);
}

/* ---- data path of v8/v9 (no phandle; v8: int sizes) ---------------------------------------- */

static ncclResult_t isend_v8(void* s, void* data, size_t size, int tag, void* mh, void* ph,
                             void** req) {
  (void)ph;
  if (size > NCCL_MAX_NET_SIZE_V8) {
    *req = NULL;
    return ncclInternalError;
  }
  return inner_v8->isend(s, data, (int)size, tag, mh, req);
}

static ncclResult_t irecv_v8(void* r, int n, void** data, size_t* sizes, int* tags, void** mhs,
                             void** phs, void** req) {
  (void)phs;
  int isizes[NCCL_PROXY_MAX_SUBS];
  *req = NULL; /* v8 plugins do not know the optional-completion hint: clear it (as NCCL does) */
  if (n < 0 || n > NCCL_PROXY_MAX_SUBS) {
    return ncclInternalError;
  }
  for (int i = 0; i < n; i++) {
    if (sizes[i] > NCCL_MAX_NET_SIZE_V8) {
      return ncclInternalError;
    }
    isizes[i] = (int)sizes[i];
  }
  return inner_v8->irecv(r, n, data, isizes, tags, mhs, req);
}

static ncclResult_t isend_v9(void* s, void* data, size_t size, int tag, void* mh, void* ph,
                             void** req) {
  (void)ph;
  return inner_v9->isend(s, data, size, tag, mh, req);
}

static ncclResult_t irecv_v9(void* r, int n, void** data, size_t* sizes, int* tags, void** mhs,
                             void** phs, void** req) {
  (void)phs;
  return inner_v9->irecv(r, n, data, sizes, tags, mhs, req);
}

/* ---- binding ------------------------------------------------------------------------------ */

/* Entries with identical signatures in every version are copied as they are. */
#define FS_BIND_COMMON(ops, t)                 \
  do {                                         \
    (ops)->devices = (t)->devices;             \
    (ops)->accept = (t)->accept;               \
    (ops)->regMr = (t)->regMr;                 \
    (ops)->regMrDmaBuf = (t)->regMrDmaBuf;     \
    (ops)->deregMr = (t)->deregMr;             \
    (ops)->iflush = (t)->iflush;               \
    (ops)->test = (t)->test;                   \
    (ops)->closeSend = (t)->closeSend;         \
    (ops)->closeRecv = (t)->closeRecv;         \
    (ops)->closeListen = (t)->closeListen;     \
    (ops)->getDeviceMr = (t)->getDeviceMr;     \
    (ops)->irecvConsumed = (t)->irecvConsumed; \
  } while (0)

/* Copy the entries after the inner's first successful init, as NCCL does: some plugins fill or
 * overwrite their table in init (IBext picks its backend there; ours fill it there). */
static struct fs_inner* bound_inner;
static atomic_int bound;
static pthread_mutex_t bind_lock = PTHREAD_MUTEX_INITIALIZER;

static void bind_entries(struct fs_inner* in, int version) {
  /* The inner_vN table pointers and in->init were set at load and are left alone: a
   * concurrent communicator init reads them without a lock. */
  struct fs_inner_ops* ops = &in->ops;
  memset(ops, 0, sizeof(*ops));
  switch (version) {
    case 12:
      FS_BIND_COMMON(ops, inner_v12);
      ops->getProperties = inner_v12->getProperties;
      ops->listen = inner_v12->listen;
      ops->connect = connect_v12;
      ops->isend = inner_v12->isend;
      ops->irecv = inner_v12->irecv;
      ops->makeVDevice = inner_v12->makeVDevice;
      ops->finalize = inner_v12->finalize;
      ops->setNetAttr = inner_v12->setNetAttr;
      in->name = inner_v12->name;
      break;
    case 11:
      FS_BIND_COMMON(ops, inner_v11);
      ops->getProperties = props_v11;
      ops->listen = inner_v11->listen;
      ops->connect = connect_v11;
      ops->isend = inner_v11->isend;
      ops->irecv = inner_v11->irecv;
      ops->makeVDevice = inner_v11->makeVDevice != NULL ? vdev_v11 : NULL;
      ops->finalize = inner_v11->finalize;
      ops->setNetAttr = inner_v11->setNetAttr;
      in->name = inner_v11->name;
      break;
    case 10:
      FS_BIND_COMMON(ops, inner_v10);
      ops->getProperties = props_v10;
      ops->listen = listen_v10;
      ops->connect = connect_v10;
      ops->isend = inner_v10->isend;
      ops->irecv = inner_v10->irecv;
      ops->makeVDevice = inner_v10->makeVDevice != NULL ? vdev_v10 : NULL;
      ops->finalize = finalize_legacy;
      in->name = inner_v10->name;
      break;
    case 9:
      FS_BIND_COMMON(ops, inner_v9);
      ops->getProperties = props_v9;
      ops->listen = listen_v9;
      ops->connect = connect_v9;
      ops->isend = isend_v9;
      ops->irecv = irecv_v9;
      ops->makeVDevice = inner_v9->makeVDevice != NULL ? vdev_v9 : NULL;
      ops->finalize = finalize_legacy;
      in->name = inner_v9->name;
      break;
    default:
      FS_BIND_COMMON(ops, inner_v8);
      ops->getProperties = props_v8;
      ops->listen = listen_v8;
      ops->connect = connect_v8;
      ops->isend = isend_v8;
      ops->irecv = irecv_v8;
      ops->finalize = finalize_legacy;
      in->name = inner_v8->name;
      break;
  }
}

static void bind_once(void) {
  if (atomic_load_explicit(&bound, memory_order_acquire)) {
    return;
  }
  pthread_mutex_lock(&bind_lock);
  if (!atomic_load_explicit(&bound, memory_order_relaxed)) {
    bind_entries(bound_inner, bound_inner->version);
    atomic_store_explicit(&bound, 1, memory_order_release);
  }
  pthread_mutex_unlock(&bind_lock);
}

/* NCCL_NET_PLUGIN's rule: the value as given, then libnccl-net-<value>.so for a bare name. */
static void* open_library(const char* spec, char* path, size_t cap, char* err, size_t errlen) {
  snprintf(path, cap, "%s", spec);
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib != NULL) {
    return lib;
  }
  snprintf(err, errlen, "%s", dlerror());
  size_t len = strlen(spec);
  int file_name = strncmp(spec, "lib", 3) == 0 && len > 6 && strcmp(spec + len - 3, ".so") == 0;
  if (strchr(spec, '/') != NULL || file_name) {
    return NULL;
  }
  snprintf(path, cap, "libnccl-net-%s.so", spec);
  lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    size_t used = strlen(err);
    snprintf(err + used, errlen - used, "; %s", dlerror());
  }
  return lib;
}

int fs_inner_load(const char* spec, struct fs_inner* out, char* err, size_t errlen) {
  memset(out, 0, sizeof(*out));
  err[0] = '\0';
  void* lib = open_library(spec, out->path, sizeof(out->path), err, errlen);
  if (lib == NULL) {
    return -ENOENT;
  }
  for (int version = 12; version >= 8; version--) {
    char sym[32];
    snprintf(sym, sizeof(sym), "ncclNetPlugin_v%d", version);
    void* table = dlsym(lib, sym);
    if (table == NULL) {
      continue;
    }
    /* Our own tables: FLOWSCHED_NET_INNER names this library (or a copy loaded as the same
     * object), which would forward to itself forever. */
    Dl_info self, found;
    if (dladdr((void*)fs_inner_load, &self) != 0 && dladdr(table, &found) != 0 &&
        self.dli_fbase == found.dli_fbase) {
      snprintf(err, errlen, "%s is the flowsched library itself", out->path);
      dlclose(lib);
      return -ELOOP;
    }
    out->lib = lib;
    out->version = version;
    out->name = *(const char* const*)table; /* every version starts with its name */
    static const fs_inner_init_fn inits[] = {init_v8, init_v9, init_v10, init_v11, init_v12};
    out->init = inits[version - 8];
    switch (version) {
      case 12: inner_v12 = table; break;
      case 11: inner_v11 = table; break;
      case 10: inner_v10 = table; break;
      case 9: inner_v9 = table; break;
      default: inner_v8 = table; break;
    }
    bound_inner = out;
    atomic_store(&bound, 0);
    return 0;
  }
  snprintf(err, errlen, "%s exports no ncclNetPlugin_v8..v12 table", out->path);
  dlclose(lib);
  return -ENOTSUP;
}

void fs_inner_companions(const struct fs_inner* inner, char* out, size_t cap) {
  static const char* const kinds[] = {"ncclTunerPlugin_v", "ncclProfiler_v", "ncclGinPlugin_v",
                                      "ncclRmaPlugin_v", "ncclCollNetPlugin_v"};
  size_t used = 0;
  out[0] = '\0';
  for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
    for (int v = 20; v >= 1; v--) {
      char sym[48];
      snprintf(sym, sizeof(sym), "%s%d", kinds[k], v);
      if (inner->lib != NULL && dlsym(inner->lib, sym) != NULL && used + strlen(sym) + 2 < cap) {
        used += (size_t)snprintf(out + used, cap - used, "%s%s", used ? " " : "", sym);
        break; /* the newest of each kind is enough to name */
      }
    }
  }
}

void fs_inner_unload(struct fs_inner* inner) {
  if (inner->lib != NULL) {
    dlclose(inner->lib);
  }
  memset(inner, 0, sizeof(*inner));
  inner_v8 = NULL;
  inner_v9 = NULL;
  inner_v10 = NULL;
  inner_v11 = NULL;
  inner_v12 = NULL;
  pthread_mutex_lock(&legacy_lock);
  legacy_refs = 0;
  pthread_mutex_unlock(&legacy_lock);
  atomic_store(&bound, 0);
  bound_inner = NULL;
}
