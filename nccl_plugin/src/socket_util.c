/* SPDX-License-Identifier: Apache-2.0 */
#include "socket_util.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "log.h"

static atomic_int fs_warned_tos, fs_warned_prio, fs_warned_lowat;

/* One comma-separated entry matches `name` (exactly with '=', else as a prefix). */
static int ifname_entry_matches(const char* entry, size_t len, int exact, const char* name) {
  if (exact) {
    return strlen(name) == len && strncmp(entry, name, len) == 0;
  }
  return strncmp(entry, name, len) == 0;
}

int fs_ifname_matches(const char* spec, const char* name) {
  int exclude = 0;
  int exact = 0;
  if (*spec == '^') {
    exclude = 1;
    spec++;
  }
  if (*spec == '=') {
    exact = 1;
    spec++;
  }
  int found = 0;
  while (*spec != '\0' && !found) {
    const char* comma = strchr(spec, ',');
    size_t len = comma != NULL ? (size_t)(comma - spec) : strlen(spec);
    found = len > 0 && ifname_entry_matches(spec, len, exact, name);
    spec += comma != NULL ? len + 1 : len;
  }
  return exclude ? !found : found;
}

static int family_wanted(const struct fs_params* params, int family) {
  if (params->family == 4) {
    return family == AF_INET;
  }
  if (params->family == 6) {
    return family == AF_INET6;
  }
  return family == AF_INET || family == AF_INET6;
}

static int addr_is_link_local(const struct sockaddr* sa) {
  if (sa->sa_family != AF_INET6) {
    return 0;
  }
  return IN6_IS_ADDR_LINKLOCAL(&((const struct sockaddr_in6*)sa)->sin6_addr);
}

/* Rank of an address for an interface: lower is better (IPv4, then global IPv6, then
 * link-local IPv6); -1 when it must not be used. */
static int addr_rank(const struct fs_params* params, const struct sockaddr* sa) {
  if (sa == NULL || !family_wanted(params, sa->sa_family)) {
    return -1;
  }
  if (sa->sa_family == AF_INET) {
    return 0;
  }
  return addr_is_link_local(sa) ? 2 : 1;
}

static int device_find(struct fs_device* devs, int count, const char* name) {
  for (int i = 0; i < count; i++) {
    if (strcmp(devs[i].name, name) == 0) {
      return i;
    }
  }
  return -1;
}

static void device_read_sysfs(struct fs_device* dev) {
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "/sys/class/net/%s/speed", dev->name);
  dev->speed_mbps = 10000;
  FILE* f = fopen(path, "r");
  if (f != NULL) {
    int speed = 0;
    if (fscanf(f, "%d", &speed) == 1 && speed > 0) {
      dev->speed_mbps = speed;
    }
    fclose(f);
  }
  snprintf(path, sizeof(path), "/sys/class/net/%s/device", dev->name);
  dev->pci_path = realpath(path, NULL);
}

/* Interfaces that only connect containers or VMs to this host: never chosen by default. */
static const char* const fs_virtual_prefixes[] = {"docker", "virbr", "veth", "cni", "flannel",
                                                  "cali", "weave", "vxlan", "kube-"};

static int ifname_is_virtual(const char* name) {
  for (size_t i = 0; i < sizeof(fs_virtual_prefixes) / sizeof(fs_virtual_prefixes[0]); i++) {
    if (strncmp(name, fs_virtual_prefixes[i], strlen(fs_virtual_prefixes[i])) == 0) {
      return 1;
    }
  }
  return 0;
}

int fs_ifname_is_bridge(const char* name) {
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "/sys/class/net/%s/bridge", name);
  return access(path, F_OK) == 0;
}

/* The passes of the default selection, as NCCL's: IPoIB first, else anything but loopback
 * and virtual/bridge interfaces, else loopback. */
enum fs_pass { FS_PASS_IB, FS_PASS_OTHER, FS_PASS_LOOPBACK };

static int ifname_in_pass(const char* name, enum fs_pass pass, int (*is_bridge)(const char*)) {
  int lo = strncmp(name, "lo", 2) == 0;
  switch (pass) {
    case FS_PASS_IB:
      return strncmp(name, "ib", 2) == 0;
    case FS_PASS_OTHER:
      return !lo && !ifname_is_virtual(name) && !is_bridge(name);
    default:
      return lo;
  }
}

static int ifname_selected(const struct fs_params* params, const char* name, enum fs_pass pass,
                           int (*is_bridge)(const char*)) {
  const char* spec = params->socket_ifname[0] ? params->socket_ifname : params->nccl_socket_ifname;
  return spec[0] ? fs_ifname_matches(spec, name) : ifname_in_pass(name, pass, is_bridge);
}

/* An interface that can carry traffic now: up, and with a carrier (IFF_RUNNING). */
static int if_usable(unsigned int flags) {
  return (flags & IFF_UP) && (flags & IFF_RUNNING);
}

static void devices_collect(const struct fs_params* params, const struct ifaddrs* list,
                            enum fs_pass pass, int (*is_bridge)(const char*),
                            struct fs_device* out, int* ranks, int* count) {
  for (const struct ifaddrs* ifa = list; ifa != NULL; ifa = ifa->ifa_next) {
    int rank = addr_rank(params, ifa->ifa_addr);
    if (rank < 0 || !if_usable(ifa->ifa_flags) ||
        !ifname_selected(params, ifa->ifa_name, pass, is_bridge)) {
      continue;
    }
    int i = device_find(out, *count, ifa->ifa_name);
    if (i < 0 && *count < FS_MAX_DEVICES) {
      i = (*count)++;
      snprintf(out[i].name, sizeof(out[i].name), "%s", ifa->ifa_name);
      ranks[i] = INT_MAX;
    }
    if (i >= 0 && rank < ranks[i]) {
      ranks[i] = rank;
      socklen_t len = ifa->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in)
                                                          : sizeof(struct sockaddr_in6);
      memset(&out[i].addr, 0, sizeof(out[i].addr));
      memcpy(&out[i].addr.ss, ifa->ifa_addr, len);
      out[i].addr.len = len;
    }
  }
}

void fs_devices_select(const struct fs_params* params, const struct ifaddrs* list,
                       int (*is_bridge)(const char*), struct fs_device* out, int* count) {
  int ranks[FS_MAX_DEVICES];
  *count = 0;
  /* With a selector there is one pass; the passes only order the default selection. */
  for (int pass = FS_PASS_IB; pass <= FS_PASS_LOOPBACK && *count == 0; pass++) {
    devices_collect(params, list, (enum fs_pass)pass, is_bridge, out, ranks, count);
  }
}

int fs_devices_discover(const struct fs_params* params, struct fs_device* out, int* count) {
  struct ifaddrs* list = NULL;
  if (getifaddrs(&list) != 0) {
    return FS_NEG_ERRNO();
  }
  fs_devices_select(params, list, fs_ifname_is_bridge, out, count);
  freeifaddrs(list);
  for (int i = 0; i < *count; i++) {
    device_read_sysfs(&out[i]);
  }
  return 0;
}

void fs_devices_free(struct fs_device* devs, int count) {
  for (int i = 0; i < count; i++) {
    free(devs[i].pci_path);
    devs[i].pci_path = NULL;
  }
}

const char* fs_addr_str(const struct fs_addr* addr, char* buf, size_t cap) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr->ss.ss_family == AF_INET) {
    const struct sockaddr_in* sin = (const struct sockaddr_in*)&addr->ss;
    inet_ntop(AF_INET, &sin->sin_addr, host, sizeof(host));
    port = ntohs(sin->sin_port);
  } else if (addr->ss.ss_family == AF_INET6) {
    const struct sockaddr_in6* sin6 = (const struct sockaddr_in6*)&addr->ss;
    inet_ntop(AF_INET6, &sin6->sin6_addr, host, sizeof(host));
    port = ntohs(sin6->sin6_port);
  }
  snprintf(buf, cap, "%s port %d", host, port);
  return buf;
}

static void set_int_opt(int fd, int level, int name, int value, atomic_int* warned,
                        const char* what) {
  if (setsockopt(fd, level, name, &value, sizeof(value)) != 0) {
    FS_WARN_ONCE(*warned, "setsockopt(%s=%d) failed: %s (continuing without it)", what, value,
                 fs_errstr(errno));
  }
}

void fs_sock_tune(int fd, const struct fs_params* params) {
  static atomic_int warned_nodelay, warned_buf;
  set_int_opt(fd, IPPROTO_TCP, TCP_NODELAY, 1, &warned_nodelay, "TCP_NODELAY");
  if (params->sock_buf > 0) {
    set_int_opt(fd, SOL_SOCKET, SO_SNDBUF, (int)params->sock_buf, &warned_buf, "SO_SNDBUF");
    set_int_opt(fd, SOL_SOCKET, SO_RCVBUF, (int)params->sock_buf, &warned_buf, "SO_RCVBUF");
  }
  if (params->tcp_congestion[0] != '\0' &&
      setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, params->tcp_congestion,
                 (socklen_t)strlen(params->tcp_congestion)) != 0) {
    static atomic_int warned_cc;
    FS_WARN_ONCE(warned_cc, "setsockopt(TCP_CONGESTION=%s) failed: %s (continuing without it)",
                 params->tcp_congestion, fs_errstr(errno));
  }
  if (params->notsent_lowat > 0) {
    set_int_opt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, (int)params->notsent_lowat, &fs_warned_lowat,
                "TCP_NOTSENT_LOWAT");
  }
}

void fs_sock_apply_marking(int fd, int family, const struct fs_level_marking* marking) {
  int tos = (int)(marking->dscp & 0x3f) << 2;
  if (family == AF_INET6) {
    set_int_opt(fd, IPPROTO_IPV6, IPV6_TCLASS, tos, &fs_warned_tos, "IPV6_TCLASS");
  } else {
    set_int_opt(fd, IPPROTO_IP, IP_TOS, tos, &fs_warned_tos, "IP_TOS");
  }
  set_int_opt(fd, SOL_SOCKET, SO_PRIORITY, (int)marking->so_priority, &fs_warned_prio,
              "SO_PRIORITY");
}

void fs_sock_bind_device(int fd, const struct fs_device* device, int family) {
  if (device == NULL || device->addr.ss.ss_family != family) {
    return; /* the peer is reached over the other family: let routing pick the source */
  }
  static atomic_int warned_bind;
  int one = 1;
  /* the port is chosen at connect time, so binding does not use up ephemeral ports early */
  (void)setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
  struct fs_addr local = device->addr; /* port 0 */
  if (bind(fd, (const struct sockaddr*)&local.ss, local.len) != 0) {
    char text[96];
    FS_WARN_ONCE(warned_bind, "cannot bind to %s on %s: %s (connecting from any address)",
                 fs_addr_str(&local, text, sizeof(text)), device->name, fs_errstr(errno));
  }
}
