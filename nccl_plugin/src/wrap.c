/* SPDX-License-Identifier: Apache-2.0 */
#include "wrap.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "class_defaults.h"
#include "context.h"
#include "flow_table.h"
#include "inner.h"
#include "log.h"
#include "param.h"
#include "permit.h"

#define FS_WRAP_MAX_INNER_CTX 8 /* traffic classes per communicator (one per class at most) */
#define FS_WRAP_REQ_BLOCK 32

/* A connect in progress: NCCL's handle buffer (the same on every retry) and the inner
 * trafficClass its first call chose, which every retry keeps. */
struct fs_wrap_pending {
  void* handle;
  int inner_tc;
};

struct fs_wrap_ctx {
  uint64_t comm_id;
  int32_t traffic_class; /* NCCL's (v11/v12 init; UNDEF for the legacy context) */
  atomic_int refs;       /* owner + listen comms + connections + connects in progress */
  pthread_mutex_t lock;  /* inner contexts, pending handles, the attribute below */
  int ninner;
  struct {
    int traffic_class;
    void* ctx;
  } inner[FS_WRAP_MAX_INNER_CTX];
  struct fs_wrap_pending* pending; /* connects in progress (grown on demand) */
  int npending, pending_cap;
  uint32_t net_op, net_algo, net_proto; /* latest setNetAttr: stamped on the next connection */
  ncclNetAttr_v12_t net_attr;           /* that setNetAttr whole, for inner contexts made later */
  int have_net_attr;
  /* FLOWSCHED_CLASS as it was at this communicator's init (v11/v12). The legacy context
   * (v8-v10: one for the whole process) reads it again at each listen and connect, i.e.
   * while NCCL sets up the communicator the connection belongs to. */
  char class_name[32];
  int legacy;
  /* What NCCL gave the init that created this context, for every later inner init (an inner
   * may keep the logger per context and call it unchecked, as IBext's v11 init does). */
  ncclDebugLogger_t logger;
  ncclProfilerCallback_t prof;
};

struct fs_wrap_listen {
  void* inner;
  struct fs_wrap_ctx* ctx;
  int dev;
  char class_name[32]; /* the class name of the connections it accepts */
};

struct fs_wrap_comm;

enum fs_wrap_req_kind { FS_REQ_SEND = 0, FS_REQ_RECV = 1, FS_REQ_FLUSH = 2 };

struct fs_wrap_req {
  void* inner;
  struct fs_wrap_comm* comm;
  size_t bytes; /* send: message size */
  uint32_t level;
  int n;
  int kind;
  int done; /* recv: test reported done, waiting for irecvConsumed */
  struct fs_wrap_req* next_free;
};

struct fs_wrap_req_block {
  struct fs_wrap_req_block* next;
  struct fs_wrap_req reqs[FS_WRAP_REQ_BLOCK];
};

struct fs_wrap_comm {
  void* inner;
  int is_send;
  int dev;
  struct fs_wrap_ctx* ctx;
  uint32_t level; /* effective level, re-read on every isend */
  struct fs_flow flow;
  struct fs_gate_conn gate;
  struct fs_wrap_req* free_reqs; /* touched by NCCL's progress thread only */
  struct fs_wrap_req_block* blocks;
  int peer_known; /* recv: the slot's peer_rank was set from the first irecv tag */
};

static struct {
  pthread_mutex_t lock;
  int state; /* 0 = not set up, 1 = ready, < 0 = -errno of the failed setup */
  struct fs_inner inner;
  struct fs_params params;
  struct fs_wrap_ctx* legacy;
  atomic_int live_ctxs; /* contexts allocated, the legacy one included (fs_wrap_unload) */
  atomic_int warned_class;
} fs_wrap = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* ---- setup -------------------------------------------------------------------------------- */

int fs_wrap_setup(ncclDebugLogger_t logger) {
  fs_log_set_logger(logger);
  pthread_mutex_lock(&fs_wrap.lock);
  if (fs_wrap.state == 0) {
    fs_params_load(&fs_wrap.params);
    char err[768];
    int rc = -ENAMETOOLONG;
    if (fs_wrap.params.net_inner[0] == '\0') { /* set, but longer than the knob holds */
      snprintf(err, sizeof(err), "longer than %zu bytes", sizeof(fs_wrap.params.net_inner) - 1);
    } else {
      rc = fs_inner_load(fs_wrap.params.net_inner, &fs_wrap.inner, err, sizeof(err));
    }
    if (rc < 0) {
      FS_WARN("FLOWSCHED_NET_INNER=%s: cannot load the inner net plugin: %s",
              fs_wrap.params.net_inner, err);
      fs_wrap.state = rc;
    } else {
      FS_INFO(NCCL_INIT | NCCL_NET, "wrapping inner net plugin %s (ncclNetPlugin_v%d) from %s",
              fs_wrap.inner.name, fs_wrap.inner.version, fs_wrap.inner.path);
      char companions[256];
      fs_inner_companions(&fs_wrap.inner, companions, sizeof(companions));
      if (companions[0] != '\0') {
        /* NCCL looks for these in the net plugin library, i.e. ours, which has none. */
        FS_WARN("%s also exports %s, which NCCL does not see through flowsched: set "
                "NCCL_TUNER_PLUGIN / NCCL_PROFILER_PLUGIN / NCCL_GIN_PLUGIN to %s to use them "
                "(collnet is not wrapped)", fs_wrap.inner.path, companions, fs_wrap.inner.path);
      }
      fs_wrap.state = 1;
    }
  }
  int state = fs_wrap.state;
  pthread_mutex_unlock(&fs_wrap.lock);
  return state < 0 ? state : 0;
}

const struct fs_inner* fs_wrap_inner(void) {
  return &fs_wrap.inner;
}

static void wrap_ctx_free(struct fs_wrap_ctx* ctx);

/* On dlclose (NCCL 2.27+ unloads after the last communicator): finalize what is left and
 * unload the inner. The destructor also runs at exit(), possibly with communicators alive and
 * NCCL's proxy threads still calling isend/test through us into the inner: unloading the
 * inner or unmapping the table under them would crash the exit. Every connection, listen comm
 * and connect in progress holds a reference on its context, so while a context other than an
 * unused legacy one is alive, everything stays as it is (the kernel reclaims it). */
__attribute__((destructor)) static void fs_wrap_unload(void) {
  pthread_mutex_lock(&fs_wrap.lock);
  struct fs_wrap_ctx* legacy = fs_wrap.legacy;
  int live = atomic_load(&fs_wrap.live_ctxs) > (legacy != NULL) ||
             (legacy != NULL && atomic_load_explicit(&legacy->refs, memory_order_acquire) > 1);
  if (live) {
    pthread_mutex_unlock(&fs_wrap.lock);
    return;
  }
  if (legacy != NULL) {
    wrap_ctx_free(legacy);
    fs_wrap.legacy = NULL;
  }
  if (fs_wrap.state == 1) {
    struct fs_gate_stats st;
    fs_gate_stats(&st);
    FS_INFO(NCCL_NET, "permit: %llu sends, %llu deferrals, guard share %llu, guard age %llu, "
            "longest wait %llu us", (unsigned long long)st.permits,
            (unsigned long long)st.deferrals, (unsigned long long)st.guard_share,
            (unsigned long long)st.guard_age, (unsigned long long)(st.max_wait_ns / 1000));
    fs_table_detach();
    fs_inner_unload(&fs_wrap.inner);
  }
  fs_wrap.state = 0;
  pthread_mutex_unlock(&fs_wrap.lock);
}

/* ---- classes and traffic classes ------------------------------------------------------------ */

/* Map the node's table if it is not mapped yet (the agent may start after the job). At init
 * only an existing file is attached; a missing one is reported by the first connection, as
 * in transport mode. */
static void table_attach(int connection) {
  const char* path = fs_wrap.params.table_path;
  if (path[0] != '\0' && (connection || access(path, F_OK) == 0)) {
    fs_table_attach(path);
  }
}

/* FLOWSCHED_CLASS for a connection being set up now on `ctx`: the value at the
 * communicator's init (v11/v12), or the current one for the process-wide legacy context. The
 * legacy read (listen/connect, on NCCL's service thread) is the documented per-communicator
 * class of v8-v10 and stays; as with NCCL's own getenv calls, a setenv on another thread
 * meanwhile is the caller's race (see context.c, fs_class_resolve). */
static void ctx_class_name(const struct fs_wrap_ctx* ctx, char* out, size_t cap) {
  if (ctx->legacy) {
    fs_param_peek("FLOWSCHED_CLASS", out, cap);
  } else {
    snprintf(out, cap, "%s", ctx->class_name);
  }
}

static uint16_t wrap_class(int32_t traffic_class, const char* class_name,
                           struct fs_table_config* cfg) {
  fs_table_config(cfg);
  int cls = fs_table_class_for_traffic_class(cfg, traffic_class);
  if (cls < 0 && class_name[0] != '\0') {
    cls = fs_class_parse(class_name);
    if (cls < 0) {
      FS_WARN_ONCE(fs_wrap.warned_class, "FLOWSCHED_CLASS=%s is not a flow class; using tp",
                   class_name);
    }
  }
  if (cls < 0) {
    cls = cfg->from_table && cfg->fallback_class < FS_TABLE_MAX_CLASSES ? (int)cfg->fallback_class
                                                                       : FS_CLASS_TP;
  }
  return (uint16_t)cls;
}

/* The inner's trafficClass for a connection of NCCL trafficClass `nccl_tc`: the ToS byte of its
 * class's default level (the hardware queue the policy gives the class), or NCCL's value. */
static int inner_traffic_class(int32_t nccl_tc, const char* class_name) {
  if (!fs_wrap.params.inner_tc) {
    return nccl_tc;
  }
  struct fs_table_config cfg;
  uint16_t cls = wrap_class(nccl_tc, class_name, &cfg);
  uint32_t level = cls < FS_TABLE_MAX_CLASSES ? cfg.default_level[cls] : 0;
  if (level >= cfg.num_levels) {
    level = cfg.num_levels - 1;
  }
  return (int)(cfg.level_marking[level].dscp & 0x3f) << 2;
}

/* ---- contexts -------------------------------------------------------------------------------- */

static struct fs_wrap_ctx* wrap_ctx_new(uint64_t comm_id, int32_t traffic_class,
                                        ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  struct fs_wrap_ctx* ctx = calloc(1, sizeof(*ctx));
  if (ctx != NULL) {
    ctx->comm_id = comm_id;
    ctx->traffic_class = traffic_class;
    ctx->logger = logger;
    ctx->prof = prof;
    atomic_init(&ctx->refs, 1);
    pthread_mutex_init(&ctx->lock, NULL);
    atomic_fetch_add(&fs_wrap.live_ctxs, 1);
  }
  return ctx;
}

static void wrap_ctx_free(struct fs_wrap_ctx* ctx) {
  atomic_fetch_sub(&fs_wrap.live_ctxs, 1);
  for (int i = 0; i < ctx->ninner; i++) {
    if (fs_wrap.inner.ops.finalize != NULL) {
      fs_wrap.inner.ops.finalize(ctx->inner[i].ctx);
    }
  }
  pthread_mutex_destroy(&ctx->lock);
  free(ctx->pending);
  free(ctx);
}

static void wrap_ctx_retain(struct fs_wrap_ctx* ctx) {
  atomic_fetch_add_explicit(&ctx->refs, 1, memory_order_relaxed);
}

/* The last reference finalizes the inner contexts: nothing of ours uses them any more. */
static void wrap_ctx_release(struct fs_wrap_ctx* ctx) {
  if (atomic_fetch_sub_explicit(&ctx->refs, 1, memory_order_acq_rel) == 1) {
    wrap_ctx_free(ctx);
  }
}

/* The inner context that carries `tc` (created on first use; v11/v12 take the class at init). */
static ncclResult_t inner_ctx_for(struct fs_wrap_ctx* ctx, int tc, void** out) {
  ncclResult_t res = ncclSuccess;
  pthread_mutex_lock(&ctx->lock);
  int i = 0;
  while (i < ctx->ninner && ctx->inner[i].traffic_class != tc) {
    i++;
  }
  if (i == ctx->ninner) {
    if (i == FS_WRAP_MAX_INNER_CTX) {
      i = 0; /* more classes than slots: share the first context */
    } else {
      void* ictx = NULL;
      res = fs_wrap.inner.init(&ictx, ctx->comm_id, tc, ctx->logger, ctx->prof);
      if (res == ncclSuccess) {
        ctx->inner[i].traffic_class = tc;
        ctx->inner[i].ctx = ictx;
        ctx->ninner++;
        /* NCCL gave its hint before the connect that makes this context: the inner sees it
         * before that connect, as the contexts that already existed did */
        if (ctx->have_net_attr && fs_wrap.inner.ops.setNetAttr != NULL) {
          res = fs_wrap.inner.ops.setNetAttr(ictx, &ctx->net_attr);
        }
      }
    }
  }
  *out = res == ncclSuccess ? ctx->inner[i].ctx : NULL;
  pthread_mutex_unlock(&ctx->lock);
  return res;
}

static ncclResult_t setup_result(ncclDebugLogger_t logger) {
  int rc = fs_wrap_setup(logger);
  if (rc == 0) {
    return ncclSuccess;
  }
  return rc == -ENOENT || rc == -ELOOP || rc == -ENAMETOOLONG ? ncclInvalidUsage : ncclSystemError;
}

/* A new context with its first inner context (the inner's init result is NCCL's). */
static ncclResult_t wrap_ctx_create(uint64_t comm_id, int32_t nccl_tc, ncclDebugLogger_t logger,
                                    ncclProfilerCallback_t prof, struct fs_wrap_ctx** out) {
  *out = NULL;
  ncclResult_t res = setup_result(logger);
  if (res != ncclSuccess) {
    return res;
  }
  table_attach(0);
  fs_gate_setup(&fs_wrap.params, 1); /* per communicator (the policy may change); on by default */
  struct fs_wrap_ctx* ctx = wrap_ctx_new(comm_id, nccl_tc, logger, prof);
  if (ctx == NULL) {
    return ncclSystemError;
  }
  /* Per communicator: flowsched.torch.new_group sets FLOWSCHED_CLASS around the creation of
   * a group where NCCL has no per-communicator trafficClass. */
  fs_param_peek("FLOWSCHED_CLASS", ctx->class_name, sizeof(ctx->class_name));
  int tc = inner_traffic_class(nccl_tc, ctx->class_name);
  void* ictx = NULL;
  res = fs_wrap.inner.init(&ictx, comm_id, tc, ctx->logger, ctx->prof);
  if (res != ncclSuccess) {
    FS_WARN("inner net plugin %s: init failed (ncclResult %d)", fs_wrap.inner.name, (int)res);
    wrap_ctx_free(ctx); /* no inner context yet: nothing to finalize */
    return res;
  }
  ctx->inner[0].traffic_class = tc;
  ctx->inner[0].ctx = ictx;
  ctx->ninner = 1;
  *out = ctx;
  FS_INFO(NCCL_INIT | NCCL_NET,
          "flowsched over %s (v%d): comm 0x%llx trafficClass %d, inner trafficClass %d",
          fs_wrap.inner.name, fs_wrap.inner.version, (unsigned long long)comm_id, nccl_tc, tc);
  return ncclSuccess;
}

ncclResult_t fs_wrap_init(void** ctx, uint64_t comm_id, int traffic_class,
                          ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  if (ctx == NULL) {
    return ncclInternalError;
  }
  struct fs_wrap_ctx* c = NULL;
  ncclResult_t res = wrap_ctx_create(comm_id, traffic_class, logger, prof, &c);
  *ctx = c;
  return res;
}

ncclResult_t fs_wrap_init_legacy(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  pthread_mutex_lock(&fs_wrap.lock);
  int have = fs_wrap.legacy != NULL;
  pthread_mutex_unlock(&fs_wrap.lock);
  if (have) {
    return ncclSuccess;
  }
  struct fs_wrap_ctx* c = NULL;
  ncclResult_t res = wrap_ctx_create(0, NCCL_NET_TRAFFIC_CLASS_UNDEF, logger, prof, &c);
  if (res != ncclSuccess) {
    return res;
  }
  pthread_mutex_lock(&fs_wrap.lock);
  if (fs_wrap.legacy == NULL) {
    c->legacy = 1;
    fs_wrap.legacy = c;
    c = NULL;
  }
  pthread_mutex_unlock(&fs_wrap.lock);
  if (c != NULL) {
    wrap_ctx_free(c); /* another thread won the race */
  }
  return ncclSuccess;
}

void* fs_wrap_legacy_ctx(void) {
  return fs_wrap.legacy;
}

ncclResult_t fs_wrap_finalize(void* ctx) {
  if (ctx == NULL) {
    return ncclSuccess; /* after a failed init */
  }
  wrap_ctx_release(ctx);
  return ncclSuccess;
}

ncclResult_t fs_wrap_devices(int* ndev) {
  return fs_wrap.inner.ops.devices(ndev);
}

ncclResult_t fs_wrap_get_properties(int dev, ncclNetProperties_v12_t* props) {
  return fs_wrap.inner.ops.getProperties(dev, props);
}

ncclResult_t fs_wrap_make_vdevice(int* d, ncclNetVDeviceProps_v12_t* props) {
  return fs_wrap.inner.ops.makeVDevice(d, props);
}

ncclResult_t fs_wrap_set_net_attr(void* ctx, ncclNetAttr_v12_t* attr) {
  struct fs_wrap_ctx* c = ctx;
  if (c == NULL || attr == NULL) {
    return ncclInternalError;
  }
  ncclResult_t res = ncclSuccess;
  pthread_mutex_lock(&c->lock);
  c->net_op = attr->op;
  c->net_algo = attr->algo;
  c->net_proto = attr->proto;
  c->net_attr = *attr;
  c->have_net_attr = 1;
  for (int i = 0; i < c->ninner && res == ncclSuccess; i++) {
    if (fs_wrap.inner.ops.setNetAttr != NULL) {
      res = fs_wrap.inner.ops.setNetAttr(c->inner[i].ctx, attr);
    }
  }
  pthread_mutex_unlock(&c->lock);
  return res;
}

/* ---- connections ------------------------------------------------------------------------------ */

static void comm_update_level(struct fs_wrap_comm* comm) {
  uint32_t raw;
  if (fs_flow_level_changed(&comm->flow, &raw)) {
    struct fs_level_marking marking;
    uint32_t config_seq = FS_CONFIG_SEQ_NONE;
    uint32_t level = fs_flow_effective_level(&comm->flow, raw, &marking, &config_seq);
    int record = raw != comm->flow.seen_level || level != comm->level;
    comm->flow.seen_level = raw;
    comm->flow.seen_config_seq = config_seq;
    comm->flow.marking = marking;
    comm->level = level;
    if (record) {
      fs_flow_applied(&comm->flow, level);
    }
  }
}

static struct fs_wrap_comm* comm_new(struct fs_wrap_ctx* ctx, void* inner, int is_send, int dev,
                                     int32_t nccl_tc, const char* class_name) {
  struct fs_wrap_comm* comm = calloc(1, sizeof(*comm));
  if (comm == NULL) {
    return NULL;
  }
  struct fs_table_config cfg;
  table_attach(1);
  pthread_mutex_lock(&ctx->lock);
  /* peer_rank: unknown (-1) here. A receive connection learns it from its first irecv tag
   * (NCCL's irecv tag is the remote sender's rank). A send connection keeps -1: NCCL's isend
   * tag is our own rank, and the wrapper cannot add a rank note to the inner plugin's wire. */
  struct fs_flow_info info = {
      .comm_id = ctx->comm_id,
      .peer_rank = -1,
      .traffic_class = nccl_tc,
      .class_id = wrap_class(nccl_tc, class_name, &cfg),
      .direction = is_send ? FS_DIR_SEND : FS_DIR_RECV,
      .dev = (uint32_t)dev,
      .net_op = ctx->net_op,
      .net_algo = ctx->net_algo,
      .net_proto = ctx->net_proto,
  };
  pthread_mutex_unlock(&ctx->lock);
  comm->inner = inner;
  comm->is_send = is_send;
  comm->dev = dev;
  comm->ctx = ctx;
  wrap_ctx_retain(ctx);
  fs_flow_open(&comm->flow, &info);
  comm->level = UINT32_MAX;
  comm_update_level(comm);
  return comm;
}

static void comm_free(struct fs_wrap_comm* comm) {
  fs_flow_close(&comm->flow);
  while (comm->blocks != NULL) {
    struct fs_wrap_req_block* next = comm->blocks->next;
    free(comm->blocks);
    comm->blocks = next;
  }
  struct fs_wrap_ctx* ctx = comm->ctx;
  free(comm);
  wrap_ctx_release(ctx);
}

ncclResult_t fs_wrap_listen(void* ctx, int dev, void* handle, void** listen_comm) {
  struct fs_wrap_ctx* c = ctx;
  if (c == NULL || listen_comm == NULL) {
    return ncclInternalError;
  }
  *listen_comm = NULL;
  char class_name[32];
  ctx_class_name(c, class_name, sizeof(class_name));
  void* ictx = NULL;
  ncclResult_t res = inner_ctx_for(c, inner_traffic_class(c->traffic_class, class_name), &ictx);
  struct fs_wrap_listen* l = res == ncclSuccess ? calloc(1, sizeof(*l)) : NULL;
  if (res != ncclSuccess || l == NULL) {
    return res != ncclSuccess ? res : ncclSystemError;
  }
  memcpy(l->class_name, class_name, sizeof(l->class_name));
  res = fs_wrap.inner.ops.listen(ictx, dev, handle, &l->inner);
  if (res != ncclSuccess || l->inner == NULL) {
    free(l);
    return res != ncclSuccess ? res : ncclInternalError;
  }
  l->ctx = c;
  l->dev = dev;
  wrap_ctx_retain(c);
  *listen_comm = l;
  return ncclSuccess;
}

/* NCCL's handle buffers of the connects in progress on a context: each holds a context
 * reference, so a finalize during the retries never frees what the next retry reads. The set
 * grows with the connects (NCCL may have one per peer and channel in progress at once): a
 * connect that held no reference would be a use-after-free waiting for a finalize. */
static int pending_find(const struct fs_wrap_ctx* ctx, const void* handle) {
  int i = 0;
  while (i < ctx->npending && ctx->pending[i].handle != handle) {
    i++;
  }
  return i < ctx->npending ? i : -1;
}

/* Hold a reference for `handle` before the inner sees it (a retry already holds one), and
 * pin the connect's inner trafficClass: a retry gets its first call's in *inner_tc. The class
 * queue's DSCP may change between retries (the agent starts, or rewrites its config), and the
 * inner must finish a handshake on the context and with the trafficClass it began with.
 * 0, or -ENOMEM when the set cannot grow: the connect is then refused, never run unguarded. */
static int pending_hold(struct fs_wrap_ctx* ctx, void* handle, int* inner_tc) {
  int rc = 0;
  pthread_mutex_lock(&ctx->lock);
  int i = pending_find(ctx, handle);
  if (i >= 0) {
    *inner_tc = ctx->pending[i].inner_tc;
  } else {
    if (ctx->npending == ctx->pending_cap) {
      int cap = ctx->pending_cap > 0 ? 2 * ctx->pending_cap : 16;
      struct fs_wrap_pending* grown = realloc(ctx->pending, (size_t)cap * sizeof(*grown));
      if (grown != NULL) {
        ctx->pending = grown;
        ctx->pending_cap = cap;
      }
    }
    if (ctx->npending < ctx->pending_cap) {
      ctx->pending[ctx->npending++] = (struct fs_wrap_pending){.handle = handle,
                                                                .inner_tc = *inner_tc};
      wrap_ctx_retain(ctx);
    } else {
      rc = -ENOMEM;
    }
  }
  pthread_mutex_unlock(&ctx->lock);
  return rc;
}

/* The connect of `handle` is over (done or failed): drop its reference. */
static void pending_drop(struct fs_wrap_ctx* ctx, void* handle) {
  pthread_mutex_lock(&ctx->lock);
  int i = pending_find(ctx, handle);
  if (i >= 0) {
    ctx->pending[i] = ctx->pending[--ctx->npending];
  }
  pthread_mutex_unlock(&ctx->lock);
  if (i >= 0) {
    wrap_ctx_release(ctx);
  }
}

ncclResult_t fs_wrap_connect(void* ctx, int dev, int traffic_class, void* handle, void** send_comm,
                             ncclNetDeviceHandle_t** dev_comm) {
  struct fs_wrap_ctx* c = ctx;
  if (c == NULL || send_comm == NULL || handle == NULL) {
    return ncclInternalError;
  }
  *send_comm = NULL;
  if (traffic_class == FS_WRAP_TC_OF_CTX) {
    traffic_class = c->traffic_class;
  }
  char class_name[32];
  ctx_class_name(c, class_name, sizeof(class_name));
  int tc = inner_traffic_class(traffic_class, class_name);
  if (pending_hold(c, handle, &tc) != 0) {
    FS_WARN("connect: out of memory for the context reference of a connect in progress; "
            "refusing the connect");
    return ncclSystemError;
  }
  void* ictx = NULL;
  ncclResult_t res = inner_ctx_for(c, tc, &ictx);
  void* inner = NULL;
  if (res == ncclSuccess) {
    res = fs_wrap.inner.ops.connect(ictx, dev, tc, handle, &inner, dev_comm);
  }
  if (res != ncclSuccess || inner == NULL) {
    if (res != ncclSuccess) {
      pending_drop(c, handle);
    }
    return res;
  }
  struct fs_wrap_comm* comm = comm_new(c, inner, 1, dev, traffic_class, class_name);
  pending_drop(c, handle); /* after comm_new: the connection holds its own reference now */
  if (comm == NULL) {
    fs_wrap.inner.ops.closeSend(inner);
    return ncclSystemError;
  }
  *send_comm = comm;
  return ncclSuccess;
}

ncclResult_t fs_wrap_accept(void* listen_comm, void** recv_comm, ncclNetDeviceHandle_t** dev_comm) {
  struct fs_wrap_listen* l = listen_comm;
  if (l == NULL || recv_comm == NULL) {
    return ncclInternalError;
  }
  *recv_comm = NULL;
  void* inner = NULL;
  ncclResult_t res = fs_wrap.inner.ops.accept(l->inner, &inner, dev_comm);
  if (res != ncclSuccess || inner == NULL) {
    return res;
  }
  struct fs_wrap_comm* comm =
      comm_new(l->ctx, inner, 0, l->dev, l->ctx->traffic_class, l->class_name);
  if (comm == NULL) {
    fs_wrap.inner.ops.closeRecv(inner);
    return ncclSystemError;
  }
  *recv_comm = comm;
  return ncclSuccess;
}

ncclResult_t fs_wrap_close_listen(void* listen_comm) {
  struct fs_wrap_listen* l = listen_comm;
  if (l == NULL) {
    return ncclSuccess;
  }
  ncclResult_t res = fs_wrap.inner.ops.closeListen(l->inner);
  struct fs_wrap_ctx* ctx = l->ctx;
  free(l);
  wrap_ctx_release(ctx);
  return res;
}

/* Sends NCCL never tested to completion (ncclCommAbort and error paths close a comm with
 * requests in flight): give their permits back, or their level would stay "in flight" on
 * the device for the rest of the process and defer every less urgent send there. A box is
 * outstanding while it holds an inner request; a send whose test failed was already
 * released (its kind became FS_REQ_FLUSH). */
static void comm_release_sends(struct fs_wrap_comm* comm) {
  for (struct fs_wrap_req_block* b = comm->blocks; b != NULL; b = b->next) {
    for (int i = 0; i < FS_WRAP_REQ_BLOCK; i++) {
      struct fs_wrap_req* req = &b->reqs[i];
      if (req->inner != NULL && req->kind == FS_REQ_SEND) {
        fs_gate_done(comm->dev, req->level);
        req->inner = NULL;
      }
    }
  }
}

static ncclResult_t close_comm(struct fs_wrap_comm* comm, ncclResult_t (*inner_close)(void*)) {
  if (comm == NULL) {
    return ncclSuccess;
  }
  ncclResult_t res = inner_close(comm->inner);
  comm_release_sends(comm); /* after the inner close: until then they may still be moving */
  comm_free(comm);
  return res;
}

ncclResult_t fs_wrap_close_send(void* send_comm) {
  return close_comm(send_comm, fs_wrap.inner.ops.closeSend);
}

ncclResult_t fs_wrap_close_recv(void* recv_comm) {
  return close_comm(recv_comm, fs_wrap.inner.ops.closeRecv);
}

/* ---- memory registration: the comm is unwrapped, the mhandle is the inner's -------------- */

ncclResult_t fs_wrap_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  struct fs_wrap_comm* c = comm;
  return c == NULL ? ncclInternalError : fs_wrap.inner.ops.regMr(c->inner, data, size, type, mhandle);
}

ncclResult_t fs_wrap_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset,
                                   int fd, void** mhandle) {
  struct fs_wrap_comm* c = comm;
  return c == NULL ? ncclInternalError
                   : fs_wrap.inner.ops.regMrDmaBuf(c->inner, data, size, type, offset, fd, mhandle);
}

ncclResult_t fs_wrap_dereg_mr(void* comm, void* mhandle) {
  struct fs_wrap_comm* c = comm;
  return c == NULL ? ncclInternalError : fs_wrap.inner.ops.deregMr(c->inner, mhandle);
}

ncclResult_t fs_wrap_get_device_mr(void* comm, void* mhandle, void** dptr_mhandle) {
  struct fs_wrap_comm* c = comm;
  return c == NULL ? ncclInternalError
                   : fs_wrap.inner.ops.getDeviceMr(c->inner, mhandle, dptr_mhandle);
}

/* ---- requests ------------------------------------------------------------------------------- */

static struct fs_wrap_req* req_get(struct fs_wrap_comm* comm) {
  if (comm->free_reqs == NULL) {
    struct fs_wrap_req_block* b = calloc(1, sizeof(*b));
    if (b == NULL) {
      return NULL;
    }
    b->next = comm->blocks;
    comm->blocks = b;
    for (int i = 0; i < FS_WRAP_REQ_BLOCK; i++) {
      b->reqs[i].next_free = comm->free_reqs;
      comm->free_reqs = &b->reqs[i];
    }
  }
  struct fs_wrap_req* req = comm->free_reqs;
  comm->free_reqs = req->next_free;
  memset(req, 0, sizeof(*req));
  req->comm = comm;
  return req;
}

static void req_put(struct fs_wrap_req* req) {
  struct fs_wrap_comm* comm = req->comm;
  req->inner = NULL;
  req->next_free = comm->free_reqs;
  comm->free_reqs = req;
}

ncclResult_t fs_wrap_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                           void* phandle, void** request) {
  struct fs_wrap_comm* comm = send_comm;
  if (request == NULL || comm == NULL || !comm->is_send) {
    return ncclInternalError;
  }
  *request = NULL;
  comm_update_level(comm); /* one atomic load unless the agent moved the level */
  if (!fs_gate_permit(&comm->gate, comm->dev, comm->level)) {
    return ncclSuccess; /* deferred: NCCL calls again with the same arguments */
  }
  struct fs_wrap_req* req = req_get(comm);
  if (req == NULL) {
    return ncclSystemError;
  }
  void* inner = NULL;
  ncclResult_t res = fs_wrap.inner.ops.isend(comm->inner, data, size, tag, mhandle, phandle, &inner);
  if (res != ncclSuccess || inner == NULL) {
    req_put(req);
    return res;
  }
  fs_gate_started(&comm->gate, comm->dev, comm->level, size);
  req->inner = inner;
  req->kind = FS_REQ_SEND;
  req->bytes = size;
  req->level = comm->level;
  *request = req;
  return ncclSuccess;
}

ncclResult_t fs_wrap_irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                           void** mhandles, void** phandles, void** request) {
  struct fs_wrap_comm* comm = recv_comm;
  if (request == NULL) {
    return ncclInternalError;
  }
  void* inner = *request; /* NCCL's optional-completion hint (0x1) goes in as it came */
  *request = NULL;
  if (comm == NULL || comm->is_send) {
    return ncclInternalError;
  }
  struct fs_wrap_req* req = req_get(comm);
  if (req == NULL) {
    return ncclSystemError;
  }
  ncclResult_t res =
      fs_wrap.inner.ops.irecv(comm->inner, n, data, sizes, tags, mhandles, phandles, &inner);
  if (res != ncclSuccess || inner == NULL) {
    req_put(req);
    return res;
  }
  if (!comm->peer_known && n >= 1 && tags != NULL) {
    comm->peer_known = 1; /* the receive tag is the sender's rank (every tag of a group) */
    atomic_store_explicit(&comm->flow.slot->peer_rank, tags[0], memory_order_relaxed);
  }
  req->inner = inner;
  req->kind = FS_REQ_RECV;
  req->n = n;
  *request = req;
  return ncclSuccess;
}

ncclResult_t fs_wrap_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                            void** request) {
  struct fs_wrap_comm* comm = recv_comm;
  if (request == NULL || comm == NULL) {
    return ncclInternalError;
  }
  *request = NULL;
  struct fs_wrap_req* req = req_get(comm);
  if (req == NULL) {
    return ncclSystemError;
  }
  void* inner = NULL;
  ncclResult_t res = fs_wrap.inner.ops.iflush(comm->inner, n, data, sizes, mhandles, &inner);
  if (res != ncclSuccess || inner == NULL) {
    req_put(req); /* NULL: nothing to wait for (never a retry) */
    return res;
  }
  req->inner = inner;
  req->kind = FS_REQ_FLUSH;
  *request = req;
  return ncclSuccess;
}

ncclResult_t fs_wrap_test(void* request, int* done, int* sizes) {
  struct fs_wrap_req* req = request;
  if (req == NULL || req->inner == NULL || done == NULL) {
    return ncclInternalError;
  }
  struct fs_wrap_comm* comm = req->comm;
  ncclResult_t res = fs_wrap.inner.ops.test(req->inner, done, sizes);
  if (res != ncclSuccess) {
    if (req->kind == FS_REQ_SEND) {
      fs_gate_done(comm->dev, req->level); /* a failed send no longer holds others back */
      req->kind = FS_REQ_FLUSH;
    }
    return res;
  }
  if (!*done) {
    return ncclSuccess;
  }
  if (req->kind == FS_REQ_SEND) {
    fs_gate_done(comm->dev, req->level);
    fs_flow_account(&comm->flow, req->bytes, fs_now_ns());
  } else if (req->kind == FS_REQ_RECV) {
    uint64_t bytes = 0;
    for (int i = 0; sizes != NULL && i < req->n; i++) {
      bytes += sizes[i] > 0 ? (uint64_t)sizes[i] : 0;
    }
    fs_flow_account(&comm->flow, bytes, fs_now_ns());
    if (fs_wrap.inner.ops.irecvConsumed != NULL) {
      req->done = 1; /* NCCL hands it to irecvConsumed later: keep the box until then */
      return ncclSuccess;
    }
  }
  req_put(req);
  return ncclSuccess;
}

ncclResult_t fs_wrap_irecv_consumed(void* recv_comm, int n, void* request) {
  struct fs_wrap_comm* comm = recv_comm;
  struct fs_wrap_req* req = request;
  if (comm == NULL || req == NULL || req->comm != comm) {
    return ncclInternalError;
  }
  ncclResult_t res = fs_wrap.inner.ops.irecvConsumed(comm->inner, n, req->inner);
  req_put(req);
  return res;
}
