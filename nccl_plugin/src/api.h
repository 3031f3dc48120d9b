/* SPDX-License-Identifier: Apache-2.0
 * The API boundary: the only functions that return ncclResult_t. They check arguments,
 * call the transport, and map its -errno results to NCCL's codes (logging each failure
 * through NCCL's logger). The per-version adapters in interface_nccl.c call only these. */
#ifndef FLOWSCHED_API_H
#define FLOWSCHED_API_H

#include <stddef.h>
#include <stdint.h>

#include "nccl/common.h"

/* Version-independent device properties. */
struct fs_props {
  char* name;
  char* pci_path;
  uint64_t guid;
  int speed_mbps;
  int port;
  int max_comms;
  int max_recvs;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
};

ncclResult_t fs_api_init_v10(ncclDebugLogger_t logger);
ncclResult_t fs_api_init_ctx(void** ctx, uint64_t comm_id, int traffic_class,
                             ncclDebugLogger_t logger);
ncclResult_t fs_api_finalize(void* ctx);
ncclResult_t fs_api_devices(int* ndev);
ncclResult_t fs_api_properties(int dev, struct fs_props* props);
/* ctx NULL: the v10 process-wide context. */
ncclResult_t fs_api_listen(void* ctx, int dev, void* handle, void** listen_comm);
ncclResult_t fs_api_connect(void* ctx, int dev, int traffic_class, void* handle, void** send_comm);
ncclResult_t fs_api_accept(void* listen_comm, void** recv_comm);
ncclResult_t fs_api_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
ncclResult_t fs_api_dereg_mr(void* comm, void* mhandle);
ncclResult_t fs_api_isend(void* send_comm, void* data, size_t size, int tag, void** request);
ncclResult_t fs_api_irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                          void** request);
ncclResult_t fs_api_iflush(void* recv_comm, int n, void** request);
ncclResult_t fs_api_test(void* request, int* done, int* sizes);
ncclResult_t fs_api_close_comm(void* comm);
ncclResult_t fs_api_close_listen(void* listen_comm);
ncclResult_t fs_api_set_net_attr(void* ctx, uint32_t op, uint32_t algo, uint32_t proto);

#endif
