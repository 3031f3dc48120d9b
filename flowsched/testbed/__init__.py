"""The contention benchmark's local testbed (``flowsched bench contention``).

``netns``: namespaces, veth links and strict-priority htb bottlenecks, with guaranteed
teardown; ``trace``: the seeded workload; ``worker``/``minictl``/``sniff``: the processes that
run inside the namespaces; ``runner``: one policy on the testbed; ``replay``: the same trace in
the simulator; ``records``/``report``/``bench``: metrics, reports and the command itself.
"""
