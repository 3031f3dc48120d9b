/* SPDX-License-Identifier: Apache-2.0 */
#include "api.h"

#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "context.h"
#include "flow_table.h"
#include "log.h"
#include "permit.h"
#include "transport.h"

/* Host buffers need no registration; every mhandle points here. */
static int fs_host_mr;

/* NCCL's error convention: SystemError for OS and network failures, InternalError for
 * misuse by NCCL, InvalidUsage for user or configuration errors, RemoteError when the peer
 * went away or cannot be reached. A connect that is still refused, timed out or unroutable
 * after its retries is a RemoteError, as in NCCL's own socket transport: the fault lies with
 * the peer (or the path to it), not with this process. */
static ncclResult_t result_of(int rc, const char* what) {
  if (rc >= 0) {
    return ncclSuccess;
  }
  ncclResult_t res = ncclSystemError;
  switch (-rc) {
    case EINVAL:
    case EFAULT:
    case EBADF:
      res = ncclInternalError;
      break;
    case EMSGSIZE:
    case ENODEV:
    case ENOTSUP:
      res = ncclInvalidUsage;
      break;
    case ECONNRESET:
    case EPIPE:
    case ECONNABORTED:
    case EPROTO:
    case ECONNREFUSED:
    case ETIMEDOUT:
    case EHOSTUNREACH:
    case ENETUNREACH:
      res = ncclRemoteError;
      break;
    default:
      break;
  }
  FS_WARN("%s failed: %s (ncclResult %d)", what, fs_errstr(-rc), (int)res);
  return res;
}

#define FS_REQUIRE(cond, what)                                     \
  do {                                                             \
    if (!(cond)) {                                                 \
      FS_WARN("%s: invalid argument (%s)", (what), #cond);         \
      return ncclInternalError;                                    \
    }                                                              \
  } while (0)

/* The permit for the TCP transport: host-side strict priority, off unless the policy file
 * ([gating] enabled = true) or FLOWSCHED_GATING=1 asks for it: the switch's queues usually do
 * the job. Set at every init (a new policy or reloaded knobs take effect there). */
static void gate_setup(void) {
  const struct fs_params* params = fs_global_params();
  /* The policy's [gating] is in the table's config area. A missing table is reported when
   * the first connection looks for it, as before; not here, at init. */
  if (params->table_path[0] != '\0' && access(params->table_path, F_OK) == 0) {
    fs_table_attach(params->table_path);
  }
  fs_gate_setup(params, 0);
}

ncclResult_t fs_api_init_v10(ncclDebugLogger_t logger) {
  struct fs_context* ctx = NULL;
  ncclResult_t res = result_of(fs_global_v10_context(logger, &ctx), "init");
  if (res == ncclSuccess) {
    gate_setup();
    FS_INFO(NCCL_INIT | NCCL_NET, "flowsched plugin initialised (API v10), %d device(s)",
            fs_global_device_count());
  }
  return res;
}

ncclResult_t fs_api_init_ctx(void** ctx, uint64_t comm_id, int traffic_class,
                             ncclDebugLogger_t logger) {
  FS_REQUIRE(ctx != NULL, "init");
  struct fs_context* c = NULL;
  ncclResult_t res = result_of(fs_context_create(comm_id, traffic_class, logger, &c), "init");
  *ctx = c;
  if (res == ncclSuccess) {
    gate_setup();
    FS_INFO(NCCL_INIT | NCCL_NET, "flowsched context for comm 0x%llx (trafficClass %d), %d device(s)",
            (unsigned long long)comm_id, traffic_class, fs_global_device_count());
  }
  return res;
}

ncclResult_t fs_api_finalize(void* ctx) {
  if (ctx == NULL) {
    return ncclSuccess; /* NCCL may finalize the NULL context of a failed init: nothing to do */
  }
  fs_context_finalize(ctx);
  return ncclSuccess;
}

ncclResult_t fs_api_devices(int* ndev) {
  FS_REQUIRE(ndev != NULL, "devices");
  *ndev = fs_global_device_count();
  return ncclSuccess;
}

ncclResult_t fs_api_properties(int dev, struct fs_props* props) {
  const struct fs_device* device = fs_global_device(dev);
  FS_REQUIRE(device != NULL && props != NULL, "getProperties");
  *props = (struct fs_props){
      .name = (char*)device->name,
      .pci_path = device->pci_path,
      .guid = (uint64_t)dev,
      .speed_mbps = device->speed_mbps,
      .port = 0,
      .max_comms = 65536,
      .max_recvs = 1,
      .max_p2p_bytes = (size_t)NCCL_MAX_NET_SIZE_BYTES,
      .max_coll_bytes = (size_t)NCCL_MAX_COLLNET_SIZE,
  };
  return ncclSuccess;
}

static int context_or_v10(void* ctx, struct fs_context** out) {
  if (ctx != NULL) {
    *out = ctx;
    return 0;
  }
  return fs_global_v10_context(NULL, out);
}

ncclResult_t fs_api_listen(void* ctx, int dev, void* handle, void** listen_comm) {
  FS_REQUIRE(handle != NULL && listen_comm != NULL, "listen");
  struct fs_context* c = NULL;
  struct fs_listen_comm* lcomm = NULL;
  int rc = context_or_v10(ctx, &c);
  if (rc == 0) {
    rc = fs_listen(c, dev, handle, &lcomm);
  }
  *listen_comm = lcomm;
  return result_of(rc, "listen");
}

ncclResult_t fs_api_connect(void* ctx, int dev, int traffic_class, void* handle, void** send_comm) {
  FS_REQUIRE(handle != NULL && send_comm != NULL, "connect");
  struct fs_context* c = NULL;
  struct fs_comm* comm = NULL;
  int rc = context_or_v10(ctx, &c);
  if (rc == 0) {
    int32_t tc = ctx != NULL ? c->traffic_class : traffic_class;
    rc = fs_connect(c, dev, tc, handle, &comm);
  }
  *send_comm = comm;
  return result_of(rc, "connect");
}

ncclResult_t fs_api_accept(void* listen_comm, void** recv_comm) {
  FS_REQUIRE(listen_comm != NULL && recv_comm != NULL, "accept");
  struct fs_comm* comm = NULL;
  int rc = fs_accept(listen_comm, &comm);
  *recv_comm = comm;
  return result_of(rc, "accept");
}

ncclResult_t fs_api_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  (void)data;
  (void)size;
  FS_REQUIRE(comm != NULL && mhandle != NULL, "regMr");
  if (type != NCCL_PTR_HOST) {
    FS_WARN("regMr: only host memory is supported (type %d)", type);
    return ncclInternalError;
  }
  *mhandle = &fs_host_mr;
  return ncclSuccess;
}

ncclResult_t fs_api_dereg_mr(void* comm, void* mhandle) {
  FS_REQUIRE(comm != NULL && mhandle == &fs_host_mr, "deregMr");
  return ncclSuccess;
}

ncclResult_t fs_api_isend(void* send_comm, void* data, size_t size, int tag, void** request) {
  FS_REQUIRE(request != NULL, "isend");
  *request = NULL;
  FS_REQUIRE(send_comm != NULL && (data != NULL || size == 0), "isend");
  struct fs_comm* comm = send_comm;
  FS_REQUIRE(comm->is_send, "isend");
  int gated = fs_gate_enabled();
  uint32_t level = 0;
  if (gated) {
    fs_comm_poll_level(comm); /* the level the agent wants now (a promotion lifts a deferral) */
    level = atomic_load_explicit(&comm->flow.slot->applied_level, memory_order_relaxed);
    if (!fs_gate_permit(&comm->gate, comm->dev, level)) {
      return ncclSuccess; /* deferred: NCCL retries with the same arguments */
    }
  }
  struct fs_request* req = NULL;
  int rc = fs_isend(send_comm, data, size, tag, &req);
  if (rc == 0 && req != NULL) {
    req->gate_level = gated ? (int32_t)level : -1;
    if (gated) {
      fs_gate_started(&comm->gate, comm->dev, level, size);
    }
  }
  *request = req;
  return result_of(rc, "isend");
}

ncclResult_t fs_api_irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                          void** request) {
  FS_REQUIRE(request != NULL, "irecv");
  *request = NULL; /* always written: NCCL may preset it to 0x1 */
  FS_REQUIRE(recv_comm != NULL && data != NULL && sizes != NULL, "irecv");
  FS_REQUIRE(!((struct fs_comm*)recv_comm)->is_send, "irecv");
  if (n != 1) {
    FS_WARN("irecv: grouped receives are not supported (n=%d, maxRecvs=1)", n);
    return ncclInternalError;
  }
  FS_REQUIRE(data[0] != NULL || sizes[0] == 0, "irecv");
  struct fs_request* req = NULL;
  int rc = fs_irecv(recv_comm, data[0], sizes[0], tags != NULL ? tags[0] : -1, &req);
  *request = req;
  return result_of(rc, "irecv");
}

ncclResult_t fs_api_iflush(void* recv_comm, int n, void** request) {
  (void)recv_comm;
  (void)n;
  if (request != NULL) {
    *request = NULL;
  }
  FS_WARN("iflush called on a host-memory plugin");
  return ncclInternalError;
}

ncclResult_t fs_api_test(void* request, int* done, int* sizes) {
  FS_REQUIRE(request != NULL && done != NULL, "test");
  struct fs_request* req = request;
  struct fs_comm* comm = req->comm;
  int32_t gate_level = comm->is_send ? req->gate_level : -1; /* read before the slot is reused */
  size_t size = 0;
  int rc = fs_test(request, done, &size);
  if (gate_level >= 0 && (rc < 0 || *done)) {
    req->gate_level = -1;
    fs_gate_done(comm->dev, (uint32_t)gate_level); /* it no longer holds less urgent sends */
  }
  if (rc == 0 && *done && sizes != NULL) {
    *sizes = size > (size_t)INT32_MAX ? INT32_MAX : (int)size;
  }
  return result_of(rc, "test");
}

/* Sends NCCL never tested to completion (ncclCommAbort and error paths close a comm with
 * requests in flight) give their permits back: otherwise their level stays "in flight" on the
 * device for the rest of the process and defers every less urgent send there. */
static void gate_release_outstanding(struct fs_comm* comm) {
  if (!comm->is_send) {
    return;
  }
  for (int i = 0; i < FS_MAX_REQUESTS; i++) {
    struct fs_request* req = &comm->reqs[i];
    if (req->in_use && req->gate_level >= 0) {
      fs_gate_done(comm->dev, (uint32_t)req->gate_level);
      req->gate_level = -1;
    }
  }
}

ncclResult_t fs_api_close_comm(void* comm) {
  if (comm == NULL) {
    return ncclSuccess;
  }
  gate_release_outstanding(comm);
  return result_of(fs_close_comm(comm), "close");
}

ncclResult_t fs_api_close_listen(void* listen_comm) {
  if (listen_comm == NULL) {
    return ncclSuccess;
  }
  return result_of(fs_close_listen(listen_comm), "closeListen");
}

ncclResult_t fs_api_set_net_attr(void* ctx, uint32_t op, uint32_t algo, uint32_t proto) {
  FS_REQUIRE(ctx != NULL, "setNetAttr");
  fs_context_set_net_attr(ctx, op, algo, proto);
  return ncclSuccess;
}
