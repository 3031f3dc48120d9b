"""Kubernetes manifests: schema-valid (strict), and consistent with the CLI they run: the
DaemonSet's and the Deployment's args parse, their ports, probes and mounts match the flags,
and a dry start with those args (host paths moved into a temporary directory) comes up."""

from __future__ import annotations

import grp
import os
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from deploy_helpers import (
    AGENT_READY,
    COORDINATOR,
    COORDINATOR_READY,
    DAEMONSET,
    EXAMPLE_JOB,
    KUSTOMIZATIONS,
    MANIFESTS,
    ROOT,
    Daemon,
    documents,
    find,
    http_status,
)

from flowsched.cli import build_parser
from flowsched.protocol import write_token

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


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.parent.parent.name)
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
AGENT_ENV = {"NODE_NAME": "gpu-node-1", "FLOWSCHED_QOS_DEV": "eth0"}


def test_daemonset_args_parse_with_the_cli() -> None:
    args = AGENT_CONTAINER["args"]
    defined = {e["name"] for e in AGENT_CONTAINER["env"]}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(args))) <= defined
    assert args[0] == "agent"
    parsed = build_parser().parse_args(_expand(args, AGENT_ENV))
    assert parsed.node == "gpu-node-1" and parsed.qos_dev == "eth0"


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
    table = _mount_for(AGENT_CONTAINER, flags["table"])
    assert volumes[table["name"]]["hostPath"]["path"] == table["mountPath"] == "/dev/shm/flowsched"
    sock = _mount_for(AGENT_CONTAINER, flags["socket"])
    assert volumes[sock["name"]]["hostPath"]["path"] == sock["mountPath"]
    token = _mount_for(AGENT_CONTAINER, flags["token-file"])
    secret = volumes[token["name"]]["secret"]
    assert token["readOnly"] and secret["defaultMode"] == 0o400  # load_token refuses group/other


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
    assert _flags(AGENT_CONTAINER["args"])["coordinator"] == expected


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
            "qos-dev": None,  # tc on a host NIC needs CAP_NET_ADMIN
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
