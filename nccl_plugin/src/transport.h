/* SPDX-License-Identifier: Apache-2.0
 * The TCP transport: one control socket plus `nsocks` data sockets per connection, the data
 * sockets served by `nthreads` helper threads (NCCL's Socket transport layout).
 *
 * Wire protocol (per connection, in posting order; NCCL matches sends and receives FIFO):
 *  - every socket starts with a 40-byte hello (magic, socket index, nsocks, chunk and inline
 *    sizes, trafficClass, a random connection nonce, commId) so the acceptor can group the
 *    sockets of one connection, whatever order they arrive in;
 *  - each message sends a 16-byte header {u64 size, u32 magic, u32 seq} on the control
 *    socket, followed by the payload itself when size <= inline size (default 1 MiB: the
 *    progress thread moves such a message itself, no helper hand-off), else by the
 *    payload's head: min(inline size, size / (nsocks + 1)) bytes;
 *  - once the receiving process knows its own rank (the tag of its first isend on the same
 *    communicator), it writes an 8-byte rank note {u32 magic, i32 rank} once, in the other
 *    direction of the control socket, so the sender's slot can name its destination (the
 *    isend tag is the sender's own rank); v10 has no per-communicator context, no note.
 *    The note may come after the sender's last completion, so a send connection's close
 *    reads what the control socket holds and waits (bounded) until every byte it queued was
 *    acknowledged (fs_comm_close_drain): unread bytes, or a note landing on a closed socket,
 *    would make Linux reset the connection and drop the tail of a completed send;
 *  - the rest of a larger payload is cut into chunks of max(min_chunk, rest / nsocks) bytes
 *    dealt round-robin over the data sockets, starting at socket (seq % nsocks); both sides
 *    derive the same placement from the size.
 *
 * Threads. NCCL's progress thread runs isend/irecv/test: it posts requests, moves the control
 * stream (headers, inline payloads) and applies level changes (setsockopt). The data sockets
 * belong to helper threads (socket s to helper s % nthreads) that move the chunks on
 * non-blocking sockets and sleep in poll() when their sockets would block or have no work;
 * the progress thread publishes new work with a release store of `data_limit` and wakes a
 * helper through its eventfd only when that helper said it is going to sleep. Helpers publish
 * how far each socket got (`sock_done`). With nthreads = 0 the progress thread moves the
 * data itself inside test(). connect/accept never block (their state lives in the handle and
 * in the listen comm, as NCCL's retry contract requires).
 */
#ifndef FLOWSCHED_TRANSPORT_H
#define FLOWSCHED_TRANSPORT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "flow_table.h"
#include "permit.h"

#define FS_MAX_SOCKS 16
#define FS_MAX_THREADS 16
#define FS_MAX_REQUESTS 64 /* NCCL needs >= 32 outstanding per comm */
#define FS_MAX_PENDING (2 * (FS_MAX_SOCKS + 1))
#define FS_MAX_ASSEMBLIES 4 /* half-built connections per listener (the stalest is evicted) */
#define FS_HELLO_MAGIC 0x46534845u /* "FSHE": the first field of every socket's hello */
/* Receive-side control stream buffer: many headers and small inline payloads per recv;
 * a larger inline payload is read straight into the posted buffer. */
#define FS_CTRL_BUF 8320

struct fs_context;

struct fs_msg_header {
  uint64_t size;
  uint32_t magic;
  uint32_t seq; /* low 32 bits of the message sequence number */
};

struct fs_hello {
  uint32_t magic;
  uint32_t index; /* 0..nsocks-1: data socket; nsocks: control socket */
  uint32_t nsocks;
  uint32_t chunk; /* min_chunk */
  uint32_t inline_max;
  int32_t traffic_class;
  uint64_t nonce;
  uint64_t comm_id;
};

struct fs_request {
  struct fs_comm* comm;
  uint64_t seq;
  int in_use;
  uint8_t* data;
  size_t size;     /* send: message size; recv: received size once the header arrived */
  size_t capacity; /* recv: posted buffer size */
  struct fs_msg_header hdr;
  /* For the data sockets (read by helper threads): the size of message pub_seq - 1, once
   * known. A socket that has no chunk in a message may reach it only after the message
   * completed and its request slot was reused; pub_seq tells it so (see request_size_of). */
  _Atomic uint64_t pub_seq;
  _Atomic uint64_t pub_size;
  int32_t gate_level; /* send: the level the permit counted it at (-1: not counted) */
};

/* Where one data socket is in its share of the message stream. */
struct fs_sock_progress {
  uint64_t seq; /* message it works on */
  uint64_t k;   /* its k-th chunk of that message */
  size_t off;   /* bytes done in that chunk */
};

struct fs_helper {
  struct fs_comm* comm;
  int index;            /* serves data sockets index, index + stride, ... */
  int stride;           /* the number of helpers wanted */
  int efd;              /* eventfd: work arrived or stop */
  _Atomic int sleeping; /* 1 while the helper may be blocked in poll() */
  pthread_t thread;
};

struct fs_comm {
  int is_send;
  int family;
  int dev;
  int nsocks;
  size_t min_chunk;
  size_t inline_max;
  int fds[FS_MAX_SOCKS + 1]; /* fds[nsocks] is the control socket */
  uint64_t posted;           /* messages posted so far */
  uint64_t ctrl_seq;         /* messages whose header (+inline payload) went through */
  size_t ctrl_off;
  uint64_t hdr_seq; /* recv: messages whose size is known */
  size_t cbuf_off, cbuf_len; /* recv: unparsed control bytes are cbuf[cbuf_off, cbuf_len) */
  uint8_t cbuf[FS_CTRL_BUF];
  struct fs_sock_progress sock[FS_MAX_SOCKS]; /* owned by the socket's helper */
  struct fs_request reqs[FS_MAX_REQUESTS];
  int nthreads;                      /* helpers running (0: test() moves the data) */
  _Atomic uint64_t data_limit;       /* messages whose data sockets may move */
  _Atomic uint64_t sock_done[FS_MAX_SOCKS]; /* each socket's progress seq, published */
  _Atomic int helper_error;          /* -errno from a helper */
  _Atomic int stop;
  struct fs_helper helpers[FS_MAX_THREADS];
  int error; /* sticky -errno: a broken connection stays broken */
  int peer_rank_known;       /* recv: the slot's peer_rank is set (from the irecv tag) */
  int rank_note_done;        /* the rank note was sent (recv) or read (send), or given up */
  size_t rank_note_off;      /* bytes of the rank note sent (recv) or received (send) */
  uint8_t rank_note[8];      /* send side: the note being read */
  int32_t traffic_class;
  uint64_t comm_id;
  uint64_t nonce;
  struct fs_flow flow;
  struct fs_gate_conn gate; /* the permit's view of this connection (api.c) */
  struct fs_context* ctx;
  struct fs_comm* ctx_next;
};

struct fs_pending {
  int fd;
  uint64_t since_ns; /* accepted at (fs_now_ns) */
  size_t off;
  struct fs_hello hello;
};

struct fs_assembly {
  int used;
  uint64_t since_ns; /* its first socket was accepted at (fs_now_ns) */
  uint64_t last_ns;  /* its latest socket was accepted at */
  uint64_t nonce;
  int have;
  struct fs_comm* comm;
};

struct fs_listen_comm {
  int fd;
  int dev;
  int nsocks;
  size_t min_chunk;
  size_t inline_max;
  struct fs_context* ctx;
  struct fs_pending pending[FS_MAX_PENDING];
  int npending;
  struct fs_assembly assemblies[FS_MAX_ASSEMBLIES];
};

int fs_listen(struct fs_context* ctx, int dev, void* handle, struct fs_listen_comm** out);
/* *out stays NULL until the connection is complete; call again with the same handle. */
int fs_connect(struct fs_context* ctx, int dev, int32_t traffic_class, void* handle,
               struct fs_comm** out);
int fs_accept(struct fs_listen_comm* lcomm, struct fs_comm** out);
/* *out is NULL when no request slot is free (NCCL retries). */
int fs_isend(struct fs_comm* comm, void* data, size_t size, int tag, struct fs_request** out);
int fs_irecv(struct fs_comm* comm, void* data, size_t capacity, int tag, struct fs_request** out);
int fs_test(struct fs_request* req, int* done, size_t* size);
int fs_close_comm(struct fs_comm* comm);
/* Send side, before close(): read what the receiver wrote and wait (bounded) until the peer
 * acknowledged every byte queued, so that the close cannot reset the connection and drop the
 * tail of a completed send (transport_io.c). */
void fs_comm_close_drain(struct fs_comm* comm);
/* Start the connection's helper threads (a complete connection, before NCCL sees it); on
 * failure the connection moves its data on the progress thread instead. */
void fs_comm_start_helpers(struct fs_comm* comm);
/* Stop and join them (before the sockets are closed). */
void fs_comm_stop_helpers(struct fs_comm* comm);
int fs_close_listen(struct fs_listen_comm* lcomm);
/* Apply the slot's level to the sockets if the agent changed it (one atomic load). */
void fs_comm_poll_level(struct fs_comm* comm);

#endif
