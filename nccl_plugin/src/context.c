/* SPDX-License-Identifier: Apache-2.0 */
#include "context.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "class_defaults.h"
#include "flow_table.h"
#include "log.h"
#include "transport.h"

static struct {
  pthread_mutex_t lock;
  int refs;
  struct fs_params params;
  struct fs_device devs[FS_MAX_DEVICES];
  int ndev;
  struct fs_context* v10_ctx;
  atomic_int warned_class;
} fs_global = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int global_init_locked(void) {
  fs_params_load(&fs_global.params);
  if (fs_global.params.family != 0 && fs_global.params.family != 4 && fs_global.params.family != 6) {
    FS_WARN("FLOWSCHED_SOCKET_FAMILY=%lld is not 0, 4 or 6; using 0 (any)",
            (long long)fs_global.params.family);
    fs_global.params.family = 0;
  }
  int rc = fs_devices_discover(&fs_global.params, fs_global.devs, &fs_global.ndev);
  if (rc < 0) {
    FS_WARN("cannot list network interfaces: %s", fs_errstr(-rc));
    return rc;
  }
  if (fs_global.ndev == 0) {
    FS_WARN("no network interface matches the selection (FLOWSCHED_SOCKET_IFNAME=%s, "
            "NCCL_SOCKET_IFNAME=%s)", fs_global.params.socket_ifname,
            fs_global.params.nccl_socket_ifname);
  }
  for (int i = 0; i < fs_global.ndev; i++) {
    char text[96];
    FS_INFO(NCCL_INIT | NCCL_NET, "device %d: %s %s", i, fs_global.devs[i].name,
            fs_addr_str(&fs_global.devs[i].addr, text, sizeof(text)));
  }
  atomic_store(&fs_global.warned_class, 0);
  return 0;
}

static void global_teardown_locked(void) {
  fs_devices_free(fs_global.devs, fs_global.ndev);
  fs_global.ndev = 0;
  fs_table_detach();
}

int fs_global_acquire(ncclDebugLogger_t logger) {
  fs_log_set_logger(logger);
  pthread_mutex_lock(&fs_global.lock);
  int rc = 0;
  if (fs_global.refs == 0) {
    rc = global_init_locked();
  }
  if (rc == 0) {
    fs_global.refs++;
  }
  pthread_mutex_unlock(&fs_global.lock);
  return rc;
}

void fs_global_release(void) {
  pthread_mutex_lock(&fs_global.lock);
  if (fs_global.refs > 0 && --fs_global.refs == 0) {
    global_teardown_locked();
  }
  pthread_mutex_unlock(&fs_global.lock);
}

/* On dlclose (NCCL 2.27+ unloads the plugin after its last communicator): drop what the v10
 * API never finalizes. The destructor also runs at exit(), and a process may exit with
 * communicators alive, NCCL's proxy threads still inside isend/test: freeing the devices or
 * unmapping the table under them would turn the exit into a SIGSEGV. So everything is
 * released only when nothing uses it any more (no context but the v10 one, no connection, no
 * listen comm: they all hold a reference); else it stays as it is and the kernel reclaims it
 * with the process. */
__attribute__((destructor)) static void fs_global_unload(void) {
  pthread_mutex_lock(&fs_global.lock);
  struct fs_context* v10 = fs_global.v10_ctx;
  int own = v10 != NULL; /* the v10 context's reference on the globals */
  int live = fs_global.refs > own ||
             (v10 != NULL && atomic_load_explicit(&v10->refs, memory_order_acquire) > 1);
  if (!live) {
    if (v10 != NULL) {
      pthread_mutex_destroy(&v10->lock);
      free(v10);
      fs_global.v10_ctx = NULL;
    }
    if (fs_global.refs > 0) {
      fs_global.refs = 0;
      global_teardown_locked();
    }
  }
  pthread_mutex_unlock(&fs_global.lock);
}

const struct fs_params* fs_global_params(void) {
  return &fs_global.params;
}

int fs_global_device_count(void) {
  return fs_global.ndev;
}

const struct fs_device* fs_global_device(int dev) {
  return dev >= 0 && dev < fs_global.ndev ? &fs_global.devs[dev] : NULL;
}

static struct fs_context* context_alloc(uint64_t comm_id, int32_t traffic_class) {
  static _Atomic uint64_t next_id = 1;
  struct fs_context* ctx = calloc(1, sizeof(*ctx));
  if (ctx != NULL) {
    ctx->id = atomic_fetch_add(&next_id, 1);
    ctx->comm_id = comm_id;
    ctx->traffic_class = traffic_class;
    atomic_init(&ctx->refs, 1); /* the owner's */
    atomic_init(&ctx->self_rank, -1);
    pthread_mutex_init(&ctx->lock, NULL);
  }
  return ctx;
}

int fs_global_v10_context(ncclDebugLogger_t logger, struct fs_context** out) {
  pthread_mutex_lock(&fs_global.lock);
  struct fs_context* ctx = fs_global.v10_ctx;
  pthread_mutex_unlock(&fs_global.lock);
  if (ctx == NULL) {
    FS_CHECK(fs_global_acquire(logger));
    ctx = context_alloc(0, NCCL_NET_TRAFFIC_CLASS_UNDEF);
    if (ctx == NULL) {
      fs_global_release();
      return -ENOMEM;
    }
    pthread_mutex_lock(&fs_global.lock);
    if (fs_global.v10_ctx == NULL) {
      fs_global.v10_ctx = ctx;
      ctx = NULL;
    }
    pthread_mutex_unlock(&fs_global.lock);
    if (ctx != NULL) { /* another thread won the race */
      pthread_mutex_destroy(&ctx->lock);
      free(ctx);
      fs_global_release();
    }
  }
  *out = fs_global.v10_ctx;
  return 0;
}

int fs_context_create(uint64_t comm_id, int32_t traffic_class, ncclDebugLogger_t logger,
                      struct fs_context** out) {
  FS_CHECK(fs_global_acquire(logger));
  struct fs_context* ctx = context_alloc(comm_id, traffic_class);
  if (ctx == NULL) {
    fs_global_release();
    return -ENOMEM;
  }
  /* Per communicator: flowsched.torch.new_group sets FLOWSCHED_CLASS right before creating
   * a group where NCCL has no per-communicator trafficClass. */
  fs_param_peek("FLOWSCHED_CLASS", ctx->class_name, sizeof(ctx->class_name));
  *out = ctx;
  return 0;
}

void fs_context_retain(struct fs_context* ctx) {
  atomic_fetch_add_explicit(&ctx->refs, 1, memory_order_relaxed);
}

void fs_context_release(struct fs_context* ctx) {
  /* acq_rel: every holder's last use of the context happens before the free */
  if (atomic_fetch_sub_explicit(&ctx->refs, 1, memory_order_acq_rel) != 1) {
    return;
  }
  pthread_mutex_destroy(&ctx->lock);
  free(ctx);
  fs_global_release();
}

void fs_context_finalize(struct fs_context* ctx) {
  pthread_mutex_lock(&ctx->lock);
  int open = ctx->comms != NULL;
  pthread_mutex_unlock(&ctx->lock);
  if (open) {
    FS_WARN("finalize of comm 0x%llx with connections still open",
            (unsigned long long)ctx->comm_id);
  }
  fs_context_release(ctx); /* the connections and listen comms keep it alive until they close */
}

/* The last hint given on this thread. NCCL's service thread calls setNetAttr right before
 * connect/accept, while its progress thread sends per-operation hints for the same context:
 * a connection takes the hint its own thread gave (else the context's latest). The context
 * is named by its id, not its address: a freed context's address may come back. */
static _Thread_local struct {
  uint64_t ctx_id; /* 0: none */
  uint32_t op, algo, proto;
} fs_thread_attr;

void fs_context_set_net_attr(struct fs_context* ctx, uint32_t op, uint32_t algo, uint32_t proto) {
  pthread_mutex_lock(&ctx->lock);
  ctx->net_op = op;
  ctx->net_algo = algo;
  ctx->net_proto = proto;
  pthread_mutex_unlock(&ctx->lock);
  fs_thread_attr.ctx_id = ctx->id;
  fs_thread_attr.op = op;
  fs_thread_attr.algo = algo;
  fs_thread_attr.proto = proto;
}

void fs_context_connect_attr(struct fs_context* ctx, uint32_t* op, uint32_t* algo,
                             uint32_t* proto) {
  if (fs_thread_attr.ctx_id == ctx->id) {
    *op = fs_thread_attr.op;
    *algo = fs_thread_attr.algo;
    *proto = fs_thread_attr.proto;
    return;
  }
  pthread_mutex_lock(&ctx->lock);
  *op = ctx->net_op;
  *algo = ctx->net_algo;
  *proto = ctx->net_proto;
  pthread_mutex_unlock(&ctx->lock);
}

void fs_context_add_comm(struct fs_context* ctx, struct fs_comm* comm) {
  pthread_mutex_lock(&ctx->lock);
  comm->ctx_next = ctx->comms;
  ctx->comms = comm;
  pthread_mutex_unlock(&ctx->lock);
}

void fs_context_remove_comm(struct fs_context* ctx, struct fs_comm* comm) {
  pthread_mutex_lock(&ctx->lock);
  for (struct fs_comm** link = &ctx->comms; *link != NULL; link = &(*link)->ctx_next) {
    if (*link == comm) {
      *link = comm->ctx_next;
      break;
    }
  }
  pthread_mutex_unlock(&ctx->lock);
}

int fs_class_parse(const char* text) {
  for (int i = 0; i < FS_NUM_CLASSES; i++) {
    if (strcmp(text, fs_class_labels[i]) == 0) {
      return i;
    }
  }
  char* end = NULL;
  long id = strtol(text, &end, 10);
  if (end != text && *end == '\0' && id >= 0 && id < FS_NUM_CLASSES) {
    return (int)id;
  }
  return -1;
}

uint16_t fs_class_resolve(const struct fs_context* ctx, int32_t traffic_class) {
  const struct fs_params* params = fs_global_params();
  /* v11+: FLOWSCHED_CLASS as it was at the communicator's init (also when it was unset then:
   * an earlier communicator's class is not inherited). v8-v10 have one context for the whole
   * process, so the variable is read as each connection is made: that read is the documented
   * way to give a communicator its class there (flowsched.torch.new_group sets the variable
   * around the group's creation), so it stays, on NCCL's service thread at listen/connect/
   * accept. Like NCCL's own getenv calls on its threads, it is safe only if no other thread
   * changes the environment meanwhile: a caller that sets FLOWSCHED_CLASS while another
   * communicator is being set up owns that race (flowsched.torch.new_group's docstring). */
  char now[sizeof(ctx->class_name)];
  const char* class_name = now;
  if (ctx != NULL && ctx != fs_global.v10_ctx) {
    class_name = ctx->class_name;
  } else {
    fs_param_peek("FLOWSCHED_CLASS", now, sizeof(now));
  }
  if (params->table_path[0] != '\0') { /* empty: no table (the standalone inner build) */
    fs_table_attach(params->table_path);
  }
  struct fs_table_config cfg;
  fs_table_config(&cfg);
  int cls = fs_table_class_for_traffic_class(&cfg, traffic_class);
  if (cls < 0 && class_name[0] != '\0') {
    cls = fs_class_parse(class_name);
    if (cls < 0) {
      FS_WARN_ONCE(fs_global.warned_class, "FLOWSCHED_CLASS=%s is not a flow class; using tp",
                   class_name);
    }
  }
  if (cls < 0) {
    cls = cfg.from_table && cfg.fallback_class < FS_TABLE_MAX_CLASSES ? (int)cfg.fallback_class
                                                                      : FS_CLASS_TP;
  }
  return (uint16_t)cls;
}
