"""Flow-level simulator: an event-driven fluid network running the real policy objects.

* :mod:`flowsched.sim.allocate` -- strict priority + max-min rate allocation (pure);
* :mod:`flowsched.sim.engine` -- the event loop and the policy hooks (:class:`Simulator`);
* :mod:`flowsched.sim.topology` -- NIC/uplink links of a cluster;
* :mod:`flowsched.sim.serving` / :mod:`flowsched.sim.rl` -- the workloads' dependency DAGs;
* :mod:`flowsched.sim.run` -- one scenario x policy x load run (:func:`run`).
"""

from flowsched.sim.engine import SimConfig, Simulator
from flowsched.sim.run import PolicySpec, RunResult, run

__all__ = ["PolicySpec", "RunResult", "SimConfig", "Simulator", "run"]
