/* SPDX-License-Identifier: Apache-2.0
 * The baseline for bench/plugin_bench.py: a plain blocking TCP sender/receiver pair over
 * loopback (two processes), with the same message pattern as the plugin benchmark.
 *
 *   plain_tcp bw SIZE COUNT     sender writes COUNT messages of SIZE bytes; prints MB/s
 *   plain_tcp rtt COUNT         8-byte ping-pong; prints the mean round trip in microseconds
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char* what) {
  perror(what);
  exit(1);
}

static void io_all(int fd, void* buf, size_t len, int is_send) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = is_send ? send(fd, (char*)buf + done, len - done, MSG_NOSIGNAL)
                        : recv(fd, (char*)buf + done, len - done, 0);
    if (n <= 0) die(is_send ? "send" : "recv");
    done += (size_t)n;
  }
}

static int tcp_pair(int* server_side) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof(addr);
  if (lfd < 0 || bind(lfd, (struct sockaddr*)&addr, len) || listen(lfd, 1) ||
      getsockname(lfd, (struct sockaddr*)&addr, &len)) {
    die("listen");
  }
  pid_t child = fork();
  if (child < 0) die("fork");
  int one = 1;
  if (child == 0) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr*)&addr, len)) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    *server_side = 0;
    close(lfd);
    return fd;
  }
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) die("accept");
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  close(lfd);
  *server_side = 1;
  return fd;
}

static int run_bw(size_t size, long count) {
  int server = 0;
  int fd = tcp_pair(&server);
  char* buf = malloc(size ? size : 1);
  memset(buf, 0x5a, size ? size : 1);
  double t0 = now_s();
  char ack = 0;
  for (long i = 0; i < count; i++) {
    io_all(fd, buf, size, !server); /* child sends, parent receives */
  }
  if (server) {
    io_all(fd, &ack, 1, 1);
    wait(NULL);
    double dt = now_s() - t0;
    printf("{\"mode\": \"bw\", \"size\": %zu, \"count\": %ld, \"seconds\": %.6f, \"MBps\": %.1f}\n",
           size, count, dt, (double)size * (double)count / dt / 1e6);
  } else {
    io_all(fd, &ack, 1, 0);
    _exit(0);
  }
  return 0;
}

static int run_rtt(long count) {
  int server = 0;
  int fd = tcp_pair(&server);
  uint64_t msg = 0;
  long warmup = count / 10;
  double t0 = 0;
  for (long i = 0; i < count + warmup; i++) {
    if (i == warmup) t0 = now_s();
    if (server) {
      io_all(fd, &msg, sizeof(msg), 1);
      io_all(fd, &msg, sizeof(msg), 0);
    } else {
      io_all(fd, &msg, sizeof(msg), 0);
      io_all(fd, &msg, sizeof(msg), 1);
    }
  }
  if (!server) _exit(0);
  double dt = now_s() - t0;
  wait(NULL);
  printf("{\"mode\": \"rtt\", \"count\": %ld, \"rtt_us\": %.3f}\n", count, dt / (double)count * 1e6);
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 4 && strcmp(argv[1], "bw") == 0) {
    return run_bw(strtoull(argv[2], NULL, 0), atol(argv[3]));
  }
  if (argc >= 3 && strcmp(argv[1], "rtt") == 0) {
    return run_rtt(atol(argv[2]));
  }
  fprintf(stderr, "usage: %s bw SIZE COUNT | rtt COUNT\n", argv[0]);
  return 2;
}
