/* SPDX-License-Identifier: Apache-2.0
 *
 * Types shared by every NCCL net-plugin ABI version we export (v10, v11, v12).
 * Written from the documented ABI facts (see the project's reference notes); NCCL ships no
 * plugin headers in its wheels, so the plugin carries its own binary-compatible definitions.
 * The vtables are positional: member order and types must never change.
 */
#ifndef FLOWSCHED_NCCL_COMMON_H
#define FLOWSCHED_NCCL_COMMON_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5,
} ncclDebugLogLevel;

/* Subsystem flags passed with every log line. */
#define NCCL_INIT 1UL
#define NCCL_NET 16UL

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                  int line, const char* fmt, ...);

/* v10+: the profiler callback NCCL hands to init (may be NULL). */
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle,
                                               int64_t pluginId, void* extData);

#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
#define NCCL_NET_MAX_REQUESTS 32
#define NCCL_NET_OPTIONAL_RECV_COMPLETION 0x1
#define NCCL_MAX_NET_SIZE_BYTES (1ULL << 40) /* 1 TiB, the largest maxP2pBytes NCCL accepts */
#define NCCL_MAX_COLLNET_SIZE (512ULL << 20)
#define NCCL_NET_TRAFFIC_CLASS_UNDEF (-1)
#define NCCL_NET_ATTR_UNDEF (-1)
#define NCCL_NET_ID_UNDEF (-1)

typedef enum {
  NCCL_NET_DEVICE_HOST = 0,
  NCCL_NET_DEVICE_UNPACK = 1,
} ncclNetDeviceType;

#define NCCL_NET_DEVICE_INVALID_VERSION 0x0

/* Identical for v7..v12. A host plugin never fills it. */
typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_t;

#endif
