/* SPDX-License-Identifier: Apache-2.0
 * Per-version NCCL adapters of the TCP transport and its tables (exports.c copies them into
 * the exported ncclNetPlugin_vN tables when no inner plugin is wrapped).
 * Each adapter converts arguments and calls the API boundary (api.c). Optional entries that a
 * host-memory TCP plugin does not need (regMrDmaBuf, getDeviceMr, irecvConsumed, makeVDevice)
 * are NULL, which NCCL checks before calling. */
#include <string.h>

#include "api.h"
#include "nccl/net_v10.h"
#include "nccl/net_v11.h"
#include "nccl/net_v12.h"

#define FS_PLUGIN_NAME "flowsched"

/* Fields shared by every property struct version. */
#define FS_FILL_COMMON_PROPS(out, p)                                   \
  do {                                                                 \
    (out)->name = (p).name;                                            \
    (out)->pciPath = (p).pci_path;                                     \
    (out)->guid = (p).guid;                                            \
    (out)->ptrSupport = NCCL_PTR_HOST;                                 \
    (out)->regIsGlobal = 0;                                            \
    (out)->forceFlush = 0;                                             \
    (out)->speed = (p).speed_mbps;                                     \
    (out)->port = (p).port;                                            \
    (out)->latency = 0; /* 0: NCCL's default */                        \
    (out)->maxComms = (p).max_comms;                                   \
    (out)->maxRecvs = (p).max_recvs;                                   \
    (out)->netDeviceType = NCCL_NET_DEVICE_HOST;                       \
    (out)->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;         \
    (out)->vProps.ndevs = 1;                                           \
    (out)->vProps.devs[0] = dev;                                       \
    (out)->maxP2pBytes = (p).max_p2p_bytes;                            \
    (out)->maxCollBytes = (p).max_coll_bytes;                          \
  } while (0)

/* ---- shared adapters (identical signatures in v10..v12) --------------------------------- */

static ncclResult_t fs_devices(int* ndev) { return fs_api_devices(ndev); }

static ncclResult_t fs_accept(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** devComm) {
  (void)devComm; /* host device: NCCL passes a pointer to NULL, or NULL in the GDR probe */
  return fs_api_accept(listenComm, recvComm);
}

static ncclResult_t fs_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return fs_api_reg_mr(comm, data, size, type, mhandle);
}

static ncclResult_t fs_dereg_mr(void* comm, void* mhandle) { return fs_api_dereg_mr(comm, mhandle); }

static ncclResult_t fs_isend(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                             void* phandle, void** request) {
  (void)mhandle;
  (void)phandle;
  return fs_api_isend(sendComm, data, size, tag, request);
}

static ncclResult_t fs_irecv(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                             void** mhandles, void** phandles, void** request) {
  (void)mhandles;
  (void)phandles;
  return fs_api_irecv(recvComm, n, data, sizes, tags, request);
}

static ncclResult_t fs_iflush(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                              void** request) {
  (void)data;
  (void)sizes;
  (void)mhandles;
  return fs_api_iflush(recvComm, n, request);
}

static ncclResult_t fs_test(void* request, int* done, int* sizes) {
  return fs_api_test(request, done, sizes);
}

static ncclResult_t fs_close_comm(void* comm) { return fs_api_close_comm(comm); }

static ncclResult_t fs_close_listen(void* listenComm) { return fs_api_close_listen(listenComm); }

/* ---- v10 -------------------------------------------------------------------------------- */

static ncclResult_t fs_init_v10(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction) {
  (void)profFunction;
  return fs_api_init_v10(logFunction);
}

static ncclResult_t fs_get_properties_v10(int dev, ncclNetProperties_v10_t* props) {
  struct fs_props p;
  ncclResult_t res = fs_api_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_FILL_COMMON_PROPS(props, p);
  }
  return res;
}

static ncclResult_t fs_listen_v10(int dev, void* handle, void** listenComm) {
  return fs_api_listen(NULL, dev, handle, listenComm);
}

static ncclResult_t fs_connect_v10(int dev, ncclNetCommConfig_v10_t* config, void* handle,
                                   void** sendComm, ncclNetDeviceHandle_t** sendDevComm) {
  (void)sendDevComm;
  int traffic_class = config != NULL ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  return fs_api_connect(NULL, dev, traffic_class, handle, sendComm);
}

/* ---- v11 / v12 -------------------------------------------------------------------------- */

static ncclResult_t fs_init_v11(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config,
                                ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction) {
  (void)profFunction;
  int traffic_class = config != NULL ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  return fs_api_init_ctx(ctx, commId, traffic_class, logFunction);
}

static ncclResult_t fs_get_properties_v11(int dev, ncclNetProperties_v11_t* props) {
  struct fs_props p;
  ncclResult_t res = fs_api_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_FILL_COMMON_PROPS(props, p);
    props->maxMultiRequestSize = 1;
  }
  return res;
}

static ncclResult_t fs_get_properties_v12(int dev, ncclNetProperties_v12_t* props) {
  struct fs_props p;
  ncclResult_t res = fs_api_properties(dev, &p);
  if (res == ncclSuccess) {
    memset(props, 0, sizeof(*props));
    FS_FILL_COMMON_PROPS(props, p);
    props->maxMultiRequestSize = 1;
    props->railId = NCCL_NET_ID_UNDEF;
    props->planeId = NCCL_NET_ID_UNDEF;
  }
  return res;
}

static ncclResult_t fs_listen_v11(void* ctx, int dev, void* handle, void** listenComm) {
  if (ctx == NULL) {
    return ncclInternalError;
  }
  return fs_api_listen(ctx, dev, handle, listenComm);
}

static ncclResult_t fs_connect_v11(void* ctx, int dev, void* handle, void** sendComm,
                                   ncclNetDeviceHandle_t** sendDevComm) {
  (void)sendDevComm;
  if (ctx == NULL) {
    return ncclInternalError;
  }
  return fs_api_connect(ctx, dev, NCCL_NET_TRAFFIC_CLASS_UNDEF, handle, sendComm);
}

static ncclResult_t fs_finalize_v11(void* ctx) { return fs_api_finalize(ctx); }

static ncclResult_t fs_set_net_attr_v11(void* ctx, ncclNetAttr_v11_t* attr) {
  if (attr == NULL) {
    return ncclInternalError;
  }
  return fs_api_set_net_attr(ctx, attr->op, attr->algo, attr->proto);
}

/* ---- the TCP transport's tables (exports.c exports them, or the wrapper's) ------------------ */

const ncclNet_v10_t fs_tcp_net_v10 = {
    .name = FS_PLUGIN_NAME,
    .init = fs_init_v10,
    .devices = fs_devices,
    .getProperties = fs_get_properties_v10,
    .listen = fs_listen_v10,
    .connect = fs_connect_v10,
    .accept = fs_accept,
    .regMr = fs_reg_mr,
    .regMrDmaBuf = NULL,
    .deregMr = fs_dereg_mr,
    .isend = fs_isend,
    .irecv = fs_irecv,
    .iflush = fs_iflush,
    .test = fs_test,
    .closeSend = fs_close_comm,
    .closeRecv = fs_close_comm,
    .closeListen = fs_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL,
};

const ncclNet_v11_t fs_tcp_net_v11 = {
    .name = FS_PLUGIN_NAME,
    .init = fs_init_v11,
    .devices = fs_devices,
    .getProperties = fs_get_properties_v11,
    .listen = fs_listen_v11,
    .connect = fs_connect_v11,
    .accept = fs_accept,
    .regMr = fs_reg_mr,
    .regMrDmaBuf = NULL,
    .deregMr = fs_dereg_mr,
    .isend = fs_isend,
    .irecv = fs_irecv,
    .iflush = fs_iflush,
    .test = fs_test,
    .closeSend = fs_close_comm,
    .closeRecv = fs_close_comm,
    .closeListen = fs_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL,
    .finalize = fs_finalize_v11,
    .setNetAttr = fs_set_net_attr_v11,
};

const ncclNet_v12_t fs_tcp_net_v12 = {
    .name = FS_PLUGIN_NAME,
    .init = fs_init_v11,
    .devices = fs_devices,
    .getProperties = fs_get_properties_v12,
    .listen = fs_listen_v11,
    .connect = fs_connect_v11,
    .accept = fs_accept,
    .regMr = fs_reg_mr,
    .regMrDmaBuf = NULL,
    .deregMr = fs_dereg_mr,
    .isend = fs_isend,
    .irecv = fs_irecv,
    .iflush = fs_iflush,
    .test = fs_test,
    .closeSend = fs_close_comm,
    .closeRecv = fs_close_comm,
    .closeListen = fs_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL,
    .finalize = fs_finalize_v11,
    .setNetAttr = fs_set_net_attr_v11,
};
