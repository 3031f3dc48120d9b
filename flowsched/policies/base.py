"""The one small interface every scheduling policy implements.

A policy is pure: it keeps only its own bookkeeping, reads time from the injected
:class:`~flowsched.model.Context`, and never does I/O. The very same object runs in the
coordinator, in the agent's fallback mode and in the simulator, which call the hooks at the
same moments:

* ``admit`` when a flow opens (its first level; RMLQ: a low, deferred level),
* ``reevaluate`` on events (job progress, flow progress reports, link-load updates) and on the
  periodic timer; it returns only the flows whose decision changed,
* ``release`` when a flow closes, so that the policy can drop per-flow state.

A policy may also set ``per_flow_decisions = True`` (an optional attribute, read with
``getattr``): it promises that a flow's decision depends only on that flow and the Context, so
a caller may pass any subset of the active flows to ``reevaluate`` (the coordinator then
re-evaluates only the flows an event touched instead of every flow). One exception keeps
request-level rules per-flow: ``reevaluate`` may also return decisions for flows it was NOT
passed, flows it already knows (admitted, not released) whose decision changed because of
another flow's event (RMLQ pruning a request moves the request's other flows to the scavenger
level). Every caller applies such a decision to its own record of that flow id, and its timer
state, like any other decision, and ignores ids it no longer has.

A policy may also define ``next_change(flow, ctx) -> float | None`` (optional, found with
``getattr``): the earliest time at which ``flow``'s decision may change by time alone, with
nothing reported in between (no progress, job step, link load or other flow), given what the
policy knew at its last evaluation of ``flow``; None = never. A caller that re-evaluates a flow
when its inputs change and when this time comes (the coordinator's promotion timers) needs no
periodic sweep. It must not be later than the true change (an early answer only costs a
re-evaluation that changes nothing); policies without it are swept periodically.

A per-flow policy whose decision for a flow also reads other flows of the same request (RMLQ
with ``mlu_scope = "request"``: a flow's MLU counts its request's bytes on its path) defines
``linked_flows(flow) -> Iterable[int]`` (optional): the known flows whose decision or
``next_change`` the opening of ``flow`` may bring forward. A caller that re-evaluates only the
flows an event touched re-evaluates those too, and derives their timers again.

Likewise a per-flow policy may define ``released_affects(flow) -> Iterable[int] | None``
(optional): the known flows whose decision or ``next_change`` the ``release`` of ``flow`` may
change (exact or a superset; decisions the policy returns unasked, such as rmlq's pruning, are
not listed). The coordinator and the simulator re-evaluate those at a close, in a call the
policy gets even when it names none, instead of the rest of the closed flow's job; None, or no
such method, means the whole job (docs/rmlq.md, "Closes").

A per-flow policy with ``next_change`` may also define ``observe_progress(flows, ctx) ->
Mapping[int, Decision]`` (optional): a caller with promotion timers calls it instead of
``reevaluate`` for flows whose news is only more bytes sent (progress reports), plus any flows
it re-evaluates at the same instant. It promises that more bytes sent never bring a flow's
decision change before the time ``next_change`` gave; it folds the bytes into what the policy
measures and returns the decisions that change anyway (usually none; flows not passed, as
above, included). The simulator, which re-evaluates on job steps, completions and timers but
never on bytes, and the agent's fallback do not need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar, Protocol, runtime_checkable

from flowsched.model import Context, Decision, Flow


@runtime_checkable
class Policy(Protocol):
    """Assigns every active flow a level in ``0..num_levels-1`` (0 = most urgent)."""

    name: ClassVar[str]
    num_levels: int

    def admit(self, flow: Flow, ctx: Context) -> Decision:
        """Return the first decision for a newly opened flow."""
        ...

    def reevaluate(self, flows: Iterable[Flow], ctx: Context) -> Mapping[int, Decision]:
        """Return ``{flow_id: decision}`` for the flows whose decision changes.

        ``flows`` are the active flows of the caller's scheduling domain with ``level`` set to
        their current level (with ``per_flow_decisions``, any subset of them). The result may
        also name known flows not in ``flows`` (see the module doc).
        """
        ...

    def release(self, flow: Flow, ctx: Context) -> None:
        """Forget a closed flow."""
        ...


class FlowLocalDecisions:
    """Base of the per-flow policies whose decision for a flow reads only that flow and the
    Context, so that a flow's release changes no other flow's decision or timer. (Here, not in
    policies.common: mypyc compiles that module, and an interpreted class cannot subclass a
    compiled one.)"""

    def released_affects(self, flow: Flow) -> tuple[int, ...]:
        """No other flow (the contract's ``released_affects``, above)."""
        return ()
