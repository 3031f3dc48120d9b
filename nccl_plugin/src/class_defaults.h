/* SPDX-License-Identifier: Apache-2.0
 * Compiled-in defaults used when no agent table is attached (no agent, no table, or a
 * corrupt one). They equal the shipped default policy (flowsched/data/policies/default.toml):
 * a test compares them with flowsched.policyfile's view of that file. */
#ifndef FLOWSCHED_CLASS_DEFAULTS_H
#define FLOWSCHED_CLASS_DEFAULTS_H

#include <stdint.h>

#define FS_NUM_CLASSES 6 /* tp, experience, param_sync, kv, kv_reuse, bulk (FlowClass ids) */
#define FS_CLASS_TP 0
#define FS_DEFAULT_NUM_LEVELS 8

/* Static level of each class id until an agent writes one (0 = most urgent). */
static const uint8_t fs_default_class_level[FS_NUM_CLASSES] = {
    0, /* tp */
    3, /* experience */
    2, /* param_sync */
    1, /* kv */
    2, /* kv_reuse */
    7, /* bulk: K-1 */
};

/* DSCP code point (0..63) and SO_PRIORITY of each level, most urgent first (policyfile.py's
 * DEFAULT_DSCPS: none in 24-31 or 48-55, RoCE's usual lossless and CNP code points). */
static const uint8_t fs_default_level_dscp[FS_DEFAULT_NUM_LEVELS] = {46, 40, 34, 32, 18, 10, 8, 1};
static const uint32_t fs_default_level_prio[FS_DEFAULT_NUM_LEVELS] = {6, 5, 4, 3, 2, 1, 0, 0};

/* Default trafficClass map: value i selects class id i (tp 0 ... bulk 5). */
#define FS_DEFAULT_TRAFFIC_CLASS_MAP_SIZE FS_NUM_CLASSES

static const char* const fs_class_labels[FS_NUM_CLASSES] = {
    "tp", "experience", "param_sync", "kv", "kv_reuse", "bulk",
};

#endif
