#!/bin/sh
# The plugin must export exactly the three NCCL net tables (and nothing else).
set -eu
lib="$1"
got=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v '^$' | sort)
want=$(printf 'ncclNetPlugin_v10\nncclNetPlugin_v11\nncclNetPlugin_v12\n')
if [ "$got" != "$want" ]; then
  echo "unexpected exported symbols in $lib:" >&2
  echo "$got" >&2
  exit 1
fi
echo "exported symbols OK: $(echo $got)"
