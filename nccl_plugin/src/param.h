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

#include <stddef.h>
#include <stdint.h>

/* The table's default is resolved at load time (fs_table_default_path), as the agent's
 * clients do; the standalone inner build has none unless FSTCP_TABLE names one: the wrapper
 * owns the connection's slot. */
#define FS_DEFAULT_TABLE ""
#define FS_RUN_DIR "/run/flowsched" /* a root agent's directory (flowsched/rundir.py) */

#define FS_PARAMS(FS_PARAM_INT, FS_PARAM_STR)                                                    \
  /* Helper threads per connection that move the data sockets' bytes (NCCL's               \
   * NCCL_SOCKET_NTHREADS); 0 = every byte is moved on NCCL's progress thread inside test(). \
   * They sleep in poll() when their sockets would block, so they never spin on a shared core. */ \
  FS_PARAM_INT(nthreads, "FLOWSCHED_SOCKET_NTHREADS", 2, 0, 16, "helper threads per connection") \
  /* Data sockets per helper thread (NCCL's NCCL_NSOCKS_PERTHREAD); a connection has         \
   * max(1, threads) x this many data sockets (at most 16) plus the control socket. */        \
  FS_PARAM_INT(nsocks_per_thread, "FLOWSCHED_NSOCKS_PERTHREAD", 1, 1, 16,                      \
               "data sockets per helper thread")                                              \
  /* A message is cut into one chunk per data socket, but no chunk is smaller than this      \
   * (NCCL's NCCL_SOCKET_MIN_TASKSIZE), so small messages use fewer sockets. */               \
  FS_PARAM_INT(min_chunk_size, "FLOWSCHED_MIN_CHUNK_SIZE", 64 * 1024, 4096, 64 * 1024 * 1024,  \
               "smallest chunk in bytes")                                                     \
  /* Messages up to this size travel whole on the control socket with their header, moved  \
   * by NCCL's progress thread itself: below ~1 MiB handing a message to helper threads     \
   * costs more than it gains (docs/nccl-plugin-transport.md has the measurements); larger   \
   * ones send a head of min(this, size / (sockets + 1)) there, the rest on data sockets. */ \
  FS_PARAM_INT(inline_size, "FLOWSCHED_INLINE_SIZE", 1024 * 1024, 0, 64 * 1024 * 1024,         \
               "inline threshold, bytes")                                                     \
  /* TCP_NOTSENT_LOWAT on all sockets (0 = kernel default: no limit). Linux builds the IP    \
   * header at transmission time with the socket's current TOS, so unsent bytes leave with a \
   * new DSCP anyway; a limit only adds wake-ups (see docs/nccl-plugin-transport.md). */       \
  FS_PARAM_INT(notsent_lowat, "FLOWSCHED_NOTSENT_LOWAT", 0, 0, 1 << 30,                         \
               "TCP_NOTSENT_LOWAT in bytes")                                                  \
  /* SO_SNDBUF / SO_RCVBUF for all sockets (0 = kernel autotuning). */                        \
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
  /* An accepted socket must bring its hello, and a connection all its sockets, within this \
   * many ms of the first socket's accept; else it is dropped, so that a peer that connects  \
   * and stalls (or dies mid-connect) cannot hold the listener's slots for good. */         \
  FS_PARAM_INT(accept_timeout_ms, "FLOWSCHED_ACCEPT_TIMEOUT_MS", 30000, 100, 3600000,        \
               "ms for an accepted connection to complete")                                   \
  /* Flow class when NCCL's trafficClass maps to none: a label (tp, experience, param_sync,  \
   * kv, kv_reuse, bulk) or a class id. Empty = tp. */                                        \
  FS_PARAM_STR(class_name, "FLOWSCHED_CLASS", "", "flow class of this process's connections") \
  /* The node's shared-memory flow table written by the agent. Unset or empty: the agent's \
   * default for this user, see fs_table_default_path. */                                   \
  FS_PARAM_STR(table_path, "FLOWSCHED_TABLE", FS_DEFAULT_TABLE, "flow table path")          \
  /* Interfaces to use: prefixes separated by commas, '^' to exclude, '=' for exact names. */ \
  FS_PARAM_STR(socket_ifname, "FLOWSCHED_SOCKET_IFNAME", "", "interface selection")           \
  /* Wrapping mode: the NCCL net plugin to load and forward to (a path, a file name, or a    \
   * plugin name X for libnccl-net-X.so, as NCCL_NET_PLUGIN). Empty = our TCP transport.     \
   * Read when the first communicator initialises the library. */                          \
  FS_PARAM_STR(net_inner, "FLOWSCHED_NET_INNER", "", "inner net plugin to wrap")              \
  /* 1 = give the inner plugin the traffic class of the connection's class (the ToS byte of \
   * its level's DSCP); 0 = pass NCCL's trafficClass through unchanged. */                   \
  FS_PARAM_INT(inner_tc, "FLOWSCHED_INNER_TC", 1, 0, 1, "set the inner's trafficClass")      \
  /* Host-side permit (gating): -1 = as the policy file says, else on in wrapping mode and  \
   * off for the TCP transport; 0 = off; 1 = on. */                                          \
  FS_PARAM_INT(gating, "FLOWSCHED_GATING", -1, -1, 1, "defer less urgent sends")              \
  /* Starvation guard: a level that got less than this share (per mille) of a device's    \
   * bytes over the window may send anyway. -1 = the policy file's value, else 50. */        \
  FS_PARAM_INT(gate_min_share, "FLOWSCHED_GATE_MIN_SHARE", -1, -1, 1000,                     \
               "guaranteed share per level, per mille")                                       \
  /* The window over which shares are measured (decayed by half each window), in us;       \
   * -1 = the policy file's value, else 100 ms; 0 is taken as -1, with a warning. */         \
  FS_PARAM_INT(gate_window_us, "FLOWSCHED_GATE_WINDOW_US", -1, -1, 10000000,                 \
               "share window in microseconds")                                                \
  /* Starvation guard: a send deferred this long goes anyway (0 = no age bound), in us.    \
   * Bounds any cross-node dependency on a deferred send. */                                 \
  FS_PARAM_INT(gate_max_defer_us, "FLOWSCHED_GATE_MAX_DEFER_US", -1, -1, 10000000,           \
               "longest deferral in microseconds")                                            \
  /* Fallback for the interface selection when FLOWSCHED_SOCKET_IFNAME is unset. */           \
  FS_PARAM_STR(nccl_socket_ifname, "NCCL_SOCKET_IFNAME", "", "NCCL's interface selection")

#define FS_PARAM_STR_MAX 255 /* bytes of a string knob */
/* The longest flow table path the plugin uses (a knob's; flowsched.rundir.TABLE_PATH_MAX, the
 * agent's limit, must be the same: tests/nccl_plugin/test_layout_agreement.py checks it). */
#define FS_TABLE_PATH_MAX FS_PARAM_STR_MAX

#define FS_PARAM_DECLARE_INT(field, env, def, lo, hi, doc) int64_t field;
#define FS_PARAM_DECLARE_STR(field, env, def, doc) char field[FS_PARAM_STR_MAX + 1];

struct fs_params {
  FS_PARAMS(FS_PARAM_DECLARE_INT, FS_PARAM_DECLARE_STR)
};

/* Read every knob from the environment (called once per initialisation of the plugin). */
void fs_params_load(struct fs_params* params);
/* One string knob read now, without logging (FLOWSCHED_CLASS, per communicator); "" when
 * unset. A value that does not fit in `cap` is not taken for unset: its head is kept, ending
 * in "...", which names no class (no label or id ends so) and shows in the caller's warning. */
void fs_param_peek(const char* env, char* out, size_t cap);
/* Whether a knob is set and not empty, whatever its length. */
int fs_param_is_set(const char* env);
/* Where the agent's table is when FLOWSCHED_TABLE is unset or empty, in the order the agent's
 * clients look (flowsched.rundir.client_path): euid 0: `root_dir`/table; else
 * `xdg`/flowsched/table when that file exists (xdg = $XDG_RUNTIME_DIR, NULL or "" = unset);
 * else `root_dir`/table when it exists (a root agent serving a --group); else the agent's own
 * default for this user: `xdg`/flowsched/table, or /tmp/flowsched-<euid>/table. A path longer
 * than FS_TABLE_PATH_MAX bytes (a long XDG_RUNTIME_DIR), or than `cap` - 1, is never
 * truncated: it is refused with a warning, as if it did not exist ("" when nothing else is
 * there: no table). */
void fs_table_default_path(unsigned euid, const char* xdg, const char* root_dir, char* out,
                           size_t cap);
/* Data sockets per connection: max(1, nthreads) x nsocks_per_thread, at most 16. */
int fs_params_data_sockets(const struct fs_params* params);

#endif
