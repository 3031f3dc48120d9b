"""Kubernetes manifests: schema-valid (strict), and consistent with the CLI they run: the
DaemonSet's and the Deployment's args parse, their ports, probes and mounts match the flags,
and a dry start with those args (host paths moved into a temporary directory) comes up. The
shell lines the pods run (the plugin's install, the agent's optional QoS flags) run here
against a temporary directory; the kustomizations are rendered with `kubectl kustomize`."""

from __future__ import annotations

import grp
import json
import mmap
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    AGENT_READY,
    COORDINATOR,
    COORDINATOR_READY,
    DAEMONSET,
    EXAMPLE_JOB,
    HA_COORDINATOR,
    KUSTOMIZATIONS,
    MANIFESTS,
    ROOT,
    Daemon,
    documents,
    find,
    http_status,
    need,
)
from pid_namespace import unshared

from flowsched import qos
from flowsched.cli import build_parser
from flowsched.protocol import write_token
from flowsched.rundir import ROOT_DIR

VERSIONS = ["1.30", kubernetes_validate.latest_version()]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_schema_valid(path: Path, version: str) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_a_typo() -> None:
    daemonset = find(DAEMONSET, "DaemonSet")
    daemonset["spec"]["template"]["spec"]["hostNetwrk"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, VERSIONS[0], strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.parent.name)
def test_kustomization_resources_exist(path: Path) -> None:
    for doc in documents(path):
        for resource in doc["resources"]:
            target = path.parent / resource
            assert target.is_file() or (target / "kustomization.yaml").is_file(), resource


# -- the agent DaemonSet against `flowsched agent` ---------------------------------------------


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    spec = workload["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == name]
    return container  # type: ignore[no-any-return]


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def _mount_for(container: dict[str, Any], path: str) -> dict[str, Any]:
    mounts = [m for m in container["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of {container['name']}"
    return max(mounts, key=lambda m: len(m["mountPath"]))  # type: ignore[no-any-return]


AGENT = find(DAEMONSET, "DaemonSet")
AGENT_POD = AGENT["spec"]["template"]["spec"]
AGENT_CONTAINER = _container(AGENT, "agent")
AGENT_CONFIG = find(DAEMONSET, "ConfigMap")["data"]


def _pod_env(container: dict[str, Any], config: dict[str, str], **fields: str) -> dict[str, str]:
    """The container's environment: ConfigMap keys from ``config`` (a missing optional key
    leaves the variable unset), downward-API fields from ``fields`` (by variable name)."""
    env = {}
    for var in container["env"]:
        source = var.get("valueFrom", {})
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            if ref["key"] in config:
                env[var["name"]] = config[ref["key"]]
            else:
                assert ref.get("optional"), f"{var['name']}: no key {ref['key']}"
        elif "fieldRef" in source:
            env[var["name"]] = fields[var["name"]]
        else:
            env[var["name"]] = var["value"]
    return env


AGENT_ENV = _pod_env(AGENT_CONTAINER, AGENT_CONFIG, NODE_NAME="gpu-node-1")


def test_daemonset_args_parse_with_the_cli() -> None:
    args = AGENT_CONTAINER["args"]
    defined = {e["name"] for e in AGENT_CONTAINER["env"]}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(args))) <= defined
    assert args[0] == "agent"
    parsed = build_parser().parse_args(_expand(args, AGENT_ENV))
    assert parsed.node == "gpu-node-1"


# -- the shell lines the pods run ----------------------------------------------------------------


def _exec_argv(container: dict[str, Any], env: dict[str, str], tmp: Path) -> list[str]:
    """The argv the container's command execs, run here with a stand-in for the image's
    ``flowsched`` on PATH (after Kubernetes' $(VAR) expansion of command and args); asserts
    that the shell replaced itself (``exec``: flowsched gets the kubelet's signals)."""
    fake = tmp / "bin" / "flowsched"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "json.dump({'pid': os.getpid(), 'argv': sys.argv}, open(os.environ['ARGV_OUT'], 'w'))\n"
    )
    fake.chmod(0o755)
    out = tmp / "argv.json"
    command = _expand([*container["command"], *container.get("args", [])], env)
    path = f"{fake.parent}:{os.environ['PATH']}"
    proc = subprocess.Popen(command, env={**env, "PATH": path, "ARGV_OUT": str(out)})
    assert proc.wait(timeout=30) == 0
    seen = json.loads(out.read_text())
    assert seen["pid"] == proc.pid, "the shell did not exec flowsched"
    argv: list[str] = seen["argv"]
    assert Path(argv[0]).name == "flowsched"  # the image's ENTRYPOINT
    return argv[1:]


def test_agent_command_is_the_entrypoint_with_its_args_and_no_qos_by_default(
    tmp_path: Path,
) -> None:
    # host QoS is opt-in: the shipped ConfigMap leaves qos-dev empty, and an empty value
    # passes no flag at all (--qos-dev= is an error, and eth0 is not every node's NIC)
    assert AGENT_CONFIG["qos-dev"] == "" and AGENT_CONFIG["qos-rate"] == ""
    argv = _exec_argv(AGENT_CONTAINER, AGENT_ENV, tmp_path)
    assert argv == _expand(AGENT_CONTAINER["args"], AGENT_ENV)
    assert not [a for a in argv if a.startswith("--qos")]
    parsed = build_parser().parse_args(argv)
    assert parsed.qos_dev is None and parsed.qos_rate is None


@pytest.mark.parametrize(
    ("dev", "rate", "expected"),
    [
        ("ens1f0", "25gbit", ["--qos-dev=ens1f0", "--qos-rate=25gbit"]),
        ("ens1f0", "", ["--qos-dev=ens1f0"]),
        (None, None, []),  # keys absent from the ConfigMap (optional)
        ("odd name*", "", ["--qos-dev=odd name*"]),  # one word, never split or globbed
    ],
)
def test_agent_command_passes_qos_flags_only_when_set(
    tmp_path: Path, dev: str | None, rate: str | None, expected: list[str]
) -> None:
    config = dict(AGENT_CONFIG)
    for key, value in (("qos-dev", dev), ("qos-rate", rate)):
        if value is None:
            del config[key]
        else:
            config[key] = value
    env = _pod_env(AGENT_CONTAINER, config, NODE_NAME="gpu-node-1")
    argv = _exec_argv(AGENT_CONTAINER, env, tmp_path)
    assert argv == [*_expand(AGENT_CONTAINER["args"], env), *expected]
    parsed = build_parser().parse_args(argv)
    assert parsed.qos_dev == dev or (parsed.qos_dev is None and not dev)
    assert parsed.qos_rate == (qos.parse_rate(rate) if rate else None)


def _plugin_install(tmp: Path) -> tuple[list[str], Path, Path]:
    """The init container's command with the image's plugin and the host directory moved
    into ``tmp``: (command, source file, installed file)."""
    (init,) = AGENT_POD["initContainers"]
    command = list(init["command"])
    source, directory = Path(command[-2]), Path(command[-1])
    assert init["volumeMounts"] == [{"name": "run", "mountPath": str(directory)}]
    (tmp / "image").mkdir()
    (tmp / "host").mkdir()
    command[-2:] = [str(tmp / "image" / source.name), str(tmp / "host")]
    return command, tmp / "image" / source.name, tmp / "host" / source.name


def _install_while_mapped(command: list[str], source: Path, target: Path) -> tuple[bytes, bool]:
    """Install a new build over ``target`` while this process maps the old one (as a job's
    dlopen does): (what the mapping reads afterwards, whether ``target`` kept its inode)."""
    old, new = b"\x7fELF old build " * 512, b"\x7fELF new build " * 512
    target.write_bytes(old)
    source.write_bytes(new)
    with open(target, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
        inode = os.fstat(handle.fileno()).st_ino
    try:
        subprocess.run(command, check=True, timeout=30)
        return bytes(mapped[:]), os.stat(target).st_ino == inode
    finally:
        mapped.close()


def test_plain_cp_would_rewrite_what_running_jobs_map(tmp_path: Path) -> None:
    # the hazard the init container avoids, shown by the same check: `cp` onto the file
    # rewrites the inode that running jobs execute (they crash: SIGSEGV or SIGBUS)
    _, source, target = _plugin_install(tmp_path)
    seen, same_inode = _install_while_mapped(["cp", str(source), str(target)], source, target)
    assert same_inode and seen == source.read_bytes()


def test_plugin_install_replaces_the_file_atomically(tmp_path: Path) -> None:
    command, source, target = _plugin_install(tmp_path)
    old = b"\x7fELF old build " * 512
    seen, same_inode = _install_while_mapped(command, source, target)
    assert seen == old and not same_inode  # running jobs keep the old build, untouched
    assert target.read_bytes() == source.read_bytes()  # new jobs load the new one
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no leftovers
    assert stat.S_IMODE(target.stat().st_mode) & 0o044 == 0o044  # job users may read it
    subprocess.run(command, check=True, timeout=30)  # the next pod start: same again
    assert target.read_bytes() == source.read_bytes()


def test_plugin_install_into_an_empty_directory(tmp_path: Path) -> None:
    command, source, target = _plugin_install(tmp_path)
    source.write_bytes(b"\x7fELF")
    subprocess.run(command, check=True, timeout=30)
    assert target.read_bytes() == b"\x7fELF"


def test_daemonset_shares_the_host_pid_namespace_and_network() -> None:
    assert AGENT_POD["hostPID"] is True and AGENT_POD["hostNetwork"] is True
    assert AGENT_POD["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert AGENT["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0


def test_daemonset_mounts_hold_the_table_socket_and_token_but_not_all_of_dev_shm() -> None:
    flags = _flags(AGENT_CONTAINER["args"])
    volumes = {v["name"]: v for v in AGENT_POD["volumes"]}
    for volume in volumes.values():
        host = volume.get("hostPath", {}).get("path")
        assert host not in ("/dev/shm", "/dev", "/run", "/"), f"mounts the host's whole {host}"
    # table and socket in the directory the plugin and the SDK look in by default, so a job
    # that sets neither FLOWSCHED_TABLE nor FLOWSCHED_SOCKET still finds them
    assert str(Path(flags["table"]).parent) == str(Path(flags["socket"]).parent) == ROOT_DIR
    table = _mount_for(AGENT_CONTAINER, flags["table"])
    assert volumes[table["name"]]["hostPath"]["path"] == table["mountPath"] == ROOT_DIR
    sock = _mount_for(AGENT_CONTAINER, flags["socket"])
    assert volumes[sock["name"]]["hostPath"]["path"] == sock["mountPath"]
    token = _mount_for(AGENT_CONTAINER, flags["token-file"])
    secret = volumes[token["name"]]["secret"]
    assert token["readOnly"] and secret["defaultMode"] == 0o400  # load_token refuses group/other


def test_daemonset_agent_can_write_the_hosts_qos_locks() -> None:
    """The agent's root file system is read-only: --qos-dev's per-device locks need the host's
    lock directory mounted, which the host's `flowsched qos` (an operator, a unit) shares."""
    assert AGENT_CONTAINER["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in AGENT_POD["volumes"]}
    mount = _mount_for(AGENT_CONTAINER, str(qos.LOCK_DIR / "x.lock"))
    assert mount["mountPath"] == str(qos.LOCK_DIR) and not mount.get("readOnly")
    assert volumes[mount["name"]]["hostPath"]["path"] == str(qos.LOCK_DIR)


def test_daemonset_metrics_port_and_probes_match_the_flag() -> None:
    port = int(_flags(AGENT_CONTAINER["args"])["metrics-bind"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in AGENT_CONTAINER["ports"]}
    assert ports == {"metrics": port}
    assert AGENT_CONTAINER["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert AGENT_CONTAINER["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    from flowsched.cli._common import AGENT_METRICS_PORT

    assert port == AGENT_METRICS_PORT  # the documented fixed port


def test_agent_reaches_the_coordinator_service() -> None:
    service = find(COORDINATOR, "Service")
    rpc = {p["name"]: p["port"] for p in service["spec"]["ports"]}["rpc"]
    meta = service["metadata"]
    expected = f"{meta['name']}.{meta['namespace']}.svc:{rpc}"
    assert _flags(_expand(AGENT_CONTAINER["args"], AGENT_ENV))["coordinator"] == expected


def test_pods_carry_no_service_account_token() -> None:
    # neither daemon nor the job talks to the API server; the agent pod is root on the host
    pods = [AGENT_POD, find(COORDINATOR, "Deployment")["spec"]["template"]["spec"]]
    pods += [find(HA_COORDINATOR, "StatefulSet")["spec"]["template"]["spec"]]
    pods += [find(EXAMPLE_JOB, "Pod")["spec"]]
    assert all(pod["automountServiceAccountToken"] is False for pod in pods)


_PLACE = (
    "import sys; from flowsched.shm.pidns import PidNamespaces; "
    "print(PidNamespaces().local_pid(*map(int, sys.argv[1:])) or 0)"
)


def _placed_as_the_agent(capabilities: list[str], ns: int, inner: int, start: int) -> int:
    """What an agent with the DaemonSet's uid, gid and ``capabilities`` finds for process
    ``inner`` of pid namespace ``ns`` that started at tick ``start`` (0 = unknown), claimed
    before the probe began (PidNamespaces.local_pid: a pid, -1 = unknown, 0 = gone)."""
    context = AGENT_CONTAINER["securityContext"]
    caps = ",".join(["-all", *(f"+{c.lower()}" for c in capabilities)])
    command = [
        "setpriv", f"--reuid={context['runAsUser']}", f"--regid={context['runAsGroup']}",
        "--clear-groups", f"--bounding-set={caps}", "--inh-caps=-all", "--",
        sys.executable, "-c", _PLACE, str(ns), str(inner), "1", str(start),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
    return int(done.stdout)


def test_the_daemonsets_capabilities_let_the_agent_place_a_job_in_its_own_pid_namespace() -> None:
    """The example job has no hostPID. A root job process holds the container's default
    capabilities, so the kernel refuses an agent with NET_ADMIN alone (uid 0, gid 10001) the
    read of its /proc/<pid>/ns/pid; the agent places it by its pid there and its start tick,
    which the plugin writes into its slots, from world-readable /proc files."""
    job = find(EXAMPLE_JOB, "Pod")["spec"]
    assert AGENT_POD["hostPID"] is True and "hostPID" not in job
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to run a probe with the agent's credentials")
    script = (
        "import os, sys; from flowsched.shm.pidns import start_ticks; "
        "ns = os.readlink('/proc/self/ns/pid')[5:-1]; "
        "start = start_ticks(open('/proc/self/stat', 'rb').read()); "
        "print(os.getpid(), ns, start, flush=True); sys.stdin.readline()"
    )
    child = unshared(sys.executable, "-c", script)
    try:
        assert child.stdout is not None
        inner, ns, start = map(int, child.stdout.readline().split())
        capabilities = AGENT_CONTAINER["securityContext"]["capabilities"]["add"]
        assert "SYS_PTRACE" not in capabilities
        here = _placed_as_the_agent(capabilities, ns, inner, start)
        assert here > 0 and Path(f"/proc/{here}/ns/pid").exists()
        # its namespace link is refused: without the start, the job process is not placed
        assert _placed_as_the_agent(capabilities, ns, inner, 0) == -1  # kept, never reaped
        assert _placed_as_the_agent(capabilities, ns, inner, start + 1) == 0  # another process
    finally:
        child.kill()
        child.wait()


def test_example_job_starts_before_the_agent_ran_on_its_node() -> None:
    job = find(EXAMPLE_JOB, "Pod")["spec"]
    for volume in job["volumes"]:
        if "hostPath" in volume:  # "Directory" would fail the mount until the agent made it
            assert volume["hostPath"]["type"] == "DirectoryOrCreate", volume["name"]


def test_example_job_shares_the_agents_paths_and_plugin() -> None:
    job = find(EXAMPLE_JOB, "Pod")
    container = job["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    flags = _flags(AGENT_CONTAINER["args"])
    assert env["FLOWSCHED_TABLE"] == flags["table"] and env["FLOWSCHED_SOCKET"] == flags["socket"]
    agent_volumes = {v["name"]: v for v in AGENT_POD["volumes"]}
    job_volumes = {v["name"]: v for v in job["spec"]["volumes"]}
    for path in (flags["table"], flags["socket"]):
        mine, theirs = _mount_for(container, path), _mount_for(AGENT_CONTAINER, path)
        assert mine["mountPath"] == theirs["mountPath"]
        host = job_volumes[mine["name"]]["hostPath"]["path"]
        assert host == agent_volumes[theirs["name"]]["hostPath"]["path"]
    dshm = _mount_for(container, "/dev/shm/x")
    assert job_volumes[dshm["name"]]["emptyDir"]["medium"] == "Memory"  # NCCL's own /dev/shm
    (init,) = AGENT_POD["initContainers"]
    source, target = init["command"][-2:]
    assert env["NCCL_NET_PLUGIN"] == str(Path(target) / Path(source).name)
    assert f"/opt/flowsched/lib/{Path(source).name}" == source
    assert source in (ROOT / "agent" / "Dockerfile").read_text()


def _remap(args: list[str], tmp: Path, replace: dict[str, str | None]) -> list[str]:
    out = []
    for arg in args:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if name in replace:
            value = replace[name]
            if value is not None:
                out.append(f"--{name}={value}")
        else:
            out.append(arg)
    return out


def test_agent_dry_start_with_the_daemonset_args(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    (tmp_path / "shm").mkdir()
    (tmp_path / "run").mkdir()
    args = _remap(
        _expand(AGENT_CONTAINER["args"], AGENT_ENV),
        tmp_path,
        {
            "coordinator": "127.0.0.1:9",  # nothing listens: the agent stays unready
            "token-file": str(token),
            "table": str(tmp_path / "shm" / "table"),
            "socket": str(tmp_path / "run" / "agent.sock"),
            "group": grp.getgrgid(os.getgid()).gr_name,
            "metrics-bind": "127.0.0.1:0",
        },
    )
    agent = Daemon(args, tmp_path / "agent.log", AGENT_READY)
    try:
        base = f"http://{agent.fields['mhost']}:{agent.fields['mport']}"
        assert agent.fields["node"] == "gpu-node-1"
        assert http_status(f"{base}/healthz") == (200, "ok\n")
        status, body = http_status(f"{base}/readyz")
        assert status == 503 and "no coordinator connection" in body, shlex.join(args)
        assert "flowsched_agent_table_slots 1024.0" in http_status(f"{base}/metrics")[1]
    finally:
        agent.stop()


# -- the coordinator Deployment against `flowsched coordinator` --------------------------------

DEPLOYMENT = find(COORDINATOR, "Deployment")
COORDINATOR_CONTAINER = _container(DEPLOYMENT, "coordinator")


def test_coordinator_ports_probes_and_service_match_the_flags() -> None:
    args = COORDINATOR_CONTAINER["args"]
    parsed = build_parser().parse_args(args)
    assert args[0] == "coordinator" and parsed.listen[1] == 7711
    flags = _flags(args)
    ports = {p["name"]: p["containerPort"] for p in COORDINATOR_CONTAINER["ports"]}
    assert ports["rpc"] == parsed.listen[1]
    assert ports["metrics"] == int(flags["metrics-bind"].rsplit(":", 1)[1])
    assert COORDINATOR_CONTAINER["readinessProbe"]["httpGet"]["path"] == "/readyz"
    service = find(COORDINATOR, "Service")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports.keys()
    labels = DEPLOYMENT["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    token = _mount_for(COORDINATOR_CONTAINER, flags["token-file"])
    (init,) = DEPLOYMENT["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][-1] == flags["token-file"] and "0600" in init["command"]
    assert any(m["name"] == token["name"] for m in init["volumeMounts"])


def test_coordinator_dry_start_with_the_deployment_args(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    args = _remap(
        COORDINATOR_CONTAINER["args"],
        tmp_path,
        {"listen": "127.0.0.1:0", "metrics-bind": "127.0.0.1:0", "token-file": str(token)},
    )
    coordinator = Daemon(args, tmp_path / "coordinator.log", COORDINATOR_READY)
    try:
        base = f"http://{coordinator.fields['mhost']}:{coordinator.fields['mport']}"
        assert http_status(f"{base}/readyz")[0] == 200
        assert http_status(f"{base}/healthz")[0] == 200
    finally:
        coordinator.stop()


def test_table_owner_and_group_let_job_users_in() -> None:
    # the plugin maps only a table owned by root or by its own user: the agent runs as root,
    # in the image's flowsched group, which the job pods carry as a supplementary group
    context = AGENT_CONTAINER["securityContext"]
    assert context["runAsUser"] == 0 and context["capabilities"]["add"] == ["NET_ADMIN"]
    gid = context["runAsGroup"]
    assert _flags(AGENT_CONTAINER["args"])["group"] == "flowsched"
    assert f"groupadd --system --gid {gid} flowsched" in (ROOT / "agent" / "Dockerfile").read_text()
    job = find(EXAMPLE_JOB, "Pod")
    assert gid in job["spec"]["securityContext"]["supplementalGroups"]


# -- the kustomizations as kubectl renders them, and the HA overlay ----------------------------

RENDERED = [p.parent for p in KUSTOMIZATIONS if p.parent.parent.name == "deploy"]


def _render(folder: Path) -> list[dict[str, Any]]:
    kubectl = need("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    import yaml

    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {folder.name: _render(folder) for folder in RENDERED}


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [
        d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])
    ]  # fmt: skip
    return doc


@pytest.mark.parametrize("folder", RENDERED, ids=lambda p: p.name)
def test_rendered_kustomization_is_schema_valid_and_carries_no_secret(
    rendered: dict[str, list[dict[str, Any]]], folder: Path
) -> None:
    docs = rendered[folder.name]
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    # the token Secret is created out of band: an apply -k must never overwrite it
    assert not [d for d in docs if d["kind"] == "Secret"]
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {"flowsched"}


@pytest.fixture(scope="module")
def ha(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["kubernetes-ha"]


def _ha_parts(ha: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(StatefulSet, its coordinator container, its headless Service)."""
    sts = _one(ha, "StatefulSet", "flowsched-coordinator")
    return sts, _container(sts, "coordinator"), _one(ha, "Service", sts["spec"]["serviceName"])


def _ha_env(ha: list[dict[str, Any]], container: dict[str, Any], pod: str) -> dict[str, str]:
    config = _one(ha, "ConfigMap", "flowsched-coordinator")["data"]
    return _pod_env(container, config, POD_NAME=pod)


def test_ha_replaces_the_deployment_with_a_statefulset(ha: list[dict[str, Any]]) -> None:
    assert not [d for d in ha if d["kind"] == "Deployment"]  # never an unelected coordinator
    sts, _, headless = _ha_parts(ha)
    assert sts["spec"]["replicas"] == 3
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # every replica's name resolves through the headless Service as soon as it has an address
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= labels.items()
    service = _one(ha, "Service", "flowsched-coordinator")  # the base's, for one-address use
    assert service["spec"]["selector"].items() <= labels.items()


def test_ha_replica_advertises_its_own_resolvable_name(ha: list[dict[str, Any]]) -> None:
    sts, container, headless = _ha_parts(ha)
    rpc = {p["name"]: p["port"] for p in headless["spec"]["ports"]}["rpc"]
    names = set()
    for ordinal in range(sts["spec"]["replicas"]):
        pod = f"{sts['metadata']['name']}-{ordinal}"
        parsed = build_parser().parse_args(_expand(container["args"], _ha_env(ha, container, pod)))
        ns = sts["metadata"]["namespace"]
        assert parsed.advertise == f"{pod}.{headless['metadata']['name']}.{ns}.svc:{rpc}"
        assert parsed.listen[1] == rpc and parsed.etcd
        names.add(parsed.advertise)
    assert len(names) == sts["spec"]["replicas"]
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_ha_agents_get_every_replica(ha: list[dict[str, Any]]) -> None:
    sts, container, _ = _ha_parts(ha)
    daemonset = _one(ha, "DaemonSet", "flowsched-agent")
    agent = _container(daemonset, "agent")
    env = _pod_env(agent, _one(ha, "ConfigMap", "flowsched-agent")["data"], NODE_NAME="n1")
    parsed = build_parser().parse_args(_expand(agent["args"], env))
    advertised = {
        build_parser().parse_args(_expand(container["args"], _ha_env(ha, container, pod))).advertise
        for pod in (f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"]))
    }
    assert {f"{host}:{port}" for host, port in parsed.coordinator} == advertised


def test_ha_rollouts_progress_and_disruptions_keep_a_quorum_of_coordinators(
    ha: list[dict[str, Any]],
) -> None:
    sts, container, _ = _ha_parts(ha)
    # readiness must hold for a healthy standby (/readyz is 503 there): the dry start below
    # shows both answers of a real standby
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    pdb = _one(ha, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 2 <= pdb["spec"]["minAvailable"] < sts["spec"]["replicas"]
    (term,) = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()


def test_ha_standby_is_ready_by_the_probe_the_statefulset_uses(
    ha: list[dict[str, Any]], tmp_path: Path
) -> None:
    # a replica whose election cannot win (etcd refuses here) stays a standby and keeps
    # serving: its readiness probe's path answers 200, /readyz 503
    pytest.importorskip("etcd3gw")
    sts, container, _ = _ha_parts(ha)
    token = tmp_path / "token"
    write_token(token)
    args = _remap(
        _expand(container["args"], _ha_env(ha, container, f"{sts['metadata']['name']}-1")),
        tmp_path,
        {
            "listen": "127.0.0.1:0",
            "metrics-bind": "127.0.0.1:0",
            "token-file": str(token),
            "etcd": "http://127.0.0.1:9,http://127.0.0.2:9",  # the discard port: refused
        },
    )
    coordinator = Daemon(args, tmp_path / "coordinator.log", COORDINATOR_READY)
    try:
        base = f"http://{coordinator.fields['mhost']}:{coordinator.fields['mport']}"
        probe = container["readinessProbe"]["httpGet"]["path"]
        assert http_status(f"{base}{probe}")[0] == 200
        status, body = http_status(f"{base}/readyz")
        assert status == 503 and "standby" in body
    finally:
        coordinator.stop()


def test_ha_coordinator_token_copy_matches_the_base(ha: list[dict[str, Any]]) -> None:
    sts, container, _ = _ha_parts(ha)
    base_pod = DEPLOYMENT["spec"]["template"]["spec"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["initContainers"] == base_pod["initContainers"]
    assert pod["volumes"] == base_pod["volumes"]
    assert pod["securityContext"] == base_pod["securityContext"]
    assert (
        _flags(container["args"])["token-file"]
        == _flags(COORDINATOR_CONTAINER["args"])["token-file"]
    )


def test_ha_docs_name_the_files_holding_the_replica_count_and_the_agents_list() -> None:
    """docs/ha.md says how to run another number of coordinators: the files it names must be
    those holding the StatefulSet's ``replicas``, its disruption budget and the agents' list."""
    text = " ".join((ROOT / "docs" / "ha.md").read_text().split())
    match = re.search(
        r"Another number of replicas: change `replicas` in `([^`]+)` .*? and the agents' list"
        r" in `([^`]+)` together",
        text,
    )
    assert match, "docs/ha.md: no 'change `replicas` in FILE ... the agents' list in FILE'"
    replicas_file, agents_file = (ROOT / name for name in match.groups())
    kinds = {doc["kind"]: doc for doc in documents(replicas_file)}
    assert "replicas" in kinds["StatefulSet"]["spec"]
    assert "minAvailable" in kinds["PodDisruptionBudget"]["spec"]
    patches = [p["patch"] for p in documents(agents_file)[0].get("patches", [])]
    assert any("name: flowsched-agent" in p and "coordinator:" in p for p in patches)


# -- the Kubernetes scrape config of docs/deploy.md against the pods' ports ---------------------


def _kubernetes_scrape_jobs() -> dict[str, dict[str, Any]]:
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = [
        yaml.safe_load(block)["scrape_configs"]
        for block in re.findall(r"```yaml\n(scrape_configs:.*?)```", text, flags=re.S)
    ]
    (jobs,) = [b for b in blocks if all("kubernetes_sd_configs" in job for job in b)]
    return {job["job_name"]: job for job in jobs}


def _pod_targets() -> list[tuple[str, dict[str, str]]]:
    """(workload kind, the meta labels of one target) for every port that Prometheus's pod
    discovery makes a target of: each declared port of each container of the pods."""
    targets = []
    for path, kind in ((COORDINATOR, "Deployment"), (HA_COORDINATOR, "StatefulSet"),
                       (DAEMONSET, "DaemonSet")):  # fmt: skip
        workload = find(path, kind)
        template = workload["spec"]["template"]
        for container in template["spec"]["containers"]:
            for port in container.get("ports", []):
                labels = {
                    "__meta_kubernetes_namespace": workload["metadata"]["namespace"],
                    "__meta_kubernetes_pod_container_port_name": port["name"],
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                }
                for name, value in template["metadata"]["labels"].items():
                    labels[f"__meta_kubernetes_pod_label_{re.sub(r'[^a-z0-9]', '_', name)}"] = value
                targets.append((kind, labels))
    return targets


def _kept(job: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether ``job`` scrapes a target with ``labels`` (its namespaces, its keep rules)."""
    for sd in job["kubernetes_sd_configs"]:
        if labels["__meta_kubernetes_namespace"] not in sd["namespaces"]["names"]:
            return False
    for rule in job["relabel_configs"]:
        assert rule["action"] == "keep", rule
        value = rule.get("separator", ";").join(labels.get(n, "") for n in rule["source_labels"])
        if not re.fullmatch(rule["regex"], value):
            return False
    return True


@pytest.mark.parametrize(
    ("job", "kinds", "port"),
    [
        ("flowsched-coordinator", {"Deployment", "StatefulSet"}, "19711"),
        ("flowsched-agent", {"DaemonSet"}, "19712"),
    ],
)
def test_the_kubernetes_scrape_jobs_scrape_only_the_metrics_ports(
    job: str, kinds: set[str], port: str
) -> None:
    """Pod discovery makes a target of every declared port: the coordinator's rpc port speaks
    no HTTP, so a job that kept it had a target down for good (and a refused connection in
    the coordinator's log at every scrape)."""
    config = _kubernetes_scrape_jobs()[job]
    kept = [(kind, labels) for kind, labels in _pod_targets() if _kept(config, labels)]
    assert {kind for kind, _ in kept} == kinds
    assert {labels["__meta_kubernetes_pod_container_port_number"] for _, labels in kept} == {port}
