#!/usr/bin/env bash
# Sets up everything flowsched needs on a fresh Debian machine: system packages (only when
# missing and when we are root), a virtual environment, the package with its C plugin.
# Usage: setup.sh [VENV] [EXTRAS]. EXTRAS defaults to everything the tests need; `make demo`
# passes "plot" (the benchmark and its plots need neither torch nor the test tools). PYTHON
# names the interpreter a new venv is made with (default python3; `make PYTHON=...` passes it).
# Fails when the C plugin does not build, unless FLOWSCHED_SKIP_PLUGIN=1 (or gcc/make are
# missing and we are not root to install them: then it warns that what needs it is skipped).
set -euo pipefail
venv=${1:-.venv}
extras=${2:-dev,torch,plot}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."

need_apt=()
# sysctl: the testbed sets its namespaces' sysctls with it (minimal images have no procps)
tools="ip:iproute2 tc:iproute2 sysctl:procps gcc:gcc make:make"
# prometheus/promtool, etcd and iperf3 are the real servers the tests start (deploy rules and
# dashboard, coordinator election, testbed traffic); openssl makes the TLS tests' certificates;
# each test skips with the reason without them.
case ",$extras," in
  *,dev,*) tools="$tools ethtool:ethtool nm:binutils prometheus:prometheus promtool:prometheus"
           tools="$tools etcd:etcd-server iperf3:iperf3 openssl:openssl" ;;
esac
need() {
  case " ${need_apt[*]-} " in *" $1 "*) ;; *) need_apt+=("$1") ;; esac
}
for tool in $tools; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || need "${tool##*:}"
done
# Debian's pyverbs (the RDMA tests run against the real one; pip's needs rdma-core to build)
case ",$extras," in
  *,dev,*) [ -d /usr/lib/python3/dist-packages/pyverbs ] || need python3-pyverbs ;;
esac
# A venv without pip (what `python3 -m venv` leaves where python3-venv is missing) is made
# again; Debian's python3 needs python3-venv (ensurepip) for that. Another PYTHON without
# ensurepip stops at `-m venv`, with that interpreter's own error.
make_venv=0
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  make_venv=1
  if [ "$python" = python3 ]; then
    python3 -c 'import ensurepip' >/dev/null 2>&1 || need python3-venv
  fi
fi

policy_rc=/usr/sbin/policy-rc.d
own_policy_rc=0  # only a policy-rc.d this script made is removed
remove_policy_rc() { if [ "$own_policy_rc" = 1 ]; then rm -f "$policy_rc"; fi; }
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${need_apt[*]}"
    # No daemons started by the packages: the tests start their own instances on free ports.
    # Our policy-rc.d goes on every way out (a failed install, Ctrl-C): left behind, it would
    # keep every service of every later install on this machine from starting.
    if [ ! -e "$policy_rc" ]; then
      trap remove_policy_rc EXIT
      for sig in INT TERM HUP; do
        trap "remove_policy_rc; trap - $sig EXIT; kill -$sig \$\$" "$sig"
      done
      own_policy_rc=1
      printf '#!/bin/sh\nexit 101\n' > "$policy_rc" && chmod 755 "$policy_rc"
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    remove_policy_rc
    trap - EXIT INT TERM HUP
  else
    echo "setup: missing ${need_apt[*]} and not root; what needs them will be skipped" >&2
  fi
fi

if [ "$make_venv" = 1 ]; then
  if [ -x "$venv/bin/python" ]; then
    echo "setup: $venv has no pip; making it again"
    "$python" -m venv --clear "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# plot: matplotlib for the sim/bench PNGs (the daemons do not need it); constraints.txt pins
# torch to the locally stored CPU wheel while the extra accepts a range
"$venv/bin/python" -m pip install -q -e ".[$extras]" --constraint scripts/constraints.txt

# setuptools only warns when the plugin's build fails in an editable install: check for it.
if [ "${FLOWSCHED_SKIP_PLUGIN:-}" != 1 ] && ! "$venv/bin/python" -m flowsched plugin path >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] && ! { command -v gcc && command -v make; } >/dev/null 2>&1; then
    echo "setup: no gcc/make and not root: the NCCL plugin was not built; what needs it will be skipped" >&2
  else
    echo "setup: the NCCL plugin did not build; make says:" >&2
    make -C nccl_plugin build/libnccl-net-flowsched.so >&2 || true
    echo "setup: failed (FLOWSCHED_SKIP_PLUGIN=1 installs without the plugin)" >&2
    exit 1
  fi
fi
