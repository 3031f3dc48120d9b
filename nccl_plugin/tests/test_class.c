/* SPDX-License-Identifier: Apache-2.0
 * Unit test of FLOWSCHED_CLASS (fs_class_resolve): a label or an id gives that class; any other
 * value gives tp with a warning that names the variable, however long the value is (a value
 * longer than the context keeps is no more a class than a short typo, and must not be taken
 * for "unset" in silence). Each case is one communicator: init (the variable is read there),
 * the class of a connection without a trafficClass, finalize.
 *
 *   test_class   exit status 0 when every case resolves and warns as the table says
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "class_defaults.h"
#include "context.h"
#include "log.h"
#include "warn_capture.h"

/* A value of `len` bytes that names no class. */
static char* junk_of_length(size_t len) {
  char* text = malloc(len + 1);
  memset(text, 'q', len);
  text[len] = '\0';
  return text;
}

int main(void) {
  static const struct {
    const char* what;
    const char* value; /* NULL: junk of `len` bytes */
    size_t len;
    int want_class;
    int want_warning;
  } cases[] = {
      {"unset", "", 0, FS_CLASS_TP, 0},
      {"a label", "bulk", 0, 5, 0},
      {"an id", "2", 0, 2, 0},
      {"a short typo", "bluk", 0, FS_CLASS_TP, 1},
      {"an id out of range", "6", 0, FS_CLASS_TP, 1},
      {"junk of 31 bytes", NULL, 31, FS_CLASS_TP, 1},
      {"junk of 32 bytes", NULL, 32, FS_CLASS_TP, 1},
      {"junk of 200 bytes", NULL, 200, FS_CLASS_TP, 1},
      {"junk of 300 bytes", NULL, 300, FS_CLASS_TP, 1},
  };
  setenv("FLOWSCHED_SOCKET_IFNAME", "lo", 1);
  setenv("FLOWSCHED_TABLE", "/nonexistent/flowsched-table", 1);
  int failures = 0;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    char* junk = cases[i].value == NULL ? junk_of_length(cases[i].len) : NULL;
    setenv("FLOWSCHED_CLASS", junk != NULL ? junk : cases[i].value, 1);
    struct fs_context* ctx = NULL;
    if (fs_context_create(0x5eed + i, NCCL_NET_TRAFFIC_CLASS_UNDEF, capture, &ctx) != 0) {
      fprintf(stderr, "FAIL %s: no context\n", cases[i].what);
      return 2;
    }
    warnings[0] = '\0';
    int cls = fs_class_resolve(ctx, NCCL_NET_TRAFFIC_CLASS_UNDEF);
    int warned = strstr(warnings, "FLOWSCHED_CLASS") != NULL;
    if (cls != cases[i].want_class || warned != cases[i].want_warning) {
      fprintf(stderr, "FAIL %s: class %d%s, want %d%s\n", cases[i].what, cls,
              warned ? " with a warning" : " without a warning", cases[i].want_class,
              cases[i].want_warning ? " with a warning" : " without a warning");
      failures++;
    }
    fs_context_finalize(ctx); /* the last reference: the next case initialises afresh */
    free(junk);
  }
  if (failures == 0) {
    printf("ok FLOWSCHED_CLASS (%zu cases)\n", sizeof(cases) / sizeof(cases[0]));
  }
  return failures == 0 ? 0 : 1;
}
