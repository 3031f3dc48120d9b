/* SPDX-License-Identifier: Apache-2.0
 * Unit test of where the plugin looks for the agent's flow table when FLOWSCHED_TABLE is unset
 * (fs_table_default_path): the order flowsched.rundir.client_path uses, so that the plugin and
 * the agent meet without configuration.
 *
 *   test_param        exit status 0 when every case resolves to what the table says
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "param.h"

static int failures;

static void expect(const char* what, const char* got, const char* want) {
  if (strcmp(got, want) != 0) {
    fprintf(stderr, "FAIL %s: got %s, want %s\n", what, got, want);
    failures++;
  }
}

static void touch(const char* dir, const char* sub) {
  char path[1400];
  snprintf(path, sizeof(path), "%s/%s", dir, sub);
  if (mkdir(path, 0700) != 0) {
    perror(path);
    exit(2);
  }
  snprintf(path, sizeof(path), "%s/%s/table", dir, sub);
  FILE* f = fopen(path, "w");
  if (f == NULL) {
    perror(path);
    exit(2);
  }
  fclose(f);
}

int main(void) {
  char base[] = "/tmp/fs-param-XXXXXX";
  if (mkdtemp(base) == NULL) {
    perror("mkdtemp");
    return 2;
  }
  char xdg[600], run[600], out[256], want[700];
  snprintf(xdg, sizeof(xdg), "%s/xdg", base);  /* holds flowsched/table once touched */
  snprintf(run, sizeof(run), "%s/run", base);  /* stands in for /run/flowsched */
  mkdir(xdg, 0700);

  /* nothing exists yet: root uses the root directory, a user its own default */
  fs_table_default_path(0, xdg, run, out, sizeof(out));
  snprintf(want, sizeof(want), "%s/table", run);
  expect("root", out, want);
  fs_table_default_path(1234, xdg, run, out, sizeof(out));
  snprintf(want, sizeof(want), "%s/flowsched/table", xdg);
  expect("user with XDG, nothing there", out, want);
  fs_table_default_path(1234, NULL, run, out, sizeof(out));
  expect("user without XDG", out, "/tmp/flowsched-1234/table");
  fs_table_default_path(1234, "", run, out, sizeof(out));
  expect("user with empty XDG", out, "/tmp/flowsched-1234/table");

  /* a root agent serving a --group: a user without a table of its own finds root's */
  if (mkdir(run, 0700) != 0) {
    perror(run);
    return 2;
  }
  FILE* f = fopen(strcat(strcpy(want, run), "/table"), "w");
  fclose(f);
  fs_table_default_path(1234, xdg, run, out, sizeof(out));
  expect("user, only the root agent's table exists", out, want);
  fs_table_default_path(1234, NULL, run, out, sizeof(out));
  expect("user without XDG, only the root agent's table", out, want);

  /* the user's own agent wins over root's */
  touch(xdg, "flowsched");
  fs_table_default_path(1234, xdg, run, out, sizeof(out));
  snprintf(want, sizeof(want), "%s/flowsched/table", xdg);
  expect("user whose own table exists", out, want);
  fs_table_default_path(0, xdg, run, out, sizeof(out));
  snprintf(want, sizeof(want), "%s/table", run);
  expect("root ignores XDG", out, want);

  /* FLOWSCHED_TABLE set wins; unset or empty takes the default (the real /run/flowsched) */
  struct fs_params params;
  setenv("FLOWSCHED_TABLE", "/somewhere/table", 1);
  fs_params_load(&params);
  expect("FLOWSCHED_TABLE set", params.table_path, "/somewhere/table");
  setenv("FLOWSCHED_TABLE", "", 1);
  setenv("XDG_RUNTIME_DIR", xdg, 1);
  fs_params_load(&params);
  fs_table_default_path((unsigned)geteuid(), xdg, FS_RUN_DIR, out, sizeof(out));
  expect("FLOWSCHED_TABLE empty", params.table_path, out);
  unsetenv("FLOWSCHED_TABLE");
  fs_params_load(&params);
  expect("FLOWSCHED_TABLE unset", params.table_path, out);
  if (geteuid() == 0) {
    expect("root default", params.table_path, "/run/flowsched/table");
  }

  char cmd[700];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", base);
  if (system(cmd) != 0) {
    fprintf(stderr, "cannot remove %s\n", base);
  }
  if (failures == 0) {
    printf("ok table default path (FLOWSCHED_TABLE, root, XDG, a root agent's group table)\n");
  }
  return failures == 0 ? 0 : 1;
}
