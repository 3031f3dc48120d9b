#!/bin/sh
# The plugin must export exactly the NCCL net tables ncclNetPlugin_v8 .. _v12 (and nothing else).
set -eu
lib="$1"
got=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v '^$' | sort)
want=$(printf 'ncclNetPlugin_v10\nncclNetPlugin_v11\nncclNetPlugin_v12\nncclNetPlugin_v8\nncclNetPlugin_v9\n')
if [ "$got" != "$want" ]; then
  echo "unexpected exported symbols in $lib:" >&2
  echo "$got" >&2
  exit 1
fi
echo "exported symbols OK: $(echo $got)"
