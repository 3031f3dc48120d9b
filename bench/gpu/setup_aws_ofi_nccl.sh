#!/usr/bin/env bash
# Prepare aws-ofi-nccl, run over libfabric's tcp;ofi_rxm provider, as the inner plugin of
# bench/gpu/allreduce_check.py (mode wrap-ofi). It initialises only where a CUDA driver
# exists, so only the GPU machine can use it.
#
# Prints the path of libnccl-net-ofi.so on its last stdout line and exits 0; exits 3 with the
# reason on stderr when it cannot. Tried in order:
#   $AWS_OFI_NCCL_LIB          an already built plugin
#   $AWS_OFI_NCCL_PREFIX/lib   a previous build of this script (default results/gpu/aws-ofi-nccl)
#   $AWS_OFI_NCCL_SRC          an aws-ofi-nccl source tree (the GPU machine has no network:
#                              carry one there), built against the system libfabric and hwloc
#                              (Debian: libfabric-dev, libhwloc-dev) and the CUDA headers under
#                              $CUDA_HOME (default /usr/local/cuda). --with-libfabric=/usr is not
#                              passed on purpose: its -isystem /usr/include breaks libstdc++.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
prefix=${AWS_OFI_NCCL_PREFIX:-$here/../../results/gpu/aws-ofi-nccl}
lib=$prefix/lib/libnccl-net-ofi.so

unavailable() {
  echo "aws-ofi-nccl not available: $*" >&2
  exit 3
}

if [ -n "${AWS_OFI_NCCL_LIB:-}" ]; then
  [ -f "$AWS_OFI_NCCL_LIB" ] || unavailable "AWS_OFI_NCCL_LIB=$AWS_OFI_NCCL_LIB does not exist"
  echo "$AWS_OFI_NCCL_LIB"
  exit 0
fi
if [ -f "$lib" ]; then
  echo "$lib"
  exit 0
fi

src=${AWS_OFI_NCCL_SRC:-}
[ -n "$src" ] && [ -f "$src/configure.ac" ] ||
  unavailable "no source tree (set AWS_OFI_NCCL_SRC to an aws-ofi-nccl checkout)"
command -v pkg-config >/dev/null || unavailable "pkg-config is missing"
pkg-config --exists libfabric || unavailable "libfabric development files are missing (libfabric-dev)"
pkg-config --exists hwloc || unavailable "hwloc development files are missing (libhwloc-dev)"
cuda=${CUDA_HOME:-/usr/local/cuda}
[ -f "$cuda/include/cuda_runtime.h" ] || unavailable "no CUDA headers under $cuda (set CUDA_HOME)"
if command -v fi_info >/dev/null && ! fi_info -p "tcp;ofi_rxm" >/dev/null 2>&1; then
  echo "warning: fi_info lists no tcp;ofi_rxm domain" >&2
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -a "$src"/. "$work"/
if ! (cd "$work" && ./autogen.sh && ./configure --prefix="$prefix" --with-cuda="$cuda" \
      --disable-tests && make -j"$(nproc)" && make install) >&2; then
  unavailable "the build failed (its output is above)"
fi
[ -f "$lib" ] || unavailable "the build installed no $lib"
echo "$lib"
