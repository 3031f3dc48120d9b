/* SPDX-License-Identifier: Apache-2.0
 * Prints the C view of the shared-memory table layout, the compiled-in class defaults and the
 * longest table path the plugin uses as JSON; tests/nccl_plugin/test_layout_agreement.py
 * compares them with flowsched/shm/layout.py, the shipped default policy and
 * flowsched/rundir.py. */
#include <stddef.h>
#include <stdio.h>

#include "class_defaults.h"
#include "flow_table.h"
#include "param.h"

#define FIELD(type, name) \
  printf("%s\"%s\": [%zu, %zu]", first ? "" : ", ", #name, offsetof(type, name), \
         sizeof(((type*)0)->name)), first = 0

static void print_u8_list(const char* key, const uint8_t* v, int n) {
  printf("\"%s\": [", key);
  for (int i = 0; i < n; i++) printf("%s%u", i ? ", " : "", v[i]);
  printf("]");
}

int main(void) {
  int first = 1;
  printf("{\"header\": {");
  FIELD(struct fs_table_header, magic);
  FIELD(struct fs_table_header, version);
  FIELD(struct fs_table_header, header_size);
  FIELD(struct fs_table_header, slot_size);
  FIELD(struct fs_table_header, num_slots);
  FIELD(struct fs_table_header, num_levels);
  FIELD(struct fs_table_header, agent_pid);
  FIELD(struct fs_table_header, config_seq);
  FIELD(struct fs_table_header, generation);
  FIELD(struct fs_table_header, heartbeat_ns);
  FIELD(struct fs_table_header, flags);
  FIELD(struct fs_table_header, num_class_map);
  FIELD(struct fs_table_header, fallback_class);
  FIELD(struct fs_table_header, class_map);
  FIELD(struct fs_table_header, default_level);
  FIELD(struct fs_table_header, gate_mode);
  FIELD(struct fs_table_header, gate_min_share);
  FIELD(struct fs_table_header, gate_window_ms);
  FIELD(struct fs_table_header, gate_max_defer_ms);
  FIELD(struct fs_table_header, level_marking);
  first = 1;
  printf("}, \"slot\": {");
  FIELD(struct fs_table_slot, state);
  FIELD(struct fs_table_slot, pid);
  FIELD(struct fs_table_slot, claim_seq);
  FIELD(struct fs_table_slot, comm_id);
  FIELD(struct fs_table_slot, peer_rank);
  FIELD(struct fs_table_slot, traffic_class);
  FIELD(struct fs_table_slot, level);
  FIELD(struct fs_table_slot, class_id);
  FIELD(struct fs_table_slot, direction);
  FIELD(struct fs_table_slot, flags);
  FIELD(struct fs_table_slot, bytes);
  FIELD(struct fs_table_slot, messages);
  FIELD(struct fs_table_slot, open_ns);
  FIELD(struct fs_table_slot, last_ns);
  FIELD(struct fs_table_slot, net_op);
  FIELD(struct fs_table_slot, net_algo);
  FIELD(struct fs_table_slot, net_proto);
  FIELD(struct fs_table_slot, applied_level);
  FIELD(struct fs_table_slot, applied_ns);
  FIELD(struct fs_table_slot, level_set_ns);
  FIELD(struct fs_table_slot, dev);
  FIELD(struct fs_table_slot, pid_ns);
  FIELD(struct fs_table_slot, start_ticks);
  printf("}, \"sizes\": {\"header\": %zu, \"slot\": %zu, \"class_map_entry\": %zu, "
         "\"level_marking_entry\": %zu}",
         sizeof(struct fs_table_header), sizeof(struct fs_table_slot),
         sizeof(struct fs_class_map_entry), sizeof(struct fs_level_marking));
  printf(", \"constants\": {\"MAGIC\": %u, \"VERSION\": %u, \"MAX_LEVELS\": %d, "
         "\"MAX_CLASS_MAP\": %d, \"MAX_CLASSES\": %d, \"LEVEL_UNSET\": %u, \"SLOT_FREE\": %d, "
         "\"SLOT_CLAIMED\": %d, \"SLOT_ACTIVE\": %d, \"SLOT_CLOSED\": %d, \"DIR_SEND\": %d, "
         "\"DIR_RECV\": %d}",
         FS_TABLE_MAGIC, FS_TABLE_VERSION, FS_TABLE_MAX_LEVELS, FS_TABLE_MAX_CLASS_MAP,
         FS_TABLE_MAX_CLASSES, FS_LEVEL_UNSET, FS_SLOT_FREE, FS_SLOT_CLAIMED, FS_SLOT_ACTIVE,
         FS_SLOT_CLOSED, FS_DIR_SEND, FS_DIR_RECV);
  printf(", \"limits\": {\"table_path\": %d}", FS_TABLE_PATH_MAX);
  printf(", \"defaults\": {\"num_levels\": %d, ", FS_DEFAULT_NUM_LEVELS);
  print_u8_list("class_level", fs_default_class_level, FS_NUM_CLASSES);
  printf(", ");
  print_u8_list("dscp", fs_default_level_dscp, FS_DEFAULT_NUM_LEVELS);
  printf(", \"so_priority\": [");
  for (int i = 0; i < FS_DEFAULT_NUM_LEVELS; i++) printf("%s%u", i ? ", " : "", fs_default_level_prio[i]);
  printf("], \"class_labels\": [");
  for (int i = 0; i < FS_NUM_CLASSES; i++) printf("%s\"%s\"", i ? ", " : "", fs_class_labels[i]);
  printf("]}}\n");
  return 0;
}
