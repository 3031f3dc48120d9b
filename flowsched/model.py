"""Flow model shared by the policies, the simulator, the coordinator and the agent.

Everything here is plain data: no I/O, no clock. Time is always a float in seconds on a clock
that the caller injects (the simulator's virtual clock, or ``time.monotonic()`` in a daemon).
Sizes are bytes, bandwidths are bytes per second.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class FlowClass(enum.IntEnum):
    """Traffic classes. The integer values are the class ids stored in the shared-memory table."""

    TP = 0
    EXPERIENCE = 1
    PARAM_SYNC = 2
    KV = 3
    KV_REUSE = 4
    BULK = 5

    @property
    def label(self) -> str:
        """The lower-case name used in policy files, scenario files and metrics."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> FlowClass:
        """Return the class named ``text`` (e.g. ``"param_sync"``); raise ValueError otherwise."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(c.label for c in cls)
            raise ValueError(f"unknown flow class {text!r} (expected one of: {names})") from None


#: Classes whose deadline is an absolute time known when the flow opens (MLU banding).
EXPLICIT_DEADLINE = frozenset({FlowClass.PARAM_SYNC, FlowClass.KV})
#: Classes whose deadline is "when the consumer step/layer runs" (RLI ranking).
IMPLICIT_DEADLINE = frozenset({FlowClass.TP, FlowClass.EXPERIENCE, FlowClass.KV_REUSE})
#: the classes whose ``consumer_index`` is a layer index: their RLI compares it with the job's
#: reported layer (``job_index["<job>/layer"]``) when there is one, else with its step
LAYER_CLASSES = frozenset({FlowClass.KV, FlowClass.KV_REUSE})
#: MFS "early stage" classes: they may delay compute directly (served before last-stage flows).
EARLY_STAGE = IMPLICIT_DEADLINE
#: seconds of lateness or earliness one closed flow adds to a histogram at most. A deadline is
#: any finite time a client names: one of 1e308 would pin the ``_sum`` at +Inf, or freeze it,
#: until the daemon restarts. Past the largest bucket (100 s) the value lands in +Inf anyway.
SLACK_CAP = 86_400.0


def deadline_outcome(slack: float) -> tuple[str, float]:
    """A closed flow's deadline outcome from ``slack`` (deadline - completion): ``("met",
    earliness)`` or ``("missed", lateness)``, the amount capped at :data:`SLACK_CAP`. The
    coordinator's and the agent's deadline histograms both record what this returns."""
    if slack >= 0:
        return "met", min(slack, SLACK_CAP)
    return "missed", min(-slack, SLACK_CAP)


@dataclass(slots=True)
class Flow:
    """One flow as every scheduler component sees it.

    ``level`` is the level currently assigned (0 = most urgent, -1 before admission); only the
    component that applies decisions writes it, never a policy.
    """

    flow_id: int
    cls: FlowClass
    opened_at: float
    size: int | None = None
    sent: int = 0
    deadline: float | None = None
    job: str | None = None
    consumer_index: int | None = None
    request: str | None = None
    links: tuple[str, ...] = ()
    node: str | None = None
    level: int = -1
    #: Simulator-only perfect knowledge for the ``llf`` oracle: the true absolute time by which
    #: the flow must finish (implicit deadlines included). Never set by live components.
    oracle_deadline: float | None = None
    #: Free-form attributes (e.g. NCCL setNetAttr op bits); policies must not depend on them.
    attrs: dict[str, int] = field(default_factory=dict)

    @property
    def remaining(self) -> int | None:
        """Bytes left to send, or None when the size is unknown."""
        if self.size is None:
            return None
        return max(self.size - self.sent, 0)


@dataclass(frozen=True, slots=True)
class Decision:
    """What a policy decides for one flow: a level and, optionally, a rate cap in bytes/s.

    ``rate`` is used by pacing policies (Karuna's minimum-rate deadline flows); None = no cap.
    """

    level: int
    rate: float | None = None


@dataclass(frozen=True, slots=True)
class Context:
    """The world as a policy may see it at one instant.

    ``job_index`` maps a job id to its current step or layer index (the ``L_curr`` of RLI).
    ``link_bandwidth`` and ``link_load`` give B (bytes/s) and rho (0..1) per link id; links not
    listed use ``default_bandwidth`` and a load of 0.
    """

    now: float
    job_index: Mapping[str, int] = field(default_factory=dict)
    link_bandwidth: Mapping[str, float] = field(default_factory=dict)
    link_load: Mapping[str, float] = field(default_factory=dict)
    default_bandwidth: float = 25e9

    def bandwidth(self, link: str) -> float:
        """Capacity of ``link`` in bytes/s."""
        return self.link_bandwidth.get(link, self.default_bandwidth)

    def load(self, link: str) -> float:
        """Measured utilization rho of ``link`` in [0, 1]."""
        return min(max(self.link_load.get(link, 0.0), 0.0), 1.0)
