/* SPDX-License-Identifier: Apache-2.0
 * Unit test of where the plugin looks for the agent's flow table when FLOWSCHED_TABLE is unset
 * (fs_table_default_path): the order flowsched.rundir.client_path uses, so that the plugin and
 * the agent meet without configuration.
 *
 *   test_param        exit status 0 when every case resolves to what the table says
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "param.h"
#include "warn_capture.h"

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

/* XDG_RUNTIME_DIR of `len` bytes (a directory that does not exist). */
static char* xdg_of_length(size_t len) {
  char* xdg = malloc(len + 1);
  memset(xdg, 'x', len);
  xdg[0] = '/';
  xdg[len] = '\0';
  return xdg;
}

/* A long XDG_RUNTIME_DIR: $XDG_RUNTIME_DIR/flowsched/table (16 bytes after it) is used up to
 * FS_TABLE_PATH_MAX bytes, never truncated beyond: refused with a warning that names the
 * variable and the limit, the root agent's table taken instead when there is one, else none. */
static void long_xdg(const char* run, int root_table_exists) {
  static const struct {
    size_t xdg_len;
    int refused;
  } cases[] = {{FS_TABLE_PATH_MAX - 16, 0}, {FS_TABLE_PATH_MAX - 15, 1}, {4000, 1}};
  char root_table[700], out[FS_TABLE_PATH_MAX + 1], what[160];
  snprintf(root_table, sizeof(root_table), "%s/table", run);
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    char* xdg = xdg_of_length(cases[i].xdg_len);
    char own[4100];
    snprintf(own, sizeof(own), "%s/flowsched/table", xdg);
    /* the own path (never there) loses to the root agent's table, if any, either way */
    const char* want = root_table_exists ? root_table : cases[i].refused ? "" : own;
    snprintf(what, sizeof(what), "XDG_RUNTIME_DIR of %zu bytes%s", cases[i].xdg_len,
             root_table_exists ? ", a root agent's table" : "");
    warnings[0] = '\0';
    fs_table_default_path(1234, xdg, run, out, sizeof(out));
    expect(what, out, want);
    /* warned once per process: the first refusal says it */
    if (cases[i].refused && cases[i].xdg_len == FS_TABLE_PATH_MAX - 15 && !root_table_exists &&
        (strstr(warnings, "XDG_RUNTIME_DIR") == NULL || strstr(warnings, "255 bytes") == NULL)) {
      fprintf(stderr, "FAIL %s: no warning naming XDG_RUNTIME_DIR and the limit (got: %s)\n",
              what, warnings);
      failures++;
    }
    free(xdg);
  }
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
  fs_log_set_logger(capture);
  long_xdg(run, 0);

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
  long_xdg(run, 1);

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
    printf("ok table default path (FLOWSCHED_TABLE, root, XDG, a root agent's group table, "
           "an XDG_RUNTIME_DIR too long)\n");
  }
  return failures == 0 ? 0 : 1;
}
