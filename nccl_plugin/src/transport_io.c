/* SPDX-License-Identifier: Apache-2.0
 * Data path: isend/irecv post requests; test() moves the control stream and reports
 * completion; helper threads (or test() itself when there are none) move the chunks.
 * The priority check is one relaxed atomic load of the slot's level per isend, and per test
 * unless FLOWSCHED_LEVEL_AT_BOUNDARY=1. Checking in test() lets a connection that is starved
 * with its request queue full see a promotion without first finishing a whole message at the
 * starved rate. On TCP this does not add reordering that a message-boundary rule would avoid:
 * every message of a connection shares the same byte stream, so a DSCP change reorders (at
 * most) across the old and new switch queue whether or not it falls on a message boundary. */
#include <linux/sockios.h>
#include <poll.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "check.h"
#include "context.h"
#include "log.h"
#include "socket_util.h"
#include "transport.h"

#define FS_MSG_MAGIC 0x46534d47u /* "FSMG" */
#define FS_HDR_SIZE sizeof(struct fs_msg_header)

static struct fs_request* req_at(struct fs_comm* comm, uint64_t seq) {
  return &comm->reqs[seq % FS_MAX_REQUESTS];
}

static int would_block(void) {
  return errno == EAGAIN || errno == EWOULDBLOCK;
}

/* Bytes moved (> 0), 0 when the socket would block, or -errno (-ECONNRESET on EOF). */
static ssize_t io_send(int fd, struct iovec* iov, int iovcnt) {
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
  for (;;) {
    ssize_t n = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) {
      return n;
    }
    if (errno != EINTR) {
      return would_block() ? 0 : FS_NEG_ERRNO();
    }
  }
}

static ssize_t io_recv(int fd, void* buf, size_t len) {
  for (;;) {
    ssize_t n = recv(fd, buf, len, MSG_DONTWAIT);
    if (n > 0) {
      return n;
    }
    if (n == 0) {
      return -ECONNRESET;
    }
    if (errno != EINTR) {
      return would_block() ? 0 : FS_NEG_ERRNO();
    }
  }
}

/* The bytes that follow the header on the control socket (moved by the progress thread):
 * a whole message up to inline_max; of a larger one, its head, an even share with the data
 * sockets capped at inline_max, so the progress thread works alongside the helpers instead
 * of only polling while they move the rest. */
static size_t inline_bytes(const struct fs_comm* comm, size_t size) {
  if (size <= comm->inline_max) {
    return size;
  }
  size_t share = size / ((size_t)comm->nsocks + 1);
  return share < comm->inline_max ? share : comm->inline_max;
}

/* One chunk per data socket, none smaller than min_chunk (NCCL's rule), so that a message
 * uses every socket once it is large enough and small ones do not pay for splitting. */
static size_t chunk_size(const struct fs_comm* comm, size_t size) {
  size_t n = (size_t)comm->nsocks;
  size_t even = size / n + (size % n != 0);
  return even > comm->min_chunk ? even : comm->min_chunk;
}

/* Where socket `s`'s k-th chunk of message `seq` lies; 0 when the socket has no more. The
 * data sockets share what follows the inline head. */
static int chunk_of(const struct fs_comm* comm, size_t size, uint64_t seq, int s, uint64_t k,
                    size_t* off, size_t* len) {
  size_t head = inline_bytes(comm, size);
  size_t rest = size - head;
  if (rest == 0) {
    return 0;
  }
  uint64_t n = (uint64_t)comm->nsocks;
  size_t chunk = chunk_size(comm, rest);
  uint64_t nchunks = (rest + chunk - 1) / chunk;
  uint64_t first = ((uint64_t)s + n - seq % n) % n;
  uint64_t c = first + k * n;
  if (c >= nchunks) {
    return 0;
  }
  size_t at = (size_t)(c * chunk);
  *off = head + at;
  *len = rest - at < chunk ? rest - at : chunk;
  return 1;
}

/* Does socket `s` carry part of message `seq` of `size` bytes? */
static int socket_has_chunk(const struct fs_comm* comm, size_t size, uint64_t seq, int s) {
  size_t off, len;
  return chunk_of(comm, size, seq, s, 0, &off, &len);
}

/* Make message `seq`'s size visible to the data sockets (before data_limit moves). A seqlock
 * write: the slot first says it holds no message (pub_seq 0; seq + 1 never is), then the size
 * changes. A helper may still be reading the message the slot held before (a socket that had
 * no chunk in it reaches it late, after the slot was reused 64 messages on): without the
 * first store it could read the new size under the old sequence number, take a chunk in the
 * old message for its own and move bytes the peer does not expect on that socket. The release
 * fence orders the invalidation before the size, for request_size_of's second check. */
static void request_publish_size(struct fs_request* req, uint64_t seq, size_t size) {
  atomic_store_explicit(&req->pub_seq, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  atomic_store_explicit(&req->pub_size, size, memory_order_relaxed);
  atomic_store_explicit(&req->pub_seq, seq + 1, memory_order_release);
}

/* The size of message `seq` as seen from a data socket: 1 and *size, or 0 when the request
 * slot already holds a later message (or is being rewritten for one). That happens only to a
 * socket without a chunk in `seq` (a message cannot complete before its sockets moved their
 * chunks), so it skips. The seqlock read of request_publish_size's write. */
static int request_size_of(struct fs_request* req, uint64_t seq, size_t* size) {
  if (atomic_load_explicit(&req->pub_seq, memory_order_acquire) != seq + 1) {
    return 0;
  }
  *size = (size_t)atomic_load_explicit(&req->pub_size, memory_order_relaxed);
  atomic_thread_fence(memory_order_acquire);
  return atomic_load_explicit(&req->pub_seq, memory_order_relaxed) == seq + 1;
}

/* ---- control stream --------------------------------------------------------------------- */

static int ctrl_send_progress(struct fs_comm* comm) {
  int fd = comm->fds[comm->nsocks];
  while (comm->ctrl_seq < comm->posted) {
    struct fs_request* req = req_at(comm, comm->ctrl_seq);
    size_t inl = inline_bytes(comm, req->size);
    size_t total = FS_HDR_SIZE + inl;
    struct iovec iov[2];
    int cnt = 0;
    if (comm->ctrl_off < FS_HDR_SIZE) {
      iov[cnt++] = (struct iovec){(uint8_t*)&req->hdr + comm->ctrl_off, FS_HDR_SIZE - comm->ctrl_off};
      if (inl > 0) {
        iov[cnt++] = (struct iovec){req->data, inl};
      }
    } else {
      iov[cnt++] = (struct iovec){req->data + (comm->ctrl_off - FS_HDR_SIZE), total - comm->ctrl_off};
    }
    ssize_t n = io_send(fd, iov, cnt);
    if (n <= 0) {
      return (int)n;
    }
    comm->ctrl_off += (size_t)n;
    if (comm->ctrl_off == total) {
      comm->ctrl_seq++;
      comm->ctrl_off = 0;
    }
  }
  return 0;
}

static int ctrl_check_header(struct fs_comm* comm, struct fs_request* req) {
  if (req->hdr.magic != FS_MSG_MAGIC || req->hdr.seq != (uint32_t)req->seq) {
    FS_WARN("corrupt message header on comm %p (magic 0x%x seq %u, expected %u)", (void*)comm,
            req->hdr.magic, req->hdr.seq, (uint32_t)req->seq);
    return -EPROTO;
  }
  if (req->hdr.size > req->capacity) {
    FS_WARN("message truncated: %llu bytes sent, receive buffer has %zu",
            (unsigned long long)req->hdr.size, req->capacity);
    return -EMSGSIZE;
  }
  req->size = (size_t)req->hdr.size;
  request_publish_size(req, req->seq, req->size);
  comm->hdr_seq = req->seq + 1;
  return 0;
}

/* Read what the control socket has into cbuf: 1 on new bytes, 0 if none, -errno. */
static int ctrl_fill(struct fs_comm* comm) {
  if (comm->cbuf_off > 0) {
    memmove(comm->cbuf, comm->cbuf + comm->cbuf_off, comm->cbuf_len - comm->cbuf_off);
    comm->cbuf_len -= comm->cbuf_off;
    comm->cbuf_off = 0;
  }
  if (comm->cbuf_len == sizeof(comm->cbuf)) {
    return 0; /* full of headers for receives not posted yet */
  }
  ssize_t n = io_recv(comm->fds[comm->nsocks], comm->cbuf + comm->cbuf_len,
                      sizeof(comm->cbuf) - comm->cbuf_len);
  if (n > 0) {
    comm->cbuf_len += (size_t)n;
    return 1;
  }
  return (int)n;
}

/* Read up to `len` bytes of the current inline payload into `dst`: from cbuf first, else
 * straight from the socket when the rest is larger than cbuf (no extra copy for a big
 * payload), else through cbuf (one recv for many small messages). Bytes, 0, or -errno. */
static ssize_t ctrl_recv_payload(struct fs_comm* comm, uint8_t* dst, size_t len) {
  size_t avail = comm->cbuf_len - comm->cbuf_off;
  if (avail == 0 && len >= sizeof(comm->cbuf)) {
    return io_recv(comm->fds[comm->nsocks], dst, len);
  }
  if (avail == 0) {
    int rc = ctrl_fill(comm);
    if (rc <= 0) {
      return rc;
    }
    avail = comm->cbuf_len - comm->cbuf_off;
  }
  size_t n = avail < len ? avail : len;
  memcpy(dst, comm->cbuf + comm->cbuf_off, n);
  comm->cbuf_off += n;
  return (ssize_t)n;
}

/* Headers are read in bulk into cbuf (one recv for many small messages) and parsed only for
 * posted receives. ctrl_off counts the current message's header and inline payload bytes. */
static int ctrl_recv_progress(struct fs_comm* comm) {
  while (comm->ctrl_seq < comm->posted) {
    struct fs_request* req = req_at(comm, comm->ctrl_seq);
    if (comm->ctrl_off < FS_HDR_SIZE) {
      if (comm->cbuf_len - comm->cbuf_off < FS_HDR_SIZE) {
        int rc = ctrl_fill(comm);
        if (rc <= 0) {
          return rc;
        }
        continue;
      }
      memcpy(&req->hdr, comm->cbuf + comm->cbuf_off, FS_HDR_SIZE);
      comm->cbuf_off += FS_HDR_SIZE;
      comm->ctrl_off = FS_HDR_SIZE;
      FS_CHECK(ctrl_check_header(comm, req));
    }
    size_t done = comm->ctrl_off - FS_HDR_SIZE;
    size_t need = inline_bytes(comm, req->size) - done;
    if (need > 0) {
      ssize_t n = ctrl_recv_payload(comm, req->data + done, need);
      if (n <= 0) {
        return (int)n;
      }
      comm->ctrl_off += (size_t)n;
      continue;
    }
    comm->ctrl_seq++;
    comm->ctrl_off = 0;
  }
  return 0;
}

/* ---- data sockets ----------------------------------------------------------------------- */

/* Move socket `s`'s share of every message below `limit` until the socket would block. */
static int data_progress(struct fs_comm* comm, int s, uint64_t limit) {
  struct fs_sock_progress* p = &comm->sock[s];
  while (p->seq < limit) {
    struct fs_request* req = req_at(comm, p->seq);
    size_t size = 0, off = 0, len = 0;
    if (!request_size_of(req, p->seq, &size) || !chunk_of(comm, size, p->seq, s, p->k, &off, &len)) {
      *p = (struct fs_sock_progress){.seq = p->seq + 1};
      continue;
    }
    uint8_t* at = req->data + off + p->off;
    ssize_t n;
    if (comm->is_send) {
      struct iovec iov = {at, len - p->off};
      n = io_send(comm->fds[s], &iov, 1);
    } else {
      n = io_recv(comm->fds[s], at, len - p->off);
    }
    if (n <= 0) {
      return (int)n;
    }
    p->off += (size_t)n;
    if (p->off == len) {
      p->k++;
      p->off = 0;
    }
  }
  return 0;
}

/* ---- helper threads --------------------------------------------------------------------- */

static void helper_wake(struct fs_helper* h) {
  if (atomic_exchange(&h->sleeping, 0)) {
    uint64_t one = 1;
    ssize_t n = write(h->efd, &one, sizeof(one));
    (void)n; /* a full counter (impossible) still wakes it */
  }
}

/* Let the data sockets move messages below `limit`, waking the helpers that have a chunk in
 * them. A helper that is busy is not woken: it reads data_limit before it sleeps. */
static void data_publish(struct fs_comm* comm, uint64_t limit) {
  uint64_t from = atomic_load_explicit(&comm->data_limit, memory_order_relaxed);
  if (limit == from) {
    return;
  }
  atomic_store(&comm->data_limit, limit); /* seq_cst: pairs with the helper's sleeping flag */
  if (comm->nthreads == 0) {
    return;
  }
  uint32_t wake = 0;
  for (uint64_t seq = from; seq < limit; seq++) {
    size_t size = req_at(comm, seq)->size;
    for (int s = 0; s < comm->nsocks; s++) {
      if (socket_has_chunk(comm, size, seq, s)) {
        wake |= 1u << (s % comm->nthreads);
      }
    }
  }
  for (int t = 0; t < comm->nthreads; t++) {
    if (wake & (1u << t)) {
      helper_wake(&comm->helpers[t]);
    }
  }
}

static void helper_fail(struct fs_comm* comm, int rc) {
  int expected = 0;
  atomic_compare_exchange_strong(&comm->helper_error, &expected, rc);
}

/* One pass over the helper's sockets; fills `pfd` with the sockets that would block. */
static int helper_pass(struct fs_helper* h, uint64_t limit, struct pollfd* pfd, int* np) {
  struct fs_comm* comm = h->comm;
  *np = 0;
  for (int s = h->index; s < comm->nsocks; s += h->stride) {
    int rc = data_progress(comm, s, limit);
    atomic_store_explicit(&comm->sock_done[s], comm->sock[s].seq, memory_order_release);
    if (rc < 0) {
      return rc;
    }
    if (comm->sock[s].seq < limit) {
      pfd[(*np)++] = (struct pollfd){.fd = comm->fds[s], .events = comm->is_send ? POLLOUT : POLLIN};
    }
  }
  return 0;
}

static void helper_drain(int efd) {
  uint64_t count;
  ssize_t n = read(efd, &count, sizeof(count));
  (void)n; /* EAGAIN: someone else's wake-up was already consumed */
}

static void* helper_main(void* arg) {
  struct fs_helper* h = arg;
  struct fs_comm* comm = h->comm;
  struct pollfd pfd[FS_MAX_SOCKS + 1];
  while (!atomic_load_explicit(&comm->stop, memory_order_acquire)) {
    uint64_t limit = atomic_load_explicit(&comm->data_limit, memory_order_acquire);
    int np = 0;
    int rc = helper_pass(h, limit, pfd, &np);
    if (rc < 0) {
      helper_fail(comm, rc);
      break;
    }
    /* Say we may sleep, then look once more: a publish after this sees the flag and wakes
     * us through the eventfd; one before it shows in data_limit. */
    atomic_store(&h->sleeping, 1);
    if (atomic_load(&comm->data_limit) != limit || atomic_load(&comm->stop)) {
      atomic_store(&h->sleeping, 0);
      continue;
    }
    pfd[np] = (struct pollfd){.fd = h->efd, .events = POLLIN};
    int n = poll(pfd, (nfds_t)np + 1, -1);
    atomic_store(&h->sleeping, 0);
    if (n > 0 && (pfd[np].revents & POLLIN)) {
      helper_drain(h->efd);
    }
  }
  return NULL;
}

void fs_comm_start_helpers(struct fs_comm* comm) {
  int want = (int)fs_global_params()->nthreads;
  want = want < comm->nsocks ? want : comm->nsocks;
  int started = 0;
  for (; started < want; started++) {
    struct fs_helper* h = &comm->helpers[started];
    *h = (struct fs_helper){.comm = comm, .index = started, .stride = want};
    h->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (h->efd < 0) {
      break;
    }
    if (pthread_create(&h->thread, NULL, helper_main, h) != 0) {
      close(h->efd);
      break;
    }
  }
  comm->nthreads = started;
  if (started < want) {
    static atomic_int warned;
    FS_WARN_ONCE(warned, "cannot start helper threads (%s): moving data on NCCL's progress "
                 "thread", fs_errstr(errno));
    fs_comm_stop_helpers(comm); /* all or none: socket ownership depends on the count */
  }
}

void fs_comm_stop_helpers(struct fs_comm* comm) {
  if (comm->nthreads == 0) {
    return;
  }
  atomic_store(&comm->stop, 1);
  for (int t = 0; t < comm->nthreads; t++) {
    atomic_store(&comm->helpers[t].sleeping, 1);
    helper_wake(&comm->helpers[t]);
  }
  for (int t = 0; t < comm->nthreads; t++) {
    pthread_join(comm->helpers[t].thread, NULL);
    close(comm->helpers[t].efd);
  }
  for (int s = 0; s < comm->nsocks; s++) {
    atomic_store_explicit(&comm->sock_done[s], comm->sock[s].seq, memory_order_relaxed);
  }
  comm->nthreads = 0;
  atomic_store(&comm->stop, 0);
}

/* ---- progress on NCCL's thread ---------------------------------------------------------- */

static int comm_progress(struct fs_comm* comm) {
  if (comm->error != 0) {
    return comm->error;
  }
  int rc = comm->is_send ? ctrl_send_progress(comm) : ctrl_recv_progress(comm);
  uint64_t limit = comm->is_send ? comm->posted : comm->hdr_seq;
  data_publish(comm, limit);
  if (comm->nthreads == 0) {
    for (int s = 0; s < comm->nsocks && rc == 0; s++) {
      rc = data_progress(comm, s, limit);
      atomic_store_explicit(&comm->sock_done[s], comm->sock[s].seq, memory_order_relaxed);
    }
  } else if (rc == 0) {
    rc = atomic_load_explicit(&comm->helper_error, memory_order_relaxed);
  }
  if (rc < 0) {
    comm->error = rc;
    if (rc != -EMSGSIZE && rc != -EPROTO) {
      FS_WARN("connection %s failed: %s", comm->is_send ? "send" : "receive", fs_errstr(-rc));
    }
  }
  return rc;
}

/* Complete when its header went through and every socket with a chunk in it is past it
 * (the acquire loads make the helpers' bytes visible before NCCL reads the buffer). */
static int request_complete(struct fs_comm* comm, const struct fs_request* req) {
  if (comm->ctrl_seq <= req->seq) {
    return 0;
  }
  for (int s = 0; s < comm->nsocks; s++) {
    if (atomic_load_explicit(&comm->sock_done[s], memory_order_acquire) <= req->seq &&
        socket_has_chunk(comm, req->size, req->seq, s)) {
      return 0;
    }
  }
  return 1;
}

/* ---- priority --------------------------------------------------------------------------- */

static int marking_equal(const struct fs_level_marking* a, const struct fs_level_marking* b) {
  return a->dscp == b->dscp && a->so_priority == b->so_priority;
}

/* Recompute the marking for the slot's level `raw` under the config in force. A new level
 * is always recorded as applied; a rewritten config only when it moved the effective level
 * (e.g. a new default for the class), so applied_ns keeps meaning "when this level began". */
static void comm_apply_level(struct fs_comm* comm, uint32_t raw) {
  struct fs_level_marking marking;
  uint32_t config_seq = FS_CONFIG_SEQ_NONE;
  uint32_t level = fs_flow_effective_level(&comm->flow, raw, &marking, &config_seq);
  if (!marking_equal(&marking, &comm->flow.marking)) {
    for (int i = 0; i <= comm->nsocks; i++) {
      fs_sock_apply_marking(comm->fds[i], comm->family, &marking);
    }
    comm->flow.marking = marking;
  }
  uint32_t applied = atomic_load_explicit(&comm->flow.slot->applied_level, memory_order_relaxed);
  int record = raw != comm->flow.seen_level || level != applied;
  comm->flow.seen_level = raw;
  comm->flow.seen_config_seq = config_seq;
  if (record) {
    fs_flow_applied(&comm->flow, level);
  }
}

void fs_comm_poll_level(struct fs_comm* comm) {
  uint32_t raw;
  if (fs_flow_level_changed(&comm->flow, &raw)) {
    comm_apply_level(comm, raw);
  }
}

/* ---- requests --------------------------------------------------------------------------- */

static struct fs_request* request_post(struct fs_comm* comm, void* data, size_t size, int tag) {
  struct fs_request* req = req_at(comm, comm->posted);
  if (req->in_use) {
    return NULL; /* all slots busy: NCCL retries the post later */
  }
  req->seq = comm->posted++;
  req->in_use = 1;
  req->data = data;
  req->size = size;
  req->capacity = size;
  req->hdr = (struct fs_msg_header){.size = size, .magic = FS_MSG_MAGIC, .seq = (uint32_t)req->seq};
  if (comm->is_send) {
    request_publish_size(req, req->seq, size);
  }
  if (!comm->is_send && !comm->peer_rank_known) {
    comm->peer_rank_known = 1; /* the receive tag is the sender's rank */
    atomic_store_explicit(&comm->flow.slot->peer_rank, tag, memory_order_relaxed);
  }
  return req;
}

/* ---- the rank note: who a send connection sends to ------------------------------------- */

#define FS_RANK_NOTE_MAGIC 0x46535241u /* "FSRA" */

/* Send side: our isend tag is our own rank; remember it for the context (v11+ only: the v10
 * context is shared by every communicator of the process, whose ranks differ). */
static void rank_note_learn_self(struct fs_comm* comm, int tag) {
  struct fs_context* ctx = comm->ctx;
  if (ctx->comm_id != 0 && tag >= 0 &&
      atomic_load_explicit(&ctx->self_rank, memory_order_relaxed) < 0) {
    atomic_store_explicit(&ctx->self_rank, tag, memory_order_relaxed);
  }
}

/* Receive side: once this process's rank is known, tell the sender (one note per
 * connection). Costs one relaxed load per progress call until then. Best effort, like the
 * reading side: the note never fails a transfer. */
static int rank_note_send(struct fs_comm* comm) {
  int32_t rank = atomic_load_explicit(&comm->ctx->self_rank, memory_order_relaxed);
  if (rank < 0) {
    return 0;
  }
  uint32_t note[2] = {FS_RANK_NOTE_MAGIC, (uint32_t)rank};
  struct iovec iov = {(uint8_t*)note + comm->rank_note_off, sizeof(note) - comm->rank_note_off};
  ssize_t n = io_send(comm->fds[comm->nsocks], &iov, 1);
  if (n < 0) {
    comm->rank_note_done = 1; /* best effort: a closing peer does not fail the receive */
    return 0;
  }
  comm->rank_note_off += (size_t)n;
  comm->rank_note_done = comm->rank_note_off == sizeof(note);
  return 0;
}

/* Send side: read the receiver's note when it is there (one non-blocking recv per message
 * until it arrived) and record the destination rank in the slot. */
static int rank_note_recv(struct fs_comm* comm) {
  ssize_t n = io_recv(comm->fds[comm->nsocks], comm->rank_note + comm->rank_note_off,
                      sizeof(comm->rank_note) - comm->rank_note_off);
  if (n <= 0) {
    comm->rank_note_done = n < 0; /* EOF or error: the peer closes; never fail a send */
    return 0;
  }
  comm->rank_note_off += (size_t)n;
  if (comm->rank_note_off < sizeof(comm->rank_note)) {
    return 0;
  }
  uint32_t note[2];
  memcpy(note, comm->rank_note, sizeof(note));
  comm->rank_note_done = 1;
  if (note[0] != FS_RANK_NOTE_MAGIC) {
    FS_WARN("ignoring a bad rank note on comm %p (magic 0x%x)", (void*)comm, note[0]);
    return 0;
  }
  atomic_store_explicit(&comm->flow.slot->peer_rank, (int32_t)note[1], memory_order_relaxed);
  return 0;
}

/* The note's share of a progress call (send: on isend and on completions only). */
static int rank_note_progress(struct fs_comm* comm, int send_side_may_read) {
  if (comm->rank_note_done || comm->ctx->comm_id == 0) {
    return 0;
  }
  if (!comm->is_send) {
    return rank_note_send(comm);
  }
  return send_side_may_read ? rank_note_recv(comm) : 0;
}

int fs_isend(struct fs_comm* comm, void* data, size_t size, int tag, struct fs_request** out) {
  *out = NULL;
  if (comm->error != 0) {
    return comm->error;
  }
  fs_comm_poll_level(comm); /* before the message's first byte leaves */
  *out = request_post(comm, data, size, tag);
  if (*out == NULL) {
    return 0;
  }
  rank_note_learn_self(comm, tag);
  FS_CHECK(rank_note_progress(comm, 1));
  return comm_progress(comm);
}

int fs_irecv(struct fs_comm* comm, void* data, size_t capacity, int tag, struct fs_request** out) {
  *out = NULL;
  if (comm->error != 0) {
    return comm->error;
  }
  *out = request_post(comm, data, capacity, tag);
  if (*out == NULL) {
    return 0;
  }
  FS_CHECK(rank_note_progress(comm, 0));
  return comm_progress(comm);
}

int fs_test(struct fs_request* req, int* done, size_t* size) {
  struct fs_comm* comm = req->comm;
  *done = 0;
  if (!req->in_use) {
    return -EINVAL;
  }
  if (!fs_global_params()->level_at_boundary) {
    fs_comm_poll_level(comm);
  }
  FS_CHECK(comm_progress(comm));
  if (!request_complete(comm, req)) {
    return comm->is_send ? 0 : rank_note_progress(comm, 0);
  }
  FS_CHECK(rank_note_progress(comm, 1));
  *done = 1;
  *size = req->size;
  req->in_use = 0;
  fs_flow_account(&comm->flow, req->size, fs_now_ns());
  return 0;
}

/* ---- closing ---------------------------------------------------------------------------- */

/* How long a send connection's close waits for the receiver's kernel to acknowledge the
 * bytes still queued (fs_comm_close_drain). Normally milliseconds: at NCCL's close the
 * receiver is reading the tail of the last message it is still testing. */
#define FS_CLOSE_DRAIN_NS 1000000000ull

/* Read and drop what the control socket holds: 0 when it would block, -errno on EOF or error
 * (the peer is gone: nothing left to protect). */
static int close_drain_ctrl(int fd) {
  uint8_t scratch[64];
  for (;;) {
    ssize_t n = io_recv(fd, scratch, sizeof(scratch));
    if (n <= 0) {
      return (int)n;
    }
  }
}

/* Bytes written on the connection's sockets that the peer's kernel has not acknowledged yet
 * (0 when SIOCOUTQ is not available: nothing to wait for then). */
static long close_unacked(const struct fs_comm* comm) {
  long total = 0;
  for (int i = 0; i <= comm->nsocks; i++) {
    int n = 0;
    if (comm->fds[i] >= 0 && ioctl(comm->fds[i], SIOCOUTQ, &n) == 0 && n > 0) {
      total += n;
    }
  }
  return total;
}

/* Send side, before its sockets are closed. A send is complete once its bytes are in the
 * kernel's send queue, so a close() must not throw that queue away, and Linux does so twice:
 * a close() with unread bytes in the receive queue sends RST instead of FIN and drops the send
 * queue, and a segment arriving at a closed socket is answered with RST, which drops what the
 * socket still had to send. The control socket is the one the receiver writes to: its rank
 * note goes out whenever the receiving process learns its rank during a receive, which may be
 * after this side's last completion. So: read whatever the control socket holds, and wait
 * (bounded, reading the control socket meanwhile) until the receiver's kernel acknowledged
 * every byte of every socket. After that a late note can reset only a connection whose bytes
 * the receiver's kernel already holds, and those stay readable before the reset shows. No wait
 * for a broken connection, or with sends still in flight (an abort: NCCL never saw them
 * complete and the receiver may never read them). */
void fs_comm_close_drain(struct fs_comm* comm) {
  if (!comm->is_send || comm->error != 0 || comm->nsocks <= 0) {
    return;
  }
  int ctrl = comm->fds[comm->nsocks];
  if (ctrl < 0 || close_drain_ctrl(ctrl) < 0) {
    return;
  }
  for (int i = 0; i < FS_MAX_REQUESTS; i++) {
    if (comm->reqs[i].in_use) {
      return;
    }
  }
  uint64_t deadline = fs_now_ns() + FS_CLOSE_DRAIN_NS;
  while (close_unacked(comm) > 0) {
    if (fs_now_ns() >= deadline) {
      static atomic_int warned;
      FS_WARN_ONCE(warned, "close: the receiver did not acknowledge the last bytes of a send "
                   "connection within %llu ms; closing anyway",
                   (unsigned long long)(FS_CLOSE_DRAIN_NS / 1000000));
      break;
    }
    /* No event says "acknowledged": wake on a note (or EOF) or after 1 ms to look again. */
    struct pollfd pfd = {.fd = ctrl, .events = POLLIN};
    if (poll(&pfd, 1, 1) < 0 && errno != EINTR) {
      break;
    }
    if (close_drain_ctrl(ctrl) < 0) {
      return;
    }
  }
  close_drain_ctrl(ctrl); /* a note that came in the last millisecond */
}
