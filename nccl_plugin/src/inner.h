/* SPDX-License-Identifier: Apache-2.0
 * The inner net plugin of the wrapping mode: dlopen, symbol probe, and one calling
 * convention whatever table version the inner exports.
 *
 * FLOWSCHED_NET_INNER is resolved like NCCL_NET_PLUGIN: the value as given (a path, or a file
 * name found through the library search path), then libnccl-net-<value>.so when the value has
 * no '/' and is not of the form lib*.so. The highest ncclNetPlugin_vN (12 down to 8) wins.
 *
 * The calling convention is v12's with two changes: init and connect carry the trafficClass
 * to use, because v10 takes it at connect, v11/v12 at init, and v8/v9 not at all. For inners
 * older than v11 (no context, no finalize), init is refcounted and the context is a constant
 * non-NULL marker, as NCCL's own compatibility shims do; the inner's init runs under a lock,
 * so a concurrent init waits for it, and only a successful one is counted.
 * Entries the inner lacks are NULL.
 * Argument conversion (size_t <-> int sizes of v8, property structs, vDevice props) happens
 * here; a size a v8 inner cannot carry is ncclInternalError, as in NCCL's v8 shim.
 */
#ifndef FLOWSCHED_INNER_H
#define FLOWSCHED_INNER_H

#include "nccl/net_v12.h"

/* The inner's init in that convention. Chosen when the library is loaded and never rewritten:
 * a communicator's init calls it without a lock while another one binds the entries below. */
typedef ncclResult_t (*fs_inner_init_fn)(void** ctx, uint64_t comm_id, int traffic_class,
                                         ncclDebugLogger_t logger, ncclProfilerCallback_t prof);

/* The other entries, bound after the inner's first successful init. */
struct fs_inner_ops {
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v12_t* props);
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(void* ctx, int dev, int traffic_class, void* handle, void** sendComm,
                          ncclNetDeviceHandle_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v12_t* props);
  ncclResult_t (*finalize)(void* ctx);
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_v12_t* attr);
};

struct fs_inner {
  void* lib;
  int version;       /* the table bound: 8..12 */
  const char* name;  /* the inner table's name (its own storage) */
  char path[512];    /* what dlopen opened */
  fs_inner_init_fn init;
  struct fs_inner_ops ops;
};

/* Load the inner plugin named by `spec` (0, or -errno with a message in err). */
int fs_inner_load(const char* spec, struct fs_inner* out, char* err, size_t errlen);
/* Companion plugin tables the inner library exports besides its net table (tuner, profiler,
 * GIN, RMA, collnet), as "name name ..." in out (empty when none). NCCL looks for those in the
 * net plugin library when NCCL_TUNER_PLUGIN / NCCL_PROFILER_PLUGIN / NCCL_GIN_PLUGIN are unset:
 * in wrapping mode that is our library, which exports none, so they are hidden unless the
 * user points those variables at the inner library. */
void fs_inner_companions(const struct fs_inner* inner, char* out, size_t cap);
/* dlclose it (after the last use). */
void fs_inner_unload(struct fs_inner* inner);

/* The fields every property version since v8 shares, copied between any two versions (the
 * wrapper converts the inner's properties to v12 and v12 back to what NCCL asked for). */
#define FS_COPY_V8_PROPS(out, in)               \
  do {                                          \
    (out)->name = (in)->name;                   \
    (out)->pciPath = (in)->pciPath;             \
    (out)->guid = (in)->guid;                   \
    (out)->ptrSupport = (in)->ptrSupport;       \
    (out)->regIsGlobal = (in)->regIsGlobal;     \
    (out)->speed = (in)->speed;                 \
    (out)->port = (in)->port;                   \
    (out)->latency = (in)->latency;             \
    (out)->maxComms = (in)->maxComms;           \
    (out)->maxRecvs = (in)->maxRecvs;           \
    (out)->netDeviceType = (in)->netDeviceType; \
    (out)->netDeviceVersion = (in)->netDeviceVersion; \
  } while (0)

#endif
