"""Policy files: shipped files pass, bad files give field-path errors, the CLI exits 2."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from flowsched import policies, policyfile
from flowsched.model import Context, Flow, FlowClass
from flowsched.policies.rmlq import RmlqPolicy
from flowsched.policyfile import ClassRule, LevelMarking, PolicyFileError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "policies").glob("*.toml"))

MINIMAL = '[policy]\nname = "rmlq"\n'


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowsched", "policy", *args],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip


def test_policies_folder_is_the_package_data() -> None:
    assert (ROOT / "policies").is_symlink()
    assert (ROOT / "policies").resolve() == (ROOT / "flowsched" / "data" / "policies").resolve()
    names = {p.name for p in SHIPPED}
    assert {
        "default.toml",
        "rl-disaggregated.toml",
        "pd-serving.toml",
        "static-classes.toml",
    } <= names
    assert set(policyfile.shipped_files()) == names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_file_is_valid_and_builds_its_policy(path: Path) -> None:
    config = policyfile.load(path)
    assert len(config.levels) == config.num_levels
    assert set(config.classes) == set(FlowClass)
    policy = config.make_policy()
    assert policy.num_levels == config.num_levels
    dscps = [q.dscp for q in config.queues]
    assert len(set(dscps)) == len(dscps) == config.hw_queues
    assert all(0 <= q.so_priority <= 6 for q in config.queues)


def test_cli_check_accepts_every_shipped_file() -> None:
    result = run_cli("check", *map(str, SHIPPED))
    assert result.returncode == 0, result.stdout + result.stderr
    for path in SHIPPED:
        assert f"{path}: ok (policy " in result.stdout


def test_embedded_default_is_default_toml() -> None:
    embedded = policyfile.embedded_default()
    on_disk = policyfile.load(ROOT / "policies" / "default.toml")
    assert embedded.policy == "rmlq" and embedded.num_levels == 8 and embedded.hw_queues == 8
    assert (embedded.levels, embedded.classes, embedded.args) == (
        on_disk.levels,
        on_disk.classes,
        on_disk.args,
    )
    assert isinstance(embedded.make_policy(), RmlqPolicy)


def test_minimal_file_gets_every_default() -> None:
    config = policyfile.loads(MINIMAL)
    assert (config.policy, config.num_levels, config.hw_queues, config.timer_period) == (
        "rmlq",
        8,
        8,
        0.001,
    )
    assert config.classes[FlowClass.KV] == ClassRule((3,), 1, None)
    assert config.classes[FlowClass.BULK] == ClassRule((5,), 7, None)
    assert config.levels[0] == LevelMarking(46, 6)
    assert config.levels[7] == LevelMarking(1, 0)
    assert config.class_for_traffic_class(2) is FlowClass.PARAM_SYNC
    assert config.class_for_traffic_class(99) is None


def test_default_toml_shows_what_an_omitted_key_takes() -> None:
    # its header: every key but policy.name may be left out and takes the value shown there,
    # except description and the classes' deadline (no default deadline without one)
    shown = policyfile.load(ROOT / "policies" / "default.toml")
    bare = policyfile.loads(MINIMAL)
    assert (shown.num_levels, shown.hw_queues, shown.hw_mapping, shown.timer_period) == (
        bare.num_levels,
        bare.hw_queues,
        bare.hw_mapping,
        bare.timer_period,
    )
    assert (shown.queues, shown.levels, shown.gating) == (bare.queues, bare.levels, bare.gating)
    for cls in FlowClass:
        with_deadline, without = shown.classes[cls], bare.classes[cls]
        assert with_deadline.traffic_classes == without.traffic_classes, cls
        assert with_deadline.default_level == without.default_level, cls
        assert without.deadline is None, cls
    # top_threshold, left out, follows U (0.5 by default), as the file's comment says
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in shown.args.items()}
    args["top_threshold"] = None
    rmlq = policies.module("rmlq")
    assert rmlq.Args(**bare.args) == rmlq.Args(**args)
    built = bare.make_policy()
    assert isinstance(built, RmlqPolicy) and built.top_threshold == shown.args["top_threshold"]


def test_levels_follow_the_hardware_queue_mapping() -> None:
    config = policyfile.load(ROOT / "policies" / "rl-disaggregated.toml")
    assert config.level_queue == (0, 0, 1, 1, 2, 2, 3, 3)  # hw_mapping = "proportional"
    assert [m.dscp for m in config.levels] == [46, 46, 34, 34, 18, 18, 1, 1]
    assert config.classes[FlowClass.PARAM_SYNC].deadline == 60.0


def test_reassigned_default_traffic_class_moves_to_the_new_class() -> None:
    config = policyfile.loads(MINIMAL + "[classes.kv]\ntraffic_classes = [0, 7]\n")
    assert config.class_for_traffic_class(0) is FlowClass.KV
    assert config.classes[FlowClass.TP].traffic_classes == ()


@pytest.mark.parametrize("hw_queues", range(1, 9))
def test_default_queue_markings(hw_queues: int) -> None:
    markings = policyfile.default_queue_markings(hw_queues)
    assert len(markings) == hw_queues
    assert len({m.dscp for m in markings}) == hw_queues
    assert all(0 <= m.so_priority <= 6 for m in markings)
    assert [m.so_priority for m in markings] == sorted(
        (m.so_priority for m in markings), reverse=True
    )


BAD_FILES = [
    ("unknown-top-key", "colour = 1\n" + MINIMAL, ["colour: unknown key"]),
    ("unknown-policy-key", MINIMAL + "levels = 8\n", ["policy.levels: unknown key"]),
    ("missing-name", "[policy]\nnum_levels = 8\n", ["policy.name: missing"]),
    ("unknown-policy", '[policy]\nname = "wfq"\n', ["policy.name: unknown policy 'wfq'"]),
    ("levels-type", MINIMAL + 'num_levels = "8"\n', ["policy.num_levels: expected an integer"]),
    (
        "levels-range",
        MINIMAL + "num_levels = 0\n",
        ["policy.num_levels: expected an integer in [1, 64]"],
    ),
    ("hw-queues", MINIMAL + "hw_queues = 9\n", ["policy.hw_queues: expected an integer in [1, 8]"]),
    ("hw-mapping", MINIMAL + 'hw_mapping = "spread"\n', ["policy.hw_mapping: expected one of"]),
    (
        "timer",
        MINIMAL + "timer_period = 0\n",
        ["policy.timer_period: expected a number in [1e-06, 60.0]"],
    ),
    (
        "timer-below-a-microsecond",
        MINIMAL + "timer_period = 1e-300\n",
        ["policy.timer_period: expected a number in [1e-06, 60.0], got 1e-300"],
    ),
    (
        "args-E",
        MINIMAL + "[policy.args]\nE = 0.5\n",
        ["policy.args.E: expected a number in (1.0, 1024.0], got 0.5"],
    ),
    (
        "args-E-huge",
        MINIMAL + "[policy.args]\nE = 1e308\n",
        ["policy.args.E: expected a number in (1.0, 1024.0], got 1e+308"],
    ),
    (
        "args-U-huge",
        MINIMAL + "[policy.args]\nU = 1e308\n",
        ["policy.args.U: expected a number in (0.0, 1024.0], got 1e+308"],
    ),
    (
        "default-level-equal-to-K",
        MINIMAL + "num_levels = 4\n[classes.tp]\ndefault_level = 4\n",
        ["classes.tp.default_level: 4 is outside 0..3 (K=4)"],
    ),
    ("args-unknown", MINIMAL + "[policy.args]\nK = 8\n", ["policy.args.K: unknown key"]),
    (
        "too-few-levels",
        MINIMAL + "num_levels = 4\n",
        ["policy.args.early_levels: 3 early levels leave no MLU band with K=4"],
    ),
    (
        "unknown-class",
        MINIMAL + "[classes.web]\ndefault_level = 1\n",
        ["classes.web: unknown flow class"],
    ),
    (
        "negative-deadline",
        MINIMAL + "[classes.kv]\ndeadline = -1\n",
        ["classes.kv.deadline: expected a number > 0.0, got -1"],
    ),
    (
        "implicit-deadline",
        MINIMAL + "[classes.tp]\ndeadline = 1.0\n",
        ["classes.tp.deadline: only explicit"],
    ),
    (
        "default-level-range",
        MINIMAL + "[classes.kv]\ndefault_level = 9\n",
        ["classes.kv.default_level: 9 is outside 0..7 (K=8)"],
    ),
    (
        "traffic-class-range",
        MINIMAL + "[classes.kv]\ntraffic_classes = [256]\n",
        ["classes.kv.traffic_classes[0]: expected an integer in [0, 255], got 256"],
    ),
    (
        "duplicate-traffic-class",
        MINIMAL + "[classes.tp]\ntraffic_classes = [1]\n[classes.kv]\ntraffic_classes = [1]\n",
        ["classes.kv.traffic_classes[0]: trafficClass 1 is already mapped to tp"],
    ),
    (
        "queue-count",
        MINIMAL + "hw_queues = 4\n[[queues]]\ndscp = 46\nso_priority = 6\n",
        ["queues: expected one entry per hardware queue (4), got 1"],
    ),
    (
        "queue-values",
        MINIMAL + "hw_queues = 2\n[[queues]]\ndscp = 64\nso_priority = 7\n[[queues]]\ndscp = 1\n",
        [
            "queues[0].dscp: expected an integer in [0, 63], got 64",
            "queues[0].so_priority: expected an integer in [0, 6], got 7",
            "queues[1].so_priority: missing",
        ],
    ),
    (
        "duplicate-dscp",
        MINIMAL + "hw_queues = 2\n" + "[[queues]]\ndscp = 46\nso_priority = 6\n" * 2,
        ["queues[1].dscp: 46 is already used by queues[0]"],
    ),
    ("bad-toml", "[policy\nname = 1", ["invalid TOML"]),
    (
        "more-traffic-classes-than-the-table-maps",
        MINIMAL + "[classes.kv]\ntraffic_classes = [" + ", ".join(map(str, range(10, 50))) + "]\n",
        ["classes: 45 traffic_classes in all"],
    ),
    (
        "thresholds-overflow",
        '[policy]\nname = "sjf"\n[policy.args]\nbase = 1e308\nratio = 1e308\n',
        ["policy"],
    ),
    (
        "sjf-ratio-overflows-at-K",
        '[policy]\nname = "sjf"\nnum_levels = 64\n[policy.args]\nratio = 1e6\n',
        ["policy.args.ratio: 1000000.0 ** 61 overflows a float (K=64)"],
    ),
    (
        "rmlq-urgent-ratio-huge",
        MINIMAL + "[policy.args]\nurgent_levels = 3\nearly_levels = 2\nurgent_ratio = 1e200\n",
        ["policy.args.urgent_ratio: expected a number in (1.0, 1024.0], got 1e+200"],
    ),
    (
        "integer-past-a-floats-range",
        MINIMAL
        + "timer_period = 1"
        + "0" * 400
        + "\n[classes.kv]\ndeadline = 1"
        + "0" * 400
        + "\n",
        ["policy.timer_period: expected a number", "classes.kv.deadline: expected a number"],
    ),
    (
        "karuna-threshold-count",
        '[policy]\nname = "karuna"\n[policy.args]\nthresholds = [1, 2, 3, 4, 5, 6, 7]\n',
        ["policy.args.thresholds: expected 6 thresholds for K=8 (level 0 holds the deadline"],
    ),
    (
        "hw-queues-above-K",
        '[policy]\nname = "static"\nnum_levels = 4\nhw_queues = 8\n',
        ["policy.hw_queues: 8 is more than num_levels (4)"],
    ),
    (
        "hw-queues-above-K-with-other-errors",
        MINIMAL + "num_levels = 6\nhw_queues = 8\n",
        ["policy.hw_queues: 8 is more than num_levels (6)", "policy.args.early_levels"],
    ),
    (
        "all-errors-collected",
        MINIMAL + "num_levels = 99\n[policy.args]\nU = -1\n[classes.kv]\ndeadline = 0\n",
        ["policy.num_levels", "policy.args.U", "classes.kv.deadline"],
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_file_errors_name_the_field(text: str, expected: list[str]) -> None:
    with pytest.raises(PolicyFileError) as caught:
        policyfile.loads(text)
    for fragment in expected:
        assert any(e.startswith(fragment) for e in caught.value.errors), caught.value.errors
    assert str(caught.value) == "\n".join(caught.value.errors)


def test_cli_check_reports_errors_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL + "[classes.kv]\ndeadline = -1\n[policy.args]\nE = 0\n")
    good = ROOT / "policies" / "default.toml"
    result = run_cli("check", str(good), str(bad))
    assert result.returncode == 2
    assert f"{bad}: classes.kv.deadline: expected a number > 0.0, got -1" in result.stdout
    assert f"{bad}: policy.args.E: expected a number in (1.0, 1024.0], got 0" in result.stdout
    assert f"{good}: ok (policy rmlq, K=8" in result.stdout


def test_cli_refuses_what_show_cannot_handle(tmp_path: Path) -> None:
    """An urgent_ratio whose powers overflow passed ``check`` and crashed ``show``."""
    bad = tmp_path / "ratio.toml"
    bad.write_text(
        MINIMAL + "[policy.args]\nurgent_levels = 3\nearly_levels = 2\nurgent_ratio = 1e200\n"
    )
    for action, stream in (("check", "stdout"), ("show", "stderr")):  # check's verdicts: stdout
        result = run_cli(action, str(bad))
        assert result.returncode == 2, result.stdout + result.stderr
        said = getattr(result, stream)
        assert f"{bad}: policy.args.urgent_ratio: expected a number in" in said
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_files_use_at_most_one_hardware_queue_per_level(path: Path) -> None:
    config = policyfile.load(path)
    assert config.hw_queues <= config.num_levels
    assert set(config.level_queue) == set(range(config.hw_queues))


def test_cli_check_missing_file(tmp_path: Path) -> None:
    result = run_cli("check", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert f"{tmp_path / 'nope.toml'}: cannot read" in result.stdout
    assert result.stdout.count("nope.toml") == 1  # named once, as every other error


def test_cli_show_prints_the_level_table() -> None:
    result = run_cli("show", str(ROOT / "policies" / "rl-disaggregated.toml"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = lines.index("level  queue  dscp  so_priority  meaning")
    assert lines[header + 1].split()[:4] == ["0", "0", "46", "6"]
    assert lines[header + 8].split()[:4] == ["7", "3", "1", "0"]
    assert "scavenger" in lines[header + 8]


def test_construction_error_is_collected_with_the_others() -> None:
    with pytest.raises(PolicyFileError) as caught:
        policyfile.loads(MINIMAL + "num_levels = 4\n[classes.kv]\ndeadline = -2\n")
    errors = caught.value.errors
    assert any(e.startswith("policy.args.early_levels: 3 early levels") for e in errors), errors
    assert any(e.startswith("classes.kv.deadline") for e in errors), errors


def test_non_table_document_is_an_error() -> None:
    with pytest.raises(PolicyFileError, match="top level"):
        policyfile.from_mapping([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize("mlu", [0.2, 0.6, 0.99])
def test_rl_disaggregated_keeps_a_deferred_sync_out_of_the_bulk_queue(mlu: float) -> None:
    """A weight sync that needs much of the link (MLU 0.2-0.99, due in 10 s) waits in a queue
    of its own, not in the lowest one that bulk checkpoints and logs share (by time left, the
    default order, it sat there until MLU 1)."""
    cfg = policyfile.load(ROOT / "policies" / "rl-disaggregated.toml")
    policy = policies.create(cfg.policy, dict(cfg.args), num_levels=cfg.num_levels)
    sync = Flow(
        1, FlowClass.PARAM_SYNC, 0.0, size=int(mlu * 10 * 25e9), deadline=10.0, links=("L",)
    )
    bulk = Flow(2, FlowClass.BULK, 0.0, size=10**9, links=("L",))
    context = Context(now=0.0, link_bandwidth={"L": 25e9})
    sync_queue = cfg.level_queue[policy.admit(sync, context).level]
    assert sync_queue != cfg.level_queue[policy.admit(bulk, context).level]


@pytest.mark.parametrize(
    "document",
    [
        {"a": 1, "b": 2.5, "c": 'x"y', "d": [1, 2], "e": True},
        {"text": "r\u00e9sum\u00e9 \U0001f680 \\ \t \n \x00 \x7f \x1b end"},
        {"top": 1, "t": {"x": 1, "u": {"y": "z"}}, "arr": [{"k": 1}, {"k": 2}]},
        *(tomllib.loads(p.read_text(encoding="utf-8")) for p in SHIPPED),
    ],
)
def test_to_toml_round_trips(document: dict[str, Any]) -> None:
    assert tomllib.loads(policyfile.to_toml(document)) == document


def test_to_toml_refuses_what_toml_cannot_hold() -> None:
    with pytest.raises(TypeError, match="cannot write NoneType as TOML"):
        policyfile.to_toml({"a": None})


def test_a_file_an_editor_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    """Windows editors save UTF-8 with a BOM, which TOML refuses: the file was 'invalid TOML:
    Invalid statement (at line 1, column 1)' for a mark the user cannot see."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + (ROOT / "policies" / "default.toml").read_bytes())
    assert (
        policyfile.load(path).policy == policyfile.load(ROOT / "policies" / "default.toml").policy
    )
    assert not policyfile.read_text(path).startswith("\ufeff")  # nor in what agents are sent
