"""The cluster coordinator: flow table, policy, level updates, metrics.

``serve(config, *, shutdown_trigger=None)`` runs it; :class:`CoordinatorConfig` configures it
(``CoordinatorConfig.from_policy_file`` builds one from a policy file).

Liveness, as agents see it: the coordinator sends every agent a ``heartbeat`` every
``heartbeat_interval`` (0.2 s, announced in ``welcome``), unless it sent that agent something
else since the previous one (any frame is a sign of life; two frames are then at most two
intervals apart), and expects a frame back at the same pace; it closes a connection that stays
silent for ``idle_timeout`` (2 s). An agent drops a link that brought nothing for 10 heartbeat
intervals (2 s: a coordinator accepting a burst of connections may stall that long) and at
once when the connection breaks; its local policy takes over once it has no link and has
heard nothing for ``fallback_after`` (1 s). After every (re)connect the agent sends ``resync``
with its complete flow set; the coordinator rebuilds that node's flows from it (a
new coordinator thus rebuilds the cluster from the agents; ``tests/coordinator`` checks 10,000
flows within 2 s) and keeps a disconnected node's flows for ``grace_period`` (5 s), so a quick
reconnect loses nothing.
"""

from flowsched.coordinator.config import Addresses, CoordinatorConfig
from flowsched.coordinator.service import Coordinator, serve
from flowsched.coordinator.state import ClusterState

__all__ = ["Addresses", "ClusterState", "Coordinator", "CoordinatorConfig", "serve"]
