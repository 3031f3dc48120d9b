"""flowsched.rdma: the level -> QP marking mapping (the device part cannot run here)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowsched import rdma
from flowsched.policyfile import MAX_HW_QUEUES, default_queue_markings

DSCPS = (46, 34, 26, 0)


@pytest.mark.parametrize(
    ("level", "service_levels", "expected"),
    [
        pytest.param(0, None, rdma.QpMarking(0, 46 << 2, 5), id="top-level"),
        pytest.param(2, None, rdma.QpMarking(2, 26 << 2, 3), id="lossless-dscp"),
        pytest.param(3, None, rdma.QpMarking(3, 0, 0), id="bottom-level"),
        pytest.param(1, (7, 5, 3, 0), rdma.QpMarking(1, 34 << 2, 5), id="explicit-sl"),
    ],
)
def test_qp_marking(
    level: int, service_levels: tuple[int, ...] | None, expected: rdma.QpMarking
) -> None:
    assert rdma.qp_marking(level, DSCPS, service_levels=service_levels) == expected


@pytest.mark.parametrize("hw_queues", range(1, MAX_HW_QUEUES + 1))
def test_default_markings_stay_off_the_lossless_and_cnp_priorities(hw_queues: int) -> None:
    """A RoCE NIC trusting PCP sends SL & 7 as the priority: the policy file's default DSCPs
    must not put a level in priority 3 (lossless) or 6 (CNP), nor differ from the priority
    DSCP >> 3 gives the same packet on a NIC trusting DSCP."""
    dscps = [m.dscp for m in default_queue_markings(hw_queues)]
    for level, dscp in enumerate(dscps):
        sl = rdma.qp_marking(level, dscps).service_level
        assert sl == dscp >> 3
        assert sl & 7 not in (3, 6), (hw_queues, level, dscp)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        pytest.param((4, DSCPS), {}, "level 4", id="level-out-of-range"),
        pytest.param((0, ()), {}, "at least one", id="no-levels"),
        pytest.param((0, (64,)), {}, "not in 0..63", id="bad-dscp"),
        pytest.param((0, DSCPS), {"service_levels": (1, 2)}, "one entry per level", id="sl-count"),
        pytest.param(
            (0, DSCPS), {"service_levels": (16, 0, 0, 0)}, "service level 16", id="sl-range"
        ),
    ],
)
def test_invalid_mapping_inputs(args: tuple, kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        rdma.qp_marking(*args, **kwargs)


def test_discovery_without_rdma_returns_nothing() -> None:
    # No pyverbs, or pyverbs without devices (this kernel has no RDMA): an empty list, no error.
    assert rdma.discover_devices() == [] or importlib.util.find_spec("pyverbs") is not None


@pytest.mark.skipif(
    importlib.util.find_spec("pyverbs") is not None,
    reason="pyverbs is installed: the absence path is not testable here",
)
def test_build_qp_attr_without_pyverbs_says_so() -> None:
    with pytest.raises(rdma.RdmaUnavailable, match="pyverbs is not installed"):
        rdma.build_qp_attr(rdma.qp_marking(0, DSCPS), "fe80::1")


def test_a_pyverbs_that_does_not_load_here_is_named_with_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what another Python finds on Debian's path: the package, and compiled modules built
    # for the distribution's python3 only (here: none at all)
    (tmp_path / "pyverbs").mkdir()
    (tmp_path / "pyverbs" / "__init__.py").write_text("")
    before = set(sys.modules)
    for name in [name for name in before if name.split(".")[0] == "pyverbs"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(rdma.RdmaUnavailable) as caught:
            rdma.build_qp_attr(rdma.qp_marking(0, DSCPS), "fe80::1")
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] == "pyverbs":
                del sys.modules[name]
    message = str(caught.value)
    assert f"pyverbs at {tmp_path / 'pyverbs'} does not load in this Python" in message
    assert "No module named 'pyverbs.addr'" in message


@pytest.mark.skip(
    reason="needs an RDMA device: this kernel has no InfiniBand/RoCE support "
    "(no rxe, siw or /dev/infiniband), so QP creation cannot run here"
)
def test_qp_on_a_device_carries_the_traffic_class() -> None:  # pragma: no cover
    raise AssertionError("unreachable")


def test_build_qp_attr_fills_the_address_vector() -> None:
    # A stand-in with pyverbs' constructor signatures (rdma-core pyverbs/addr.pyx, qp.pyx).
    made: dict[str, dict[str, object]] = {}

    def recorder(name: str) -> object:
        def make(*args: object, **kwargs: object) -> SimpleNamespace:
            made[name] = {"args": args, **kwargs}
            return SimpleNamespace(name=name, **kwargs)

        return make

    fake = SimpleNamespace(
        addr=SimpleNamespace(
            GID=recorder("GID"), GlobalRoute=recorder("GlobalRoute"), AHAttr=recorder("AHAttr")
        ),
        qp=SimpleNamespace(QPAttr=recorder("QPAttr")),
    )
    attr = rdma.build_qp_attr(
        rdma.qp_marking(1, DSCPS), "fe80::2", gid_index=3, port_num=2, pyverbs=fake
    )
    assert made["GID"]["args"] == ("fe80:0000:0000:0000:0000:0000:0000:0002",)
    assert made["GlobalRoute"]["traffic_class"] == 34 << 2
    assert made["GlobalRoute"]["sgid_index"] == 3
    assert made["AHAttr"]["sl"] == 34 >> 3 and made["AHAttr"]["is_global"] == 1
    assert made["AHAttr"]["port_num"] == 2 and attr.ah_attr.name == "AHAttr"


@pytest.mark.parametrize(
    ("dgid", "gid"),
    [
        ("fe80::1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
        ("FE80:0:0:0:0:0:0:1", "fe80:0000:0000:0000:0000:0000:0000:0001"),
        ("::ffff:10.0.0.2", "0000:0000:0000:0000:0000:ffff:0a00:0002"),
        ("10.0.0.2", "0000:0000:0000:0000:0000:ffff:0a00:0002"),  # a RoCEv2 peer's address
        (" fe80::1 ", "fe80:0000:0000:0000:0000:0000:0000:0001"),
    ],
)
def test_a_gid_in_any_spelling_is_written_out_whole(dgid: str, gid: str) -> None:
    assert rdma.full_gid(dgid) == gid


@pytest.mark.parametrize("dgid", ["", "fe80::1::2", "10.0.0.256", "mlx5_0"])
def test_a_bad_gid_is_a_value_error_naming_dgid(dgid: str) -> None:
    with pytest.raises(ValueError, match="dgid: expected a GID"):
        rdma.build_qp_attr(rdma.qp_marking(0, DSCPS), dgid, pyverbs=object())


#: Debian's rdma-core Python bindings (python3-pyverbs, installed by scripts/setup.sh)
SYSTEM_PYVERBS = Path("/usr/lib/python3/dist-packages/pyverbs")
REAL_PYVERBS_SCRIPT = """
import json
from flowsched import rdma
from flowsched.policyfile import MAX_HW_QUEUES, default_queue_markings
attr = rdma.build_qp_attr(rdma.qp_marking(1, {dscps}), "fe80::2", gid_index=3, port_num=2)
ah = attr.ah_attr
print(json.dumps([ah.traffic_class, ah.sl, ah.sgid_index, ah.port_num, str(ah.dgid),
                  ah.is_global, ah.hop_limit, rdma.discover_devices()]))
"""


def _built_for_this_python(package: Path) -> bool:
    """True when ``package``'s ``addr`` module is compiled for this interpreter."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return any((package / f"addr{suffix}").exists() for suffix in suffixes)


def test_build_qp_attr_with_the_real_pyverbs() -> None:
    """Against rdma-core's own bindings (no device needed to build attributes)."""
    if not SYSTEM_PYVERBS.is_dir():
        pytest.skip("python3-pyverbs is not installed (scripts/setup.sh installs it as root)")
    if not _built_for_this_python(SYSTEM_PYVERBS):
        pytest.skip(
            f"{SYSTEM_PYVERBS} holds no compiled modules for Python "
            f"{sys.version_info.major}.{sys.version_info.minor} (Debian builds it for its python3)"
        )
    env = {**os.environ, "PYTHONPATH": str(SYSTEM_PYVERBS.parent)}
    done = subprocess.run(
        [sys.executable, "-c", REAL_PYVERBS_SCRIPT.format(dscps=tuple(DSCPS))],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if "cannot import name" in done.stderr or "undefined symbol" in done.stderr:
        pytest.skip(f"the system's pyverbs does not load in this Python: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found[:7] == [34 << 2, 34 >> 3, 3, 2, "fe80:0000:0000:0000:0000:0000:0000:0002", 1, 64]
    assert found[7] == []  # no RDMA device on a host without one
