/* SPDX-License-Identifier: Apache-2.0
 * Wrapping mode: NCCL -> flowsched -> the inner net plugin (FLOWSCHED_NET_INNER).
 *
 * Every call is forwarded with every argument; the wrapper adds three things:
 *  - each connection claims its slot in the node's flow table (class, commId, device, bytes);
 *  - the inner's trafficClass is the ToS byte of the connection's class's hardware queue
 *    (its level's DSCP in the table's config area), given at inner init (v11/v12: one inner
 *    context per traffic class), at connect (v10), or not at all (v8/v9, which have none);
 *  - isend asks the permit (permit.h) first, and is answered with a NULL request (NCCL
 *    retries) while more urgent sends of this process are in flight on the device.
 * Requests are boxed (so test can account bytes and release the permit); mhandles, handles,
 * device handles and the arrays of grouped receives pass through untouched. These functions
 * use the v12 calling convention; exports.c adapts each exported table version to them.
 */
#ifndef FLOWSCHED_WRAP_H
#define FLOWSCHED_WRAP_H

#include "nccl/net_v12.h"

struct fs_inner;

/* Load the inner plugin and set the wrapper up, once (0, or -errno). Later calls return the
 * first result. */
int fs_wrap_setup(ncclDebugLogger_t logger);
/* The loaded inner (valid after a successful setup). */
const struct fs_inner* fs_wrap_inner(void);

/* v11/v12: one context per communicator. */
ncclResult_t fs_wrap_init(void** ctx, uint64_t comm_id, int traffic_class,
                          ncclDebugLogger_t logger, ncclProfilerCallback_t prof);
/* v8..v10: the process-wide context (created by the first call). */
ncclResult_t fs_wrap_init_legacy(ncclDebugLogger_t logger, ncclProfilerCallback_t prof);
void* fs_wrap_legacy_ctx(void);
ncclResult_t fs_wrap_finalize(void* ctx);
ncclResult_t fs_wrap_devices(int* ndev);
ncclResult_t fs_wrap_get_properties(int dev, ncclNetProperties_v12_t* props);
ncclResult_t fs_wrap_listen(void* ctx, int dev, void* handle, void** listen_comm);
/* traffic_class: NCCL's, for this connection (v10's per-connect config), or FS_WRAP_TC_OF_CTX
 * for the context's (v11/v12 give it at init). */
#define FS_WRAP_TC_OF_CTX INT32_MIN
ncclResult_t fs_wrap_connect(void* ctx, int dev, int traffic_class, void* handle, void** send_comm,
                             ncclNetDeviceHandle_t** dev_comm);
ncclResult_t fs_wrap_accept(void* listen_comm, void** recv_comm, ncclNetDeviceHandle_t** dev_comm);
ncclResult_t fs_wrap_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
ncclResult_t fs_wrap_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset,
                                   int fd, void** mhandle);
ncclResult_t fs_wrap_dereg_mr(void* comm, void* mhandle);
ncclResult_t fs_wrap_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                           void* phandle, void** request);
ncclResult_t fs_wrap_irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                           void** mhandles, void** phandles, void** request);
ncclResult_t fs_wrap_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                            void** request);
ncclResult_t fs_wrap_test(void* request, int* done, int* sizes);
ncclResult_t fs_wrap_close_send(void* send_comm);
ncclResult_t fs_wrap_close_recv(void* recv_comm);
ncclResult_t fs_wrap_close_listen(void* listen_comm);
ncclResult_t fs_wrap_get_device_mr(void* comm, void* mhandle, void** dptr_mhandle);
ncclResult_t fs_wrap_irecv_consumed(void* recv_comm, int n, void* request);
ncclResult_t fs_wrap_make_vdevice(int* d, ncclNetVDeviceProps_v12_t* props);
ncclResult_t fs_wrap_set_net_attr(void* ctx, ncclNetAttr_v12_t* attr);

#endif
