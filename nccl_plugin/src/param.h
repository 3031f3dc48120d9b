/* SPDX-License-Identifier: Apache-2.0
 * Every environment knob of the plugin, in one declarative table. Each knob is read once, when
 * the first context initialises the plugin (again after an unload/reload), and logged at INFO
 * when set. No other file calls getenv.
 *
 * FS_PARAM_INT(field, "ENV", default, min, max, doc)   integers, clamped to [min, max]
 * FS_PARAM_STR(field, "ENV", default, doc)              strings (at most 255 bytes)
 */
#ifndef FLOWSCHED_PARAM_H
#define FLOWSCHED_PARAM_H

#include <stdint.h>

#define FS_PARAMS(FS_PARAM_INT, FS_PARAM_STR)                                                    \
  /* Data sockets per connection, in addition to the control socket. More sockets help on   \
   * real NICs with several queues; 2 is enough on loopback. */                               \
  FS_PARAM_INT(nsocks, "FLOWSCHED_NSOCKS", 2, 1, 16, "data sockets per connection")            \
  /* Bytes handed to one data socket before moving to the next (bounded so that a level     \
   * change never waits behind one huge write). */                                           \
  FS_PARAM_INT(chunk_size, "FLOWSCHED_CHUNK_SIZE", 512 * 1024, 4096, 64 * 1024 * 1024,         \
               "chunk size in bytes")                                                         \
  /* Messages up to this size travel whole on the control socket with their header. */      \
  FS_PARAM_INT(inline_size, "FLOWSCHED_INLINE_SIZE", 1024, 0, 4096, "inline threshold, bytes") \
  /* TCP_NOTSENT_LOWAT on data sockets: caps bytes queued in the kernel but not yet sent, so \
   * a new DSCP reaches the wire quickly (0 = leave the kernel default). */                   \
  FS_PARAM_INT(notsent_lowat, "FLOWSCHED_NOTSENT_LOWAT", 1024 * 1024, 0, 1 << 30,             \
               "TCP_NOTSENT_LOWAT in bytes")                                                  \
  /* SO_SNDBUF / SO_RCVBUF for data sockets (0 = kernel autotuning). */                       \
  FS_PARAM_INT(sock_buf, "FLOWSCHED_SOCK_BUF", 0, 0, 1 << 30, "socket buffer bytes")           \
  /* TCP congestion control of our sockets (e.g. "cubic"); empty = the system default. A   \
   * starved BBR flow re-probes its bandwidth slowly after a promotion. */                  \
  FS_PARAM_STR(tcp_congestion, "FLOWSCHED_TCP_CONGESTION", "", "TCP congestion control")     \
  /* 1 = apply a level change only when a message starts (isend); 0 = also while a message is \
   * in flight (test), so that a promotion does not wait for a starved message to finish.   \
   * See transport_io.c for why this is safe on TCP. */                                      \
  FS_PARAM_INT(level_at_boundary, "FLOWSCHED_LEVEL_AT_BOUNDARY", 0, 0, 1,                     \
               "apply level changes only at message boundaries")                            \
  /* Address family: 0 = any (IPv4 preferred), 4 = IPv4 only, 6 = IPv6 only. */               \
  FS_PARAM_INT(family, "FLOWSCHED_SOCKET_FAMILY", 0, 0, 6, "address family (0, 4 or 6)")       \
  /* How many times a refused connect is retried, 20 ms apart (listener not accepting yet). */ \
  FS_PARAM_INT(connect_retries, "FLOWSCHED_CONNECT_RETRIES", 150, 0, 100000,                  \
               "retries of a refused connect")                                               \
  /* Flow class when NCCL's trafficClass maps to none: a label (tp, experience, param_sync,  \
   * kv, kv_reuse, bulk) or a class id. Empty = tp. */                                        \
  FS_PARAM_STR(class_name, "FLOWSCHED_CLASS", "", "flow class of this process's connections") \
  /* The node's shared-memory flow table written by the agent. */                            \
  FS_PARAM_STR(table_path, "FLOWSCHED_TABLE", "/dev/shm/flowsched-table", "flow table path")  \
  /* Interfaces to use: prefixes separated by commas, '^' to exclude, '=' for exact names. */ \
  FS_PARAM_STR(socket_ifname, "FLOWSCHED_SOCKET_IFNAME", "", "interface selection")           \
  /* Fallback for the interface selection when FLOWSCHED_SOCKET_IFNAME is unset. */           \
  FS_PARAM_STR(nccl_socket_ifname, "NCCL_SOCKET_IFNAME", "", "NCCL's interface selection")

#define FS_PARAM_DECLARE_INT(field, env, def, lo, hi, doc) int64_t field;
#define FS_PARAM_DECLARE_STR(field, env, def, doc) char field[256];

struct fs_params {
  FS_PARAMS(FS_PARAM_DECLARE_INT, FS_PARAM_DECLARE_STR)
};

/* Read every knob from the environment (called once per initialisation of the plugin). */
void fs_params_load(struct fs_params* params);

#endif
