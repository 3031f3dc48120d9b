/* SPDX-License-Identifier: Apache-2.0
 * Unit test of the interface selection (fs_devices_select) on made-up interface lists: which
 * interfaces are chosen, in which order, by default and with NCCL-style selectors.
 *
 *   test_socket_util        exit status 0 when every case selects what the table says
 */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <stdio.h>
#include <string.h>

#include "socket_util.h"

#define UP_RUNNING (IFF_UP | IFF_RUNNING)

struct fake_if {
  const char* name;
  unsigned int flags;
  const char* ipv4;
};

static int fake_bridge(const char* name) {
  return strcmp(name, "br0") == 0 || strcmp(name, "mgmtbr") == 0;
}

/* Build a getifaddrs-like list (one IPv4 address per entry) in caller storage. */
static struct ifaddrs* fake_list(const struct fake_if* ifs, int n, struct ifaddrs* nodes,
                                 struct sockaddr_in* addrs) {
  for (int i = 0; i < n; i++) {
    memset(&addrs[i], 0, sizeof(addrs[i]));
    addrs[i].sin_family = AF_INET;
    inet_pton(AF_INET, ifs[i].ipv4, &addrs[i].sin_addr);
    nodes[i] = (struct ifaddrs){.ifa_next = i + 1 < n ? &nodes[i + 1] : NULL,
                                .ifa_name = (char*)ifs[i].name,
                                .ifa_flags = ifs[i].flags,
                                .ifa_addr = (struct sockaddr*)&addrs[i]};
  }
  return n > 0 ? &nodes[0] : NULL;
}

struct select_case {
  const char* what;
  const char* selector; /* FLOWSCHED_SOCKET_IFNAME, "" = default */
  struct fake_if ifs[8];
  int nifs;
  const char* want; /* the chosen names, comma-separated, in order */
};

static const struct select_case k_cases[] = {
    {"an interface that is up without a carrier is not used", "",
     {{"lo", UP_RUNNING, "127.0.0.1"}, {"eth0", IFF_UP, "10.0.0.1"}, {"eth1", UP_RUNNING, "10.0.1.1"}},
     3, "eth1"},
    {"IPoIB first, as NCCL", "",
     {{"eth0", UP_RUNNING, "10.0.0.1"}, {"ib0", UP_RUNNING, "10.1.0.1"}, {"ib1", UP_RUNNING, "10.1.1.1"}},
     3, "ib0,ib1"},
    {"an IPoIB interface without a carrier does not hide ethernet", "",
     {{"ib0", IFF_UP, "10.1.0.1"}, {"eth0", UP_RUNNING, "10.0.0.1"}}, 2, "eth0"},
    {"bridges, veth, cni, docker, virbr are not chosen by default", "",
     {{"br0", UP_RUNNING, "10.2.0.1"}, {"veth12ab", UP_RUNNING, "10.3.0.1"},
      {"cni0", UP_RUNNING, "10.4.0.1"}, {"docker0", UP_RUNNING, "172.17.0.1"},
      {"virbr0", UP_RUNNING, "192.168.122.1"}, {"mgmtbr", UP_RUNNING, "10.5.0.1"},
      {"enp1s0", UP_RUNNING, "10.0.0.2"}},
     7, "enp1s0"},
    {"loopback only when nothing else is usable", "",
     {{"lo", UP_RUNNING, "127.0.0.1"}, {"veth0", UP_RUNNING, "10.3.0.1"}}, 2, "lo"},
    {"a selector can still name a bridge", "br",
     {{"br0", UP_RUNNING, "10.2.0.1"}, {"eth0", UP_RUNNING, "10.0.0.1"}}, 2, "br0"},
    {"an exclusion selector", "^eth0",
     {{"eth0", UP_RUNNING, "10.0.0.1"}, {"eth1", UP_RUNNING, "10.0.1.1"}}, 2, "eth1"},
    {"a selector never picks an interface without a carrier", "=eth0",
     {{"eth0", IFF_UP, "10.0.0.1"}, {"eth1", UP_RUNNING, "10.0.1.1"}}, 2, ""},
};

static int run_case(const struct select_case* c) {
  struct ifaddrs nodes[8];
  struct sockaddr_in addrs[8];
  struct fs_params params;
  memset(&params, 0, sizeof(params));
  snprintf(params.socket_ifname, sizeof(params.socket_ifname), "%s", c->selector);
  struct fs_device devs[FS_MAX_DEVICES];
  int count = 0;
  fs_devices_select(&params, fake_list(c->ifs, c->nifs, nodes, addrs), fake_bridge, devs, &count);
  char got[256] = "";
  for (int i = 0; i < count; i++) {
    if (i > 0) {
      strncat(got, ",", sizeof(got) - strlen(got) - 1);
    }
    strncat(got, devs[i].name, sizeof(got) - strlen(got) - 1);
  }
  if (strcmp(got, c->want) != 0) {
    fprintf(stderr, "FAIL %s: chose \"%s\", expected \"%s\"\n", c->what, got, c->want);
    return 1;
  }
  return 0;
}

int main(void) {
  int failed = 0;
  int n = (int)(sizeof(k_cases) / sizeof(k_cases[0]));
  for (int i = 0; i < n; i++) {
    failed += run_case(&k_cases[i]);
  }
  if (failed == 0) {
    printf("ok interface selection (%d cases)\n", n);
  }
  return failed != 0;
}
