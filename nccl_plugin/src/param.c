/* SPDX-License-Identifier: Apache-2.0 */
#include "param.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "flow_table.h"
#include "log.h"

/* The standalone inner build (libnccl-net-fstcp.so, FS_INNER_BUILD) reads FSTCP_* instead of
 * FLOWSCHED_*: wrapped by the flowsched library in the same process, it must not take the
 * wrapper's knobs (FLOWSCHED_NET_INNER would make it load itself, FLOWSCHED_TABLE would claim
 * a second slot per connection). NCCL_* names are shared. */
static const char* env_lookup(const char* env) {
#ifdef FS_INNER_BUILD
  static const char prefix[] = "FLOWSCHED_";
  if (strncmp(env, prefix, sizeof(prefix) - 1) == 0) {
    char name[128];
    snprintf(name, sizeof(name), "FSTCP_%s", env + sizeof(prefix) - 1);
    return getenv(name);
  }
#endif
  return getenv(env);
}

static int64_t param_int(const char* env, int64_t def, int64_t lo, int64_t hi) {
  const char* text = env_lookup(env);
  if (text == NULL || *text == '\0') {
    return def;
  }
  char* end = NULL;
  errno = 0;
  long long value = strtoll(text, &end, 0);
  if (errno != 0 || end == text || *end != '\0') {
    FS_WARN("%s=%s is not an integer; using %lld", env, text, (long long)def);
    return def;
  }
  if (value < lo || value > hi) {
    int64_t clamped = value < lo ? lo : hi;
    FS_WARN("%s=%s out of range [%lld, %lld]; using %lld", env, text, (long long)lo,
            (long long)hi, (long long)clamped);
    return clamped;
  }
  FS_INFO(NCCL_INIT | NCCL_NET, "%s set by environment to %lld", env, value);
  return value;
}

static void param_str(char* out, size_t cap, const char* env, const char* def) {
  const char* text = env_lookup(env);
  if (text == NULL) {
    text = def;
  } else {
    FS_INFO(NCCL_INIT | NCCL_NET, "%s set by environment to %s", env, text);
  }
  if (strlen(text) >= cap) {
    FS_WARN("%s is longer than %zu bytes; ignoring it", env, cap - 1);
    text = def;
  }
  snprintf(out, cap, "%s", text);
}

#define FS_PARAM_LOAD_INT(field, env, def, lo, hi, doc) \
  params->field = param_int(env, def, lo, hi);
#define FS_PARAM_LOAD_STR(field, env, def, doc) \
  param_str(params->field, sizeof(params->field), env, def);

/* `dir`/`tail` in out, or "" when it does not fit in `cap` (a truncated path would name
 * another file than the agent's). */
static int table_path_in(const char* dir, const char* tail, char* out, size_t cap) {
  int n = snprintf(out, cap, "%s%s", dir, tail);
  if (n < 0 || (size_t)n >= cap) {
    out[0] = '\0';
    return -ENAMETOOLONG;
  }
  return 0;
}

void fs_table_default_path(unsigned euid, const char* xdg, const char* root_dir, char* out,
                           size_t cap) {
  char own[FS_TABLE_PATH_MAX + 1];
  if (euid == 0) {
    table_path_in(root_dir, "/table", own, sizeof(own));
  } else if (xdg != NULL && xdg[0] != '\0') {
    if (table_path_in(xdg, "/flowsched/table", own, sizeof(own)) != 0) {
      /* the agent refuses this path as well (flowsched.rundir.agent_path): none of its
       * tables is there, so the plugin looks no further than a root agent's */
      static atomic_int warned;
      FS_WARN_ONCE(warned,
                   "XDG_RUNTIME_DIR is %zu bytes long: the default flow table path "
                   "$XDG_RUNTIME_DIR/flowsched/table would exceed %d bytes; not using it "
                   "(set FLOWSCHED_TABLE, or a shorter XDG_RUNTIME_DIR)",
                   strlen(xdg), FS_TABLE_PATH_MAX);
    }
  } else {
    snprintf(own, sizeof(own), "/tmp/flowsched-%u/table", euid);
  }
  char shared[FS_TABLE_PATH_MAX + 1];
  table_path_in(root_dir, "/table", shared, sizeof(shared));
  int use_shared = euid != 0 && (own[0] == '\0' || access(own, F_OK) != 0) &&
                   shared[0] != '\0' && access(shared, F_OK) == 0;
  if (table_path_in(use_shared ? shared : own, "", out, cap) != 0) {
    out[0] = '\0';
  }
}

#ifndef FS_INNER_BUILD
/* XDG_RUNTIME_DIR as it was at the last load (fs_params_load, at init). The default path is
 * re-decided from it on NCCL's progress threads (fs_table_recheck, about once a second while
 * no table is mapped), and getenv there could race with a setenv on another thread of the
 * process (glibc's environment is not thread-safe): only the load reads the environment. */
static struct {
  pthread_mutex_t lock;
  char* xdg; /* NULL: unset */
} fs_default_env = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void default_env_load(void) {
  const char* xdg = getenv("XDG_RUNTIME_DIR");
  char* copy = xdg != NULL ? strdup(xdg) : NULL; /* no memory: as if unset */
  pthread_mutex_lock(&fs_default_env.lock);
  free(fs_default_env.xdg);
  fs_default_env.xdg = copy;
  pthread_mutex_unlock(&fs_default_env.lock);
}

/* This process's default table path, as it is now (fs_table_default_path: which files exist
 * is looked at again; the environment is the one of the last load). */
static void table_default_path_now(char* out, size_t cap) {
  pthread_mutex_lock(&fs_default_env.lock);
  fs_table_default_path((unsigned)geteuid(), fs_default_env.xdg, FS_RUN_DIR, out, cap);
  pthread_mutex_unlock(&fs_default_env.lock);
}
#endif

void fs_params_load(struct fs_params* params) {
  FS_PARAMS(FS_PARAM_LOAD_INT, FS_PARAM_LOAD_STR)
#ifndef FS_INNER_BUILD
  if (params->table_path[0] == '\0') {
    default_env_load();
    table_default_path_now(params->table_path, sizeof(params->table_path));
    /* which file the default names depends on what exists: a non-root job that started
     * before a root agent resolved its own per-user path, so look again until one maps */
    fs_table_resolve_path_with(table_default_path_now);
  } else {
    /* the path given: a resolver kept from an earlier load (the variable empty then)
     * would name the default path instead */
    fs_table_resolve_path_with(NULL);
  }
#endif
}

int fs_params_data_sockets(const struct fs_params* params) {
  int64_t threads = params->nthreads > 0 ? params->nthreads : 1;
  int64_t socks = threads * params->nsocks_per_thread;
  return socks > 16 ? 16 : (int)socks;
}

int fs_param_is_set(const char* env) {
  const char* text = env_lookup(env);
  return text != NULL && text[0] != '\0';
}

void fs_param_peek(const char* env, char* out, size_t cap) {
  static const char cut[] = "...";
  const char* text = env_lookup(env);
  snprintf(out, cap, "%s", text != NULL ? text : "");
  if (text != NULL && strlen(text) >= cap && cap >= sizeof(cut)) {
    memcpy(out + cap - sizeof(cut), cut, sizeof(cut)); /* with its NUL, at the very end */
  }
}
