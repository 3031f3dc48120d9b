#!/usr/bin/env bash
# Sets up everything flowsched needs on a fresh Debian machine: system packages (only when
# missing and when we are root), a virtual environment, the package with its C plugin.
set -euo pipefail
venv=${1:-.venv}
cd "$(dirname "$0")/.."

need_apt=()
for tool in ip:iproute2 tc:iproute2 gcc:gcc make:make ethtool:ethtool nm:binutils; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_apt+=("${tool##*:}")
done
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: missing ${need_apt[*]} and not root; some tests will be skipped" >&2
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e '.[dev,torch]'
