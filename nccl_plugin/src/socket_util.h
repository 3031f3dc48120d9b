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

/* Pick the interfaces selected by FLOWSCHED_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. */
int fs_devices_discover(const struct fs_params* params, struct fs_device* out, int* count);
void fs_devices_free(struct fs_device* devs, int count);
/* Does `name` pass an NCCL-style interface selector ("eth,ib", "^docker", "=eth0")? */
int fs_ifname_matches(const char* spec, const char* name);
/* "addr%scope port" for logs. */
const char* fs_addr_str(const struct fs_addr* addr, char* buf, size_t cap);

/* Options every socket of ours gets (TCP_NODELAY, buffers, TCP_NOTSENT_LOWAT on data). */
void fs_sock_tune(int fd, const struct fs_params* params, int is_data);
/* Put a level on a socket: DSCP first (IP_TOS / IPV6_TCLASS), then SO_PRIORITY, because
 * setting IP_TOS overwrites SO_PRIORITY on Linux. Failures are warned once, never fatal. */
void fs_sock_apply_marking(int fd, int family, const struct fs_level_marking* marking);

#endif
