#!/usr/bin/env bash
# Sets up everything flowsched needs on a fresh Debian machine: system packages (only when
# missing and when we are root), a virtual environment, the package with its C plugin.
# Usage: setup.sh [VENV] [EXTRAS]. EXTRAS defaults to everything the tests need; `make demo`
# passes "plot" (the benchmark and its plots need neither torch nor the test tools).
set -euo pipefail
venv=${1:-.venv}
extras=${2:-dev,torch,plot}
cd "$(dirname "$0")/.."

need_apt=()
tools="ip:iproute2 tc:iproute2 gcc:gcc make:make"
# prometheus/promtool, etcd and iperf3 are the real servers the tests start (deploy rules and
# dashboard, coordinator election, testbed traffic); openssl makes the TLS tests' certificates;
# each test skips with the reason without them.
case ",$extras," in
  *,dev,*) tools="$tools ethtool:ethtool nm:binutils prometheus:prometheus promtool:prometheus"
           tools="$tools etcd:etcd-server iperf3:iperf3 openssl:openssl" ;;
esac
for tool in $tools; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || case " ${need_apt[*]-} " in *" ${tool##*:} "*) ;; *) need_apt+=("${tool##*:}") ;; esac
done
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq
    # No daemons started by the packages: the tests start their own instances on free ports.
    own_policy_rc=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
      own_policy_rc=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    if [ "$own_policy_rc" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  else
    echo "setup: missing ${need_apt[*]} and not root; what needs them will be skipped" >&2
  fi
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# plot: matplotlib for the sim/bench PNGs (the daemons do not need it); constraints.txt pins
# torch to the locally stored CPU wheel while the extra accepts a range
"$venv/bin/python" -m pip install -q -e ".[$extras]" --constraint scripts/constraints.txt
