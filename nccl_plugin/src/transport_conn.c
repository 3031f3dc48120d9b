/* SPDX-License-Identifier: Apache-2.0
 * Connection setup: listen, the non-blocking connect state machine (state in the handle) and
 * the non-blocking accept state machine (state in the listen comm). */
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "context.h"
#include "log.h"
#include "socket_util.h"
#include "transport.h"

#define FS_HANDLE_MAGIC 0x46534831u /* "FSH1" */
#define FS_CONNECT_RETRY_NS 20000000ull /* wait 20 ms before retrying a refused connect */

enum fs_handle_stage { FS_STAGE_NEW = 0, FS_STAGE_CONNECTING = 1, FS_STAGE_DONE = 2 };
enum fs_connect_phase { FS_PHASE_SOCKET, FS_PHASE_CONNECTING, FS_PHASE_HELLO };

struct fs_connect_state {
  struct fs_comm* comm;
  struct fs_addr peer;
  int index; /* socket being set up; nsocks = control */
  int phase;
  int fd;
  size_t hello_off;
  struct fs_hello hello;
  int64_t retries;
  uint64_t retry_after_ns;
};

/* What travels inside NCCL's 128-byte handle. The connector keeps its state machine in it:
 * NCCL passes the same buffer on every connect retry. */
struct fs_handle {
  uint32_t magic;
  uint32_t stage;
  struct fs_connect_state* state;
  uint16_t family;
  uint16_t port; /* network order */
  uint32_t scope_id;
  uint8_t addr[16];
  uint32_t nsocks;
  uint32_t chunk;
  uint32_t inline_max;
  uint32_t reserved;
};
_Static_assert(sizeof(struct fs_handle) <= NCCL_NET_HANDLE_MAXSIZE, "handle too large");

static uint64_t random_nonce(void) {
  uint64_t nonce = fs_now_ns() ^ ((uint64_t)getpid() << 32);
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, &nonce, sizeof(nonce)) != (ssize_t)sizeof(nonce)) {
      nonce ^= (uint64_t)(uintptr_t)&nonce;
    }
    close(fd);
  }
  return nonce;
}

static void handle_set_addr(struct fs_handle* h, const struct fs_addr* addr) {
  h->family = (uint16_t)addr->ss.ss_family;
  if (addr->ss.ss_family == AF_INET) {
    const struct sockaddr_in* sin = (const struct sockaddr_in*)&addr->ss;
    h->port = sin->sin_port;
    memcpy(h->addr, &sin->sin_addr, 4);
  } else {
    const struct sockaddr_in6* sin6 = (const struct sockaddr_in6*)&addr->ss;
    h->port = sin6->sin6_port;
    h->scope_id = sin6->sin6_scope_id;
    memcpy(h->addr, &sin6->sin6_addr, 16);
  }
}

static int handle_get_addr(const struct fs_handle* h, struct fs_addr* addr) {
  memset(addr, 0, sizeof(*addr));
  if (h->family == AF_INET) {
    struct sockaddr_in* sin = (struct sockaddr_in*)&addr->ss;
    sin->sin_family = AF_INET;
    sin->sin_port = h->port;
    memcpy(&sin->sin_addr, h->addr, 4);
    addr->len = sizeof(*sin);
    return 0;
  }
  if (h->family == AF_INET6) {
    struct sockaddr_in6* sin6 = (struct sockaddr_in6*)&addr->ss;
    sin6->sin6_family = AF_INET6;
    sin6->sin6_port = h->port;
    sin6->sin6_scope_id = h->scope_id;
    memcpy(&sin6->sin6_addr, h->addr, 16);
    addr->len = sizeof(*sin6);
    return 0;
  }
  return -EINVAL;
}

static void comm_apply_initial_level(struct fs_comm* comm) {
  struct fs_level_marking marking;
  uint32_t config_seq = FS_CONFIG_SEQ_NONE;
  uint32_t level = fs_flow_effective_level(&comm->flow, FS_LEVEL_UNSET, &marking, &config_seq);
  comm->flow.marking = marking;
  comm->flow.seen_config_seq = config_seq;
  fs_flow_applied(&comm->flow, level);
}

/* Allocate a connection and claim its slot (so that its sockets carry the level at once). */
static struct fs_comm* comm_new(struct fs_context* ctx, int dev, int is_send, int32_t traffic_class,
                                uint64_t comm_id) {
  struct fs_comm* comm = calloc(1, sizeof(*comm));
  if (comm == NULL) {
    return NULL;
  }
  if (fs_global_acquire(NULL) != 0) {
    free(comm);
    return NULL;
  }
  fs_context_retain(ctx);
  comm->is_send = is_send;
  comm->dev = dev;
  comm->ctx = ctx;
  comm->traffic_class = traffic_class;
  comm->comm_id = comm_id;
  for (int i = 0; i <= FS_MAX_SOCKS; i++) {
    comm->fds[i] = -1;
  }
  for (int i = 0; i < FS_MAX_REQUESTS; i++) {
    comm->reqs[i].comm = comm;
    comm->reqs[i].gate_level = -1; /* not counted by the permit (api.c) */
  }
  struct fs_flow_info info = {
      .comm_id = comm_id,
      .peer_rank = -1,
      .traffic_class = traffic_class,
      .class_id = fs_class_resolve(ctx, traffic_class),
      .direction = is_send ? FS_DIR_SEND : FS_DIR_RECV,
      .dev = (uint32_t)dev,
  };
  fs_context_connect_attr(ctx, &info.net_op, &info.net_algo, &info.net_proto);
  fs_flow_open(&comm->flow, &info);
  comm_apply_initial_level(comm);
  return comm;
}

/* Free a connection that never reached NCCL (or was closed by it). */
static void comm_free(struct fs_comm* comm) {
  for (int i = 0; i <= FS_MAX_SOCKS; i++) {
    if (comm->fds[i] >= 0) {
      close(comm->fds[i]);
    }
  }
  fs_flow_close(&comm->flow);
  struct fs_context* ctx = comm->ctx;
  free(comm);
  fs_context_release(ctx);
  fs_global_release();
}

int fs_listen(struct fs_context* ctx, int dev, void* handle, struct fs_listen_comm** out) {
  const struct fs_device* device = fs_global_device(dev);
  const struct fs_params* params = fs_global_params();
  if (device == NULL) {
    return -ENODEV;
  }
  struct fs_addr addr = device->addr;
  int fd = socket(addr.ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return FS_NEG_ERRNO();
  }
  int rc = 0;
  if (bind(fd, (struct sockaddr*)&addr.ss, addr.len) != 0 || listen(fd, 128) != 0 ||
      getsockname(fd, (struct sockaddr*)&addr.ss, &addr.len) != 0) {
    rc = FS_NEG_ERRNO();
    goto fail;
  }
  struct fs_listen_comm* lcomm = calloc(1, sizeof(*lcomm));
  if (lcomm == NULL || (rc = fs_global_acquire(NULL)) != 0) {
    free(lcomm);
    rc = rc != 0 ? rc : -ENOMEM;
    goto fail;
  }
  fs_context_retain(ctx);
  *lcomm = (struct fs_listen_comm){.fd = fd, .dev = dev, .ctx = ctx,
                                   .nsocks = fs_params_data_sockets(params),
                                   .min_chunk = (size_t)params->min_chunk_size,
                                   .inline_max = (size_t)params->inline_size};
  struct fs_handle* h = handle;
  memset(h, 0, NCCL_NET_HANDLE_MAXSIZE);
  *h = (struct fs_handle){.magic = FS_HANDLE_MAGIC, .stage = FS_STAGE_NEW,
                          .nsocks = (uint32_t)lcomm->nsocks, .chunk = (uint32_t)lcomm->min_chunk,
                          .inline_max = (uint32_t)lcomm->inline_max};
  handle_set_addr(h, &addr);
  *out = lcomm;
  return 0;
fail:
  close(fd);
  return rc;
}

/* ---- connect ---------------------------------------------------------------------------- */

static int connect_state_new(struct fs_context* ctx, int dev, int32_t traffic_class,
                             const struct fs_handle* h, struct fs_connect_state** out) {
  if (h->nsocks == 0 || h->nsocks > FS_MAX_SOCKS || h->chunk == 0) {
    return -EINVAL;
  }
  struct fs_connect_state* st = calloc(1, sizeof(*st));
  if (st == NULL) {
    return -ENOMEM;
  }
  int rc = handle_get_addr(h, &st->peer);
  st->comm = rc == 0 ? comm_new(ctx, dev, 1, traffic_class, ctx->comm_id) : NULL;
  if (st->comm == NULL) {
    free(st);
    return rc != 0 ? rc : -ENOMEM;
  }
  struct fs_comm* comm = st->comm;
  comm->family = h->family;
  comm->nsocks = (int)h->nsocks;
  comm->min_chunk = h->chunk;
  comm->inline_max = h->inline_max;
  comm->nonce = random_nonce();
  st->fd = -1;
  st->phase = FS_PHASE_SOCKET;
  *out = st;
  return 0;
}

static void connect_state_free(struct fs_connect_state* st, int free_comm) {
  if (st->fd >= 0) {
    close(st->fd);
  }
  if (free_comm && st->comm != NULL) {
    comm_free(st->comm);
  }
  free(st);
}

/* A refused or timed-out connect: retry later (the listener may not be accepting yet). */
static int connect_retry(struct fs_connect_state* st, int err) {
  close(st->fd);
  st->fd = -1;
  st->phase = FS_PHASE_SOCKET;
  if (++st->retries > fs_global_params()->connect_retries) {
    return -err;
  }
  st->retry_after_ns = fs_now_ns() + FS_CONNECT_RETRY_NS;
  return 0;
}

static int connect_start_socket(struct fs_connect_state* st) {
  struct fs_comm* comm = st->comm;
  if (st->retry_after_ns != 0 && fs_now_ns() < st->retry_after_ns) {
    return 0;
  }
  st->fd = socket(comm->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (st->fd < 0) {
    return FS_NEG_ERRNO();
  }
  fs_sock_tune(st->fd, fs_global_params());
  fs_sock_apply_marking(st->fd, comm->family, &comm->flow.marking);
  fs_sock_bind_device(st->fd, fs_global_device(comm->dev), comm->family);
  if (connect(st->fd, (struct sockaddr*)&st->peer.ss, st->peer.len) == 0 || errno == EINPROGRESS) {
    st->phase = FS_PHASE_CONNECTING;
    return 0;
  }
  if (errno == ECONNREFUSED || errno == ETIMEDOUT || errno == EAGAIN) {
    return connect_retry(st, errno);
  }
  return FS_NEG_ERRNO();
}

/* 1 when the TCP handshake finished, 0 while it is pending, -errno on failure. */
static int connect_check_socket(struct fs_connect_state* st) {
  struct pollfd pfd = {.fd = st->fd, .events = POLLOUT};
  int ready = poll(&pfd, 1, 0);
  if (ready < 0) { /* not an answer: SO_ERROR reads 0 while the handshake is pending too */
    return errno == EINTR ? 0 : FS_NEG_ERRNO();
  }
  if (ready == 0) {
    return 0;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(st->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
    return FS_NEG_ERRNO();
  }
  if (err == ECONNREFUSED || err == ETIMEDOUT) {
    return connect_retry(st, err);
  }
  if (err != 0) {
    return -err;
  }
  struct fs_comm* comm = st->comm;
  st->hello = (struct fs_hello){.magic = FS_HELLO_MAGIC, .index = (uint32_t)st->index,
                                .nsocks = (uint32_t)comm->nsocks, .chunk = (uint32_t)comm->min_chunk,
                                .inline_max = (uint32_t)comm->inline_max,
                                .traffic_class = comm->traffic_class, .nonce = comm->nonce,
                                .comm_id = comm->comm_id};
  st->hello_off = 0;
  st->phase = FS_PHASE_HELLO;
  return 1;
}

/* 1 when the hello is fully written, 0 when the socket is full, -errno on failure. */
static int connect_send_hello(struct fs_connect_state* st) {
  const uint8_t* bytes = (const uint8_t*)&st->hello;
  ssize_t n = send(st->fd, bytes + st->hello_off, sizeof(st->hello) - st->hello_off,
                   MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n < 0) {
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : FS_NEG_ERRNO();
  }
  st->hello_off += (size_t)n;
  if (st->hello_off < sizeof(st->hello)) {
    return 0;
  }
  st->comm->fds[st->index] = st->fd;
  st->fd = -1;
  st->index++;
  st->phase = FS_PHASE_SOCKET;
  return 1;
}

/* Explicit state machine: advance as far as possible without blocking.
 * Returns 1 when every socket is connected and introduced, 0 to be called again, -errno. */
static int connect_progress(struct fs_connect_state* st) {
  while (st->index <= st->comm->nsocks) {
    int rc = 0;
    int phase = st->phase;
    switch (phase) {
      case FS_PHASE_SOCKET:
        rc = connect_start_socket(st);
        break;
      case FS_PHASE_CONNECTING:
        rc = connect_check_socket(st);
        break;
      case FS_PHASE_HELLO:
        rc = connect_send_hello(st);
        break;
      default:
        return -EINVAL;
    }
    if (rc < 0) {
      return rc;
    }
    if (st->phase == phase && rc == 0) {
      return 0; /* would block: NCCL calls connect again */
    }
  }
  return 1;
}

int fs_connect(struct fs_context* ctx, int dev, int32_t traffic_class, void* handle,
               struct fs_comm** out) {
  struct fs_handle* h = handle;
  *out = NULL;
  if (h->magic != FS_HANDLE_MAGIC) {
    FS_WARN("connect: the handle is not one of ours (magic 0x%x)", h->magic);
    return -EINVAL;
  }
  if (h->stage != FS_STAGE_CONNECTING || h->state == NULL) {
    FS_CHECK(connect_state_new(ctx, dev, traffic_class, h, &h->state));
    h->stage = FS_STAGE_CONNECTING;
  }
  struct fs_connect_state* st = h->state;
  int rc = connect_progress(st);
  if (rc == 0) {
    return 0;
  }
  h->state = NULL;
  h->stage = FS_STAGE_DONE;
  if (rc < 0) {
    char text[96];
    FS_WARN("connect to %s failed: %s", fs_addr_str(&st->peer, text, sizeof(text)),
            fs_errstr(-rc));
    connect_state_free(st, 1);
    return rc;
  }
  *out = st->comm;
  fs_comm_start_helpers(st->comm);
  fs_context_add_comm(st->comm->ctx, st->comm); /* the context it holds a reference on */
  connect_state_free(st, 0);
  return 0;
}

/* ---- accept ----------------------------------------------------------------------------- */

/* accept(2): on Linux a new connection's pending network error is reported by accept itself;
 * such an error concerns that connection only and is to be treated like EAGAIN. */
static int accept_error_transient(int err) {
  switch (err) {
    case EAGAIN:
#if EWOULDBLOCK != EAGAIN
    case EWOULDBLOCK:
#endif
    case ENETDOWN:
    case EPROTO:
    case ENOPROTOOPT:
    case EHOSTDOWN:
    case ENONET:
    case EHOSTUNREACH:
    case EOPNOTSUPP:
    case ENETUNREACH:
      return 1;
    default:
      return 0;
  }
}

/* 0, or -errno of a hard error (EMFILE, ENFILE, ENOBUFS, ENOMEM, ...): NCCL retries a NULL
 * accept forever, so a listener that can accept nothing more must fail, as NCCL's own socket
 * transport does, rather than hang the job. */
static int accept_new_sockets(struct fs_listen_comm* lcomm) {
  while (lcomm->npending < FS_MAX_PENDING) {
    int fd = accept4(lcomm->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) {
        continue;
      }
      return accept_error_transient(errno) ? 0 : FS_NEG_ERRNO(); /* transient: next call */
    }
    lcomm->pending[lcomm->npending++] = (struct fs_pending){.fd = fd, .since_ns = fs_now_ns()};
  }
  return 0;
}

static void pending_drop(struct fs_listen_comm* lcomm, int i, int close_fd) {
  if (close_fd) {
    close(lcomm->pending[i].fd);
  }
  lcomm->pending[i] = lcomm->pending[--lcomm->npending];
}

/* 1 when the hello is complete, 0 when more is needed, -1 when the socket must be dropped. */
static int pending_read_hello(struct fs_pending* p) {
  uint8_t* bytes = (uint8_t*)&p->hello;
  ssize_t n = recv(p->fd, bytes + p->off, sizeof(p->hello) - p->off, MSG_DONTWAIT);
  if (n < 0) {
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
  }
  if (n == 0) {
    return -1;
  }
  p->off += (size_t)n;
  return p->off == sizeof(p->hello);
}

static int hello_valid(const struct fs_listen_comm* lcomm, const struct fs_hello* hello) {
  return hello->magic == FS_HELLO_MAGIC && hello->nsocks == (uint32_t)lcomm->nsocks &&
         hello->chunk == lcomm->min_chunk && hello->inline_max == lcomm->inline_max &&
         hello->index <= hello->nsocks;
}

/* A free assembly slot; when all are taken, the one that waited longest for its next socket,
 * evicted (its sockets closed). A live connector opens its sockets back to back, so its
 * assembly is the one that grew last; an assembly whose peer died after its first hellos
 * only ever ages. Waiting for those to reach FLOWSCHED_ACCEPT_TIMEOUT_MS instead would close
 * every new connection's sockets meanwhile, and its connector, whose connect has already
 * succeeded, would fail on first use. An evicted assembly of a live peer needs more than
 * FS_MAX_ASSEMBLIES connectors assembling on one listener at once; NCCL uses one listener
 * per connection. */
static struct fs_assembly* assembly_slot(struct fs_listen_comm* lcomm) {
  struct fs_assembly* stalest = &lcomm->assemblies[0];
  for (int i = 0; i < FS_MAX_ASSEMBLIES; i++) {
    struct fs_assembly* a = &lcomm->assemblies[i];
    if (!a->used) {
      return a;
    }
    if (a->last_ns < stalest->last_ns) {
      stalest = a;
    }
  }
  static atomic_int warned;
  FS_WARN_ONCE(warned,
               "accept: %d connections of this listener are half-built; dropping the one that "
               "waited longest for its next socket (%d of %d sockets) to make room",
               FS_MAX_ASSEMBLIES, stalest->have, stalest->comm->nsocks + 1);
  comm_free(stalest->comm);
  *stalest = (struct fs_assembly){0};
  return stalest;
}

static struct fs_assembly* assembly_for(struct fs_listen_comm* lcomm, const struct fs_hello* hello,
                                        uint64_t since_ns) {
  for (int i = 0; i < FS_MAX_ASSEMBLIES; i++) {
    struct fs_assembly* a = &lcomm->assemblies[i];
    if (a->used && a->nonce == hello->nonce) {
      return a;
    }
  }
  struct fs_context* ctx = lcomm->ctx;
  uint64_t comm_id = ctx->comm_id != 0 ? ctx->comm_id : hello->comm_id;
  int32_t tc = ctx->traffic_class != NCCL_NET_TRAFFIC_CLASS_UNDEF ? ctx->traffic_class
                                                                  : hello->traffic_class;
  struct fs_comm* comm = comm_new(ctx, lcomm->dev, 0, tc, comm_id);
  if (comm == NULL) {
    return NULL;
  }
  comm->nsocks = lcomm->nsocks;
  comm->min_chunk = lcomm->min_chunk;
  comm->inline_max = lcomm->inline_max;
  comm->nonce = hello->nonce;
  struct fs_assembly* a = assembly_slot(lcomm);
  *a = (struct fs_assembly){
      .used = 1, .since_ns = since_ns, .last_ns = since_ns, .nonce = hello->nonce, .comm = comm};
  return a;
}

/* Place a socket whose hello is complete; returns the connection once it has all sockets. */
static struct fs_comm* accept_place(struct fs_listen_comm* lcomm, struct fs_pending* p) {
  struct fs_assembly* a = assembly_for(lcomm, &p->hello, p->since_ns);
  if (a == NULL || a->comm->fds[p->hello.index] >= 0) {
    close(p->fd);
    return NULL;
  }
  struct fs_comm* comm = a->comm;
  comm->fds[p->hello.index] = p->fd;
  a->last_ns = p->since_ns > a->last_ns ? p->since_ns : a->last_ns;
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  if (getsockname(p->fd, (struct sockaddr*)&ss, &len) == 0) {
    comm->family = ss.ss_family;
  }
  fs_sock_tune(p->fd, fs_global_params());
  fs_sock_apply_marking(p->fd, comm->family, &comm->flow.marking);
  if (++a->have < comm->nsocks + 1) {
    return NULL;
  }
  a->used = 0;
  a->comm = NULL;
  return comm;
}

/* Drop the sockets and half-built connections older than FLOWSCHED_ACCEPT_TIMEOUT_MS: a
 * legitimate connector sends its hello with each connect and opens all its sockets at once,
 * so only a stalled or dead peer gets that old, and it must not hold a slot for good (with
 * the pending slots full nothing more is accepted; a full set of assemblies makes room by
 * evicting its stalest, see assembly_slot). */
static void drop_stale(struct fs_listen_comm* lcomm, uint64_t now_ns) {
  uint64_t limit_ns = (uint64_t)fs_global_params()->accept_timeout_ms * 1000000u;
  static atomic_int warned_pending, warned_assembly;
  for (int i = 0; i < lcomm->npending;) {
    if (now_ns - lcomm->pending[i].since_ns <= limit_ns) {
      i++;
      continue;
    }
    FS_WARN_ONCE(warned_pending, "accept: dropping a socket that sent no hello within %lld ms",
                 (long long)fs_global_params()->accept_timeout_ms);
    pending_drop(lcomm, i, 1);
  }
  for (int i = 0; i < FS_MAX_ASSEMBLIES; i++) {
    struct fs_assembly* a = &lcomm->assemblies[i];
    if (a->used && now_ns - a->since_ns > limit_ns) {
      FS_WARN_ONCE(warned_assembly,
                   "accept: dropping a connection whose sockets did not all arrive within %lld ms",
                   (long long)fs_global_params()->accept_timeout_ms);
      comm_free(a->comm);
      *a = (struct fs_assembly){0};
    }
  }
}

int fs_accept(struct fs_listen_comm* lcomm, struct fs_comm** out) {
  *out = NULL;
  drop_stale(lcomm, fs_now_ns());
  FS_CHECK(accept_new_sockets(lcomm));
  for (int i = 0; i < lcomm->npending && *out == NULL;) {
    struct fs_pending* p = &lcomm->pending[i];
    int rc = pending_read_hello(p);
    if (rc == 0) {
      i++;
      continue;
    }
    if (rc < 0 || !hello_valid(lcomm, &p->hello)) {
      static atomic_int warned_hello;
      FS_WARN_ONCE(warned_hello, "accept: dropping a socket with a bad or missing hello");
      pending_drop(lcomm, i, 1);
      continue;
    }
    struct fs_pending placed = *p;
    pending_drop(lcomm, i, 0);
    *out = accept_place(lcomm, &placed);
  }
  if (*out != NULL) {
    fs_comm_start_helpers(*out);
    fs_context_add_comm(lcomm->ctx, *out);
  }
  return 0;
}

int fs_close_listen(struct fs_listen_comm* lcomm) {
  for (int i = 0; i < lcomm->npending; i++) {
    close(lcomm->pending[i].fd);
  }
  for (int i = 0; i < FS_MAX_ASSEMBLIES; i++) {
    if (lcomm->assemblies[i].used) {
      comm_free(lcomm->assemblies[i].comm);
    }
  }
  close(lcomm->fd);
  struct fs_context* ctx = lcomm->ctx;
  free(lcomm);
  fs_context_release(ctx);
  fs_global_release();
  return 0;
}

int fs_close_comm(struct fs_comm* comm) {
  fs_comm_stop_helpers(comm);
  fs_context_remove_comm(comm->ctx, comm);
  fs_comm_close_drain(comm);
  comm_free(comm);
  return 0;
}
