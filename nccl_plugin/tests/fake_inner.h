/* SPDX-License-Identifier: Apache-2.0
 * The recording fake inner net plugin (fake_inner.c): what it records and how a test steers
 * it. A test dlopens the fake itself (the wrapper's dlopen of the same path returns the same
 * object) and reads `fake_state` through dlsym. */
#ifndef FLOWSCHED_FAKE_INNER_H
#define FLOWSCHED_FAKE_INNER_H

#include <stddef.h>
#include <stdint.h>

#include "nccl/common.h"

#define FAKE_MAX_CALLS 256
#define FAKE_MAX_N 8

struct fake_call {
  char fn[24];
  void* ctx;      /* init (the context it returned), listen, connect, finalize, setNetAttr */
  void* comm;     /* the inner comm or listen comm the call was given */
  void* handle;   /* listen/connect: the handle buffer */
  void* devcomm;  /* connect/accept: the device-handle pointer */
  int dev;
  int tc;         /* init (v11/v12) or connect (v10): the trafficClass; -2 = none given */
  uint64_t comm_id;
  ncclDebugLogger_t logger;    /* init: the logger it was given (and called at once) */
  ncclProfilerCallback_t prof; /* init: the profiler callback it was given */
  void* data;
  size_t size;
  int type;
  uint64_t offset;
  int fd;
  int tag;
  void* mhandle;
  void* phandle;
  int n;
  void* datas[FAKE_MAX_N];
  size_t sizes[FAKE_MAX_N];
  int isizes[FAKE_MAX_N];
  int tags[FAKE_MAX_N];
  void* mhandles[FAKE_MAX_N];
  void* phandles[FAKE_MAX_N];
  void* request_in; /* irecv: *request on entry (NCCL's 0x1 hint) */
  void* request;    /* the request it returned / was given */
  uint32_t op, algo, proto;
  int vdevs;
};

struct fake_state {
  int version;        /* the table version this build exports */
  int fail_init;      /* init returns this (0 = success) */
  int fail_connect;   /* connect returns this */
  int connect_nulls;  /* connect answers NULL this many times first (retry contract) */
  int defer_isends;   /* isend answers a NULL request this many times */
  int complete_sends; /* 0: isend requests stay incomplete until set to 1 */
  _Atomic int block_init;   /* 1: the next init waits until the test sets it back to 0 */
  _Atomic int init_blocked; /* 1 while an init waits there */
  int ncalls;
  struct fake_call calls[FAKE_MAX_CALLS];
};

#endif
