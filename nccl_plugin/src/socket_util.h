/* SPDX-License-Identifier: Apache-2.0
 * Interface discovery and the small socket-option helpers. Each option helper degrades: it
 * warns once and carries on when the kernel refuses an option. */
#ifndef FLOWSCHED_SOCKET_UTIL_H
#define FLOWSCHED_SOCKET_UTIL_H

#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "flow_table.h"
#include "param.h"

#define FS_MAX_DEVICES 8

struct fs_addr {
  struct sockaddr_storage ss;
  socklen_t len;
};

struct fs_device {
  char name[IF_NAMESIZE + 1];
  struct fs_addr addr; /* port 0: the address listeners bind to */
  int speed_mbps;
  char* pci_path; /* realpath of /sys/class/net/<if>/device, or NULL (virtual interface) */
};

/* Pick the interfaces selected by FLOWSCHED_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, else by
 * default (NCCL's order): ib* first; else every interface but loopback, container/VM
 * interfaces (docker, virbr, veth, cni, flannel, cali, weave, vxlan, kube-) and bridges;
 * else loopback. Only interfaces that are up and RUNNING (carrier) count. */
int fs_devices_discover(const struct fs_params* params, struct fs_device* out, int* count);
/* The same selection over a given interface list (tests pass their own list and bridge test). */
struct ifaddrs;
void fs_devices_select(const struct fs_params* params, const struct ifaddrs* list,
                       int (*is_bridge)(const char*), struct fs_device* out, int* count);
/* Is `name` a Linux bridge (/sys/class/net/<name>/bridge exists)? */
int fs_ifname_is_bridge(const char* name);
void fs_devices_free(struct fs_device* devs, int count);
/* Does `name` pass an NCCL-style interface selector ("eth,ib", "^docker", "=eth0")? */
int fs_ifname_matches(const char* spec, const char* name);
/* "addr%scope port" for logs. */
const char* fs_addr_str(const struct fs_addr* addr, char* buf, size_t cap);

/* Options every socket of ours gets (TCP_NODELAY, buffers, congestion control,
 * TCP_NOTSENT_LOWAT); the control socket carries payloads up to the inline size too. */
void fs_sock_tune(int fd, const struct fs_params* params);
/* Bind a connecting socket to its device's address (the device NCCL chose for this
 * connection): its packets carry that source address. The routing table still picks the
 * interface they leave through (the device's own only with source-address rules, as
 * multi-NIC hosts set up). A no-op when the peer's family differs. Failure is warned once,
 * never fatal. */
void fs_sock_bind_device(int fd, const struct fs_device* device, int family);
/* Put a level on a socket: DSCP first (IP_TOS / IPV6_TCLASS), then SO_PRIORITY, because
 * setting IP_TOS overwrites SO_PRIORITY on Linux. Failures are warned once, never fatal. */
void fs_sock_apply_marking(int fd, int family, const struct fs_level_marking* marking);

#endif
