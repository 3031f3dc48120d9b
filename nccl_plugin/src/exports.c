/* SPDX-License-Identifier: Apache-2.0
 * The exported tables ncclNetPlugin_v8 .. _v12: the only symbols of the library.
 *
 * Each table starts with only its name and init. The first init decides the mode for the
 * life of the loaded library (FLOWSCHED_NET_INNER set: wrapping mode, else the TCP
 * transport) and copies that mode's entries into the table before NCCL reads them: NCCL's
 * v8..v11 shims copy the entries after init returns, and v12 reads the table in place, only
 * after init. Optional entries (regMrDmaBuf, getDeviceMr, irecvConsumed, makeVDevice) are
 * non-NULL in wrapping mode exactly when the inner plugin has them, so NCCL sees the inner's
 * capabilities; setNetAttr (v11/v12) always is, since the wrapper records its hint in slots.
 * No per-call dispatch: the chosen functions are in the table.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "inner.h"
#include "log.h"
#include "nccl/net_v10.h"
#include "nccl/net_v11.h"
#include "nccl/net_v12.h"
#include "nccl/net_v8.h"
#include "nccl/net_v9.h"
#include "param.h"
#include "wrap.h"

#define FS_EXPORT __attribute__((visibility("default")))
#ifdef FS_INNER_BUILD
#define FS_PLUGIN_NAME "fstcp"
#else
#define FS_PLUGIN_NAME "flowsched"
#endif
#define NCCL_PROXY_MAX_SUBS 64

/* The TCP transport's v10..v12 tables (interface_nccl.c). */
extern const ncclNet_v10_t fs_tcp_net_v10;
extern const ncclNet_v11_t fs_tcp_net_v11;
extern const ncclNet_v12_t fs_tcp_net_v12;

enum { MODE_UNSET = 0, MODE_TCP = 1, MODE_WRAP = 2 };

static struct {
  pthread_mutex_t lock;
  int mode;
  int filled[13]; /* per exported version */
} fs_exports = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int mode_locked(void) {
  if (fs_exports.mode == MODE_UNSET) {
#ifdef FS_INNER_BUILD
    fs_exports.mode = MODE_TCP;
#else
    /* set at all: wrapping mode, also when the value is too long to use (the wrapper's
     * setup then fails and says so, rather than the TCP transport running in its place) */
    fs_exports.mode = fs_param_is_set("FLOWSCHED_NET_INNER") ? MODE_WRAP : MODE_TCP;
#endif
  }
  return fs_exports.mode;
}

/* ---- property conversion (v12 -> older) ------------------------------------------------------ */

/* v9..v11 have four vDevice slots; a v12 vNIC of more devices cannot be described. */
#define FS_PROPS_V9_FROM(out, in)                                                     \
  do {                                                                                \
    FS_COPY_V8_PROPS(out, in);                                                        \
    (out)->forceFlush = (in)->forceFlush;                                             \
    (out)->vProps.ndevs = (in)->vProps.ndevs < 4 ? (in)->vProps.ndevs : 4;            \
    for (int i_ = 0; i_ < (out)->vProps.ndevs; i_++) {                                \
      (out)->vProps.devs[i_] = (in)->vProps.devs[i_];                                 \
    }                                                                                 \
    (out)->maxP2pBytes = (in)->maxP2pBytes;                                           \
    (out)->maxCollBytes = (in)->maxCollBytes;                                         \
  } while (0)

#define FS_VPROPS_UP(out, in)                    \
  do {                                           \
    if ((in) == NULL || (in)->ndevs < 0 || (in)->ndevs > 4) { \
      return ncclInvalidUsage;                   \
    }                                            \
    (out).ndevs = (in)->ndevs;                   \
    for (int i_ = 0; i_ < (in)->ndevs; i_++) {   \
      (out).devs[i_] = (in)->devs[i_];           \
    }                                            \
  } while (0)

/* ---- wrapping mode: adapters from each exported version to wrap.c (v12 convention) ------- */

static ncclResult_t w_props_v11(int dev, ncclNetProperties_v11_t* props) {
  ncclNetProperties_v12_t p;
  ncclResult_t res = fs_wrap_get_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_PROPS_V9_FROM(props, &p);
    props->maxMultiRequestSize = p.maxMultiRequestSize;
  }
  return res;
}

static ncclResult_t w_props_v10(int dev, ncclNetProperties_v10_t* props) {
  ncclNetProperties_v12_t p;
  ncclResult_t res = fs_wrap_get_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_PROPS_V9_FROM(props, &p);
  }
  return res;
}

static ncclResult_t w_props_v9(int dev, ncclNetProperties_v9_t* props) {
  ncclNetProperties_v12_t p;
  ncclResult_t res = fs_wrap_get_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_PROPS_V9_FROM(props, &p);
  }
  return res;
}

static ncclResult_t w_props_v8(int dev, ncclNetProperties_v8_t* props) {
  ncclNetProperties_v12_t p;
  ncclResult_t res = fs_wrap_get_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_COPY_V8_PROPS(props, &p);
  }
  return res;
}

static ncclResult_t w_vdev_v11(int* d, ncclNetVDeviceProps_v11_t* props) {
  ncclNetVDeviceProps_v12_t p = {0};
  FS_VPROPS_UP(p, props);
  return fs_wrap_make_vdevice(d, &p);
}

static ncclResult_t w_vdev_v10(int* d, ncclNetVDeviceProps_v10_t* props) {
  ncclNetVDeviceProps_v12_t p = {0};
  FS_VPROPS_UP(p, props);
  return fs_wrap_make_vdevice(d, &p);
}

static ncclResult_t w_vdev_v9(int* d, ncclNetVDeviceProps_v9_t* props) {
  ncclNetVDeviceProps_v12_t p = {0};
  FS_VPROPS_UP(p, props);
  return fs_wrap_make_vdevice(d, &p);
}

static ncclResult_t w_init_v11(void** ctx, uint64_t comm_id, ncclNetCommConfig_v11_t* config,
                               ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  int tc = config != NULL ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  return fs_wrap_init(ctx, comm_id, tc, logger, prof);
}

static ncclResult_t w_connect_v11(void* ctx, int dev, void* handle, void** send_comm,
                                  ncclNetDeviceHandle_t** dev_comm) {
  return fs_wrap_connect(ctx, dev, FS_WRAP_TC_OF_CTX, handle, send_comm, dev_comm);
}

static ncclResult_t w_init_v10(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  return fs_wrap_init_legacy(logger, prof);
}

static ncclResult_t w_init_v9(ncclDebugLogger_t logger) {
  return fs_wrap_init_legacy(logger, NULL);
}

static ncclResult_t w_listen_legacy(int dev, void* handle, void** listen_comm) {
  return fs_wrap_listen(fs_wrap_legacy_ctx(), dev, handle, listen_comm);
}

static ncclResult_t w_connect_v10(int dev, ncclNetCommConfig_v10_t* config, void* handle,
                                  void** send_comm, ncclNetDeviceHandle_t** dev_comm) {
  int tc = config != NULL ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  return fs_wrap_connect(fs_wrap_legacy_ctx(), dev, tc, handle, send_comm, dev_comm);
}

static ncclResult_t w_connect_v9(int dev, void* handle, void** send_comm,
                                 ncclNetDeviceHandle_t** dev_comm) {
  return fs_wrap_connect(fs_wrap_legacy_ctx(), dev, NCCL_NET_TRAFFIC_CLASS_UNDEF, handle,
                         send_comm, dev_comm);
}

static ncclResult_t w_isend_v9(void* s, void* data, size_t size, int tag, void* mh, void** req) {
  return fs_wrap_isend(s, data, size, tag, mh, NULL, req);
}

static ncclResult_t w_irecv_v9(void* r, int n, void** data, size_t* sizes, int* tags, void** mhs,
                               void** req) {
  return fs_wrap_irecv(r, n, data, sizes, tags, mhs, NULL, req);
}

static ncclResult_t w_isend_v8(void* s, void* data, int size, int tag, void* mh, void** req) {
  if (size < 0) {
    *req = NULL;
    return ncclInternalError;
  }
  return fs_wrap_isend(s, data, (size_t)size, tag, mh, NULL, req);
}

static ncclResult_t w_irecv_v8(void* r, int n, void** data, int* sizes, int* tags, void** mhs,
                               void** req) {
  size_t wide[NCCL_PROXY_MAX_SUBS];
  if (req != NULL) {
    *req = NULL; /* NCCL's v8 shim never presets the hint; never pass garbage in */
  }
  if (n < 0 || n > NCCL_PROXY_MAX_SUBS || sizes == NULL) {
    return ncclInternalError;
  }
  for (int i = 0; i < n; i++) {
    wide[i] = sizes[i] > 0 ? (size_t)sizes[i] : 0;
  }
  return fs_wrap_irecv(r, n, data, wide, tags, mhs, NULL, req);
}

/* Entries whose signature is the same in every version. */
#define FS_WRAP_COMMON                          \
  .accept = fs_wrap_accept,                     \
  .regMr = fs_wrap_reg_mr,                      \
  .deregMr = fs_wrap_dereg_mr,                  \
  .iflush = fs_wrap_iflush,                     \
  .test = fs_wrap_test,                         \
  .closeSend = fs_wrap_close_send,              \
  .closeRecv = fs_wrap_close_recv,              \
  .closeListen = fs_wrap_close_listen,          \
  .devices = fs_wrap_devices

static const ncclNet_v12_t wrap_v12 = {
    FS_WRAP_COMMON, .init = w_init_v11, .getProperties = fs_wrap_get_properties,
    .listen = fs_wrap_listen, .connect = w_connect_v11, .isend = fs_wrap_isend,
    .irecv = fs_wrap_irecv, .finalize = fs_wrap_finalize, .setNetAttr = fs_wrap_set_net_attr,
};
static const ncclNet_v11_t wrap_v11 = {
    FS_WRAP_COMMON, .init = w_init_v11, .getProperties = w_props_v11,
    .listen = fs_wrap_listen, .connect = w_connect_v11, .isend = fs_wrap_isend,
    .irecv = fs_wrap_irecv, .finalize = fs_wrap_finalize, .setNetAttr = fs_wrap_set_net_attr,
};
static const ncclNet_v10_t wrap_v10 = {
    FS_WRAP_COMMON, .init = w_init_v10, .getProperties = w_props_v10,
    .listen = w_listen_legacy, .connect = w_connect_v10, .isend = fs_wrap_isend,
    .irecv = fs_wrap_irecv,
};
static const ncclNet_v9_t wrap_v9 = {
    FS_WRAP_COMMON, .init = w_init_v9, .getProperties = w_props_v9,
    .listen = w_listen_legacy, .connect = w_connect_v9, .isend = w_isend_v9,
    .irecv = w_irecv_v9,
};
static const ncclNet_v8_t wrap_v8 = {
    FS_WRAP_COMMON, .init = w_init_v9, .getProperties = w_props_v8,
    .listen = w_listen_legacy, .connect = w_connect_v9, .isend = w_isend_v8,
    .irecv = w_irecv_v8,
};

/* The optional entries, present exactly when the inner has them. */
#define FS_WRAP_OPTIONAL(table, vdev)                                                        \
  do {                                                                                       \
    const struct fs_inner_ops* ops_ = &fs_wrap_inner()->ops;                                 \
    (table).regMrDmaBuf = ops_->regMrDmaBuf != NULL ? fs_wrap_reg_mr_dmabuf : NULL;          \
    (table).getDeviceMr = ops_->getDeviceMr != NULL ? fs_wrap_get_device_mr : NULL;          \
    (table).irecvConsumed = ops_->irecvConsumed != NULL ? fs_wrap_irecv_consumed : NULL;     \
    vdev;                                                                                    \
  } while (0)

/* ---- TCP transport, v8 and v9 (v10..v12 are in interface_nccl.c) --------------------------- */

static ncclResult_t t_init_v9(ncclDebugLogger_t logger) {
  return fs_api_init_v10(logger);
}

static void t_props_fill(int dev, const struct fs_props* p, ncclNetProperties_v9_t* out) {
  memset(out, 0, sizeof(*out));
  out->name = p->name;
  out->pciPath = p->pci_path;
  out->guid = p->guid;
  out->ptrSupport = NCCL_PTR_HOST;
  out->speed = p->speed_mbps;
  out->port = p->port;
  out->maxComms = p->max_comms;
  out->maxRecvs = p->max_recvs;
  out->netDeviceType = NCCL_NET_DEVICE_HOST;
  out->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
  out->vProps.ndevs = 1;
  out->vProps.devs[0] = dev;
  out->maxP2pBytes = p->max_p2p_bytes;
  out->maxCollBytes = p->max_coll_bytes;
}

static ncclResult_t t_props_v9(int dev, ncclNetProperties_v9_t* props) {
  struct fs_props p;
  ncclResult_t res = fs_api_properties(dev, &p);
  if (res == ncclSuccess) {
    t_props_fill(dev, &p, props);
  }
  return res;
}

static ncclResult_t t_props_v8(int dev, ncclNetProperties_v8_t* props) {
  ncclNetProperties_v9_t p9;
  ncclResult_t res = t_props_v9(dev, &p9);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_COPY_V8_PROPS(props, &p9);
  }
  return res;
}

static ncclResult_t t_listen(int dev, void* handle, void** listen_comm) {
  return fs_api_listen(NULL, dev, handle, listen_comm);
}

static ncclResult_t t_connect(int dev, void* handle, void** send_comm, ncclNetDeviceHandle_t** dh) {
  (void)dh;
  return fs_api_connect(NULL, dev, NCCL_NET_TRAFFIC_CLASS_UNDEF, handle, send_comm);
}

static ncclResult_t t_isend_v9(void* s, void* data, size_t size, int tag, void* mh, void** req) {
  (void)mh;
  return fs_api_isend(s, data, size, tag, req);
}

static ncclResult_t t_irecv_v9(void* r, int n, void** data, size_t* sizes, int* tags, void** mhs,
                               void** req) {
  (void)mhs;
  return fs_api_irecv(r, n, data, sizes, tags, req);
}

static ncclResult_t t_isend_v8(void* s, void* data, int size, int tag, void* mh, void** req) {
  (void)mh;
  if (size < 0) {
    if (req != NULL) *req = NULL;
    return ncclInternalError;
  }
  return fs_api_isend(s, data, (size_t)size, tag, req);
}

static ncclResult_t t_irecv_v8(void* r, int n, void** data, int* sizes, int* tags, void** mhs,
                               void** req) {
  (void)mhs;
  size_t wide[NCCL_PROXY_MAX_SUBS];
  if (n < 1 || n > NCCL_PROXY_MAX_SUBS || sizes == NULL) {
    return fs_api_irecv(r, n, data, NULL, tags, req); /* refused with the usual message */
  }
  for (int i = 0; i < n; i++) {
    wide[i] = sizes[i] > 0 ? (size_t)sizes[i] : 0;
  }
  return fs_api_irecv(r, n, data, wide, tags, req);
}

/* Entries of the v10 table that v8/v9 share (same signatures). */
#define FS_TCP_COMMON_FROM_V10                            \
  .devices = fs_tcp_net_v10.devices,                      \
  .accept = fs_tcp_net_v10.accept

static ncclNet_v9_t tcp_v9_table(void) {
  return (ncclNet_v9_t){
      FS_TCP_COMMON_FROM_V10, .init = t_init_v9, .getProperties = t_props_v9,
      .listen = t_listen, .connect = t_connect, .regMr = fs_tcp_net_v10.regMr,
      .deregMr = fs_tcp_net_v10.deregMr, .isend = t_isend_v9, .irecv = t_irecv_v9,
      .iflush = fs_tcp_net_v10.iflush, .test = fs_tcp_net_v10.test,
      .closeSend = fs_tcp_net_v10.closeSend, .closeRecv = fs_tcp_net_v10.closeRecv,
      .closeListen = fs_tcp_net_v10.closeListen};
}

static ncclNet_v8_t tcp_v8_table(void) {
  return (ncclNet_v8_t){
      FS_TCP_COMMON_FROM_V10, .init = t_init_v9, .getProperties = t_props_v8,
      .listen = t_listen, .connect = t_connect, .regMr = fs_tcp_net_v10.regMr,
      .deregMr = fs_tcp_net_v10.deregMr, .isend = t_isend_v8, .irecv = t_irecv_v8,
      .iflush = fs_tcp_net_v10.iflush, .test = fs_tcp_net_v10.test,
      .closeSend = fs_tcp_net_v10.closeSend, .closeRecv = fs_tcp_net_v10.closeRecv,
      .closeListen = fs_tcp_net_v10.closeListen};
}

/* ---- the exported tables and their first init ------------------------------------------------ */

static ncclResult_t init_v12(void**, uint64_t, ncclNetCommConfig_v12_t*, ncclDebugLogger_t,
                             ncclProfilerCallback_t);
static ncclResult_t init_v11(void**, uint64_t, ncclNetCommConfig_v11_t*, ncclDebugLogger_t,
                             ncclProfilerCallback_t);
static ncclResult_t init_v10(ncclDebugLogger_t, ncclProfilerCallback_t);
static ncclResult_t init_v9(ncclDebugLogger_t);
static ncclResult_t init_v8(ncclDebugLogger_t);

FS_EXPORT ncclNet_v12_t ncclNetPlugin_v12 = {.name = FS_PLUGIN_NAME, .init = init_v12};
FS_EXPORT ncclNet_v11_t ncclNetPlugin_v11 = {.name = FS_PLUGIN_NAME, .init = init_v11};
FS_EXPORT ncclNet_v10_t ncclNetPlugin_v10 = {.name = FS_PLUGIN_NAME, .init = init_v10};
FS_EXPORT ncclNet_v9_t ncclNetPlugin_v9 = {.name = FS_PLUGIN_NAME, .init = init_v9};
FS_EXPORT ncclNet_v8_t ncclNetPlugin_v8 = {.name = FS_PLUGIN_NAME, .init = init_v8};

/* Decide the mode once (wrapping: load the inner plugin). ncclSuccess, or the setup's error
 * (the table then stays unfilled: NCCL disables the plugin and says why in the log). */
static ncclResult_t prepare(ncclDebugLogger_t logger) {
  pthread_mutex_lock(&fs_exports.lock);
  int mode = mode_locked();
  pthread_mutex_unlock(&fs_exports.lock);
  return mode == MODE_WRAP && fs_wrap_setup(logger) != 0 ? ncclInvalidUsage : ncclSuccess;
}

/* Copy the entries that follow name and init (the first two fields of every version) from
 * `src` into the exported table `dst`. Name and init are never written: other communicators'
 * threads read them, without a lock, to call init while this one fills the table in (a data
 * race even with the same bytes). They read the other entries only after their own init
 * returned, and that init's fill() took the lock after this one's. */
#define FS_FILL_ENTRIES(dst, src)                                                             \
  do {                                                                                        \
    _Static_assert(offsetof(__typeof__(dst), name) == 0 &&                                    \
                       offsetof(__typeof__(dst), init) == sizeof((dst).name),                 \
                   "name and init lead the table");                                           \
    size_t at_ = offsetof(__typeof__(dst), init) + sizeof((dst).init);                       \
    memcpy((char*)&(dst) + at_, (const char*)&(src) + at_, sizeof(dst) - at_);               \
  } while (0)

/* Fill table `version` once, after a successful init (the inner's entries are known then). */
static void fill(int version) {
  pthread_mutex_lock(&fs_exports.lock);
  int mode = fs_exports.mode;
  if (!fs_exports.filled[version]) {
    int wrap = mode == MODE_WRAP;
    switch (version) {
      case 12: {
        ncclNet_v12_t t = wrap ? wrap_v12 : fs_tcp_net_v12;
        if (wrap) FS_WRAP_OPTIONAL(t, t.makeVDevice = fs_wrap_inner()->ops.makeVDevice ? fs_wrap_make_vdevice : NULL);
        FS_FILL_ENTRIES(ncclNetPlugin_v12, t);
        break;
      }
      case 11: {
        ncclNet_v11_t t = wrap ? wrap_v11 : fs_tcp_net_v11;
        if (wrap) FS_WRAP_OPTIONAL(t, t.makeVDevice = fs_wrap_inner()->ops.makeVDevice ? w_vdev_v11 : NULL);
        FS_FILL_ENTRIES(ncclNetPlugin_v11, t);
        break;
      }
      case 10: {
        ncclNet_v10_t t = wrap ? wrap_v10 : fs_tcp_net_v10;
        if (wrap) FS_WRAP_OPTIONAL(t, t.makeVDevice = fs_wrap_inner()->ops.makeVDevice ? w_vdev_v10 : NULL);
        FS_FILL_ENTRIES(ncclNetPlugin_v10, t);
        break;
      }
      case 9: {
        ncclNet_v9_t t = wrap ? wrap_v9 : tcp_v9_table();
        if (wrap) FS_WRAP_OPTIONAL(t, t.makeVDevice = fs_wrap_inner()->ops.makeVDevice ? w_vdev_v9 : NULL);
        FS_FILL_ENTRIES(ncclNetPlugin_v9, t);
        break;
      }
      default: {
        ncclNet_v8_t t = wrap ? wrap_v8 : tcp_v8_table();
        if (wrap) FS_WRAP_OPTIONAL(t, (void)0);
        FS_FILL_ENTRIES(ncclNetPlugin_v8, t);
        break;
      }
    }
    fs_exports.filled[version] = 1;
  }
  pthread_mutex_unlock(&fs_exports.lock);
}


static ncclResult_t init_v12(void** ctx, uint64_t comm_id, ncclNetCommConfig_v12_t* config,
                             ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  ncclResult_t res = prepare(logger);
  if (res != ncclSuccess) {
    if (ctx != NULL) *ctx = NULL;
    return res;
  }
  res = fs_exports.mode == MODE_WRAP ? w_init_v11(ctx, comm_id, config, logger, prof)
                                     : fs_tcp_net_v12.init(ctx, comm_id, config, logger, prof);
  if (res == ncclSuccess) fill(12);
  return res;
}

static ncclResult_t init_v11(void** ctx, uint64_t comm_id, ncclNetCommConfig_v11_t* config,
                             ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  ncclResult_t res = prepare(logger);
  if (res != ncclSuccess) {
    if (ctx != NULL) *ctx = NULL;
    return res;
  }
  res = fs_exports.mode == MODE_WRAP ? w_init_v11(ctx, comm_id, config, logger, prof)
                                     : fs_tcp_net_v11.init(ctx, comm_id, config, logger, prof);
  if (res == ncclSuccess) fill(11);
  return res;
}

static ncclResult_t init_v10(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  ncclResult_t res = prepare(logger);
  if (res == ncclSuccess) {
    res = fs_exports.mode == MODE_WRAP ? w_init_v10(logger, prof) : fs_tcp_net_v10.init(logger, prof);
  }
  if (res == ncclSuccess) fill(10);
  return res;
}

static ncclResult_t init_v9(ncclDebugLogger_t logger) {
  ncclResult_t res = prepare(logger);
  if (res == ncclSuccess) {
    res = fs_exports.mode == MODE_WRAP ? w_init_v9(logger) : t_init_v9(logger);
  }
  if (res == ncclSuccess) fill(9);
  return res;
}

static ncclResult_t init_v8(ncclDebugLogger_t logger) {
  ncclResult_t res = prepare(logger);
  if (res == ncclSuccess) {
    res = fs_exports.mode == MODE_WRAP ? w_init_v9(logger) : t_init_v9(logger);
  }
  if (res == ncclSuccess) fill(8);
  return res;
}
