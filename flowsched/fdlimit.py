"""The daemons' open-file limit, raised to the hard limit at start.

Every peer (an agent at the coordinator, an SDK client at the agent) is a descriptor: under
the usual soft limit of 1024 (systemd's default) a thousand peers exhaust the process and
every further accept fails.
"""

from __future__ import annotations

import logging
import resource

#: when the hard limit is unlimited, the soft limit is raised to this
FD_CEILING = 1 << 20


def raise_fd_limit(log: logging.Logger) -> int:
    """Raise the soft open-file limit to the hard limit (logged on ``log``); return it now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning(
                "open-file limit stays at %d (raising it to %d failed: %s)", soft, target, exc
            )
            return soft
        log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
        return target
    log.info("open-file limit is %d (the hard limit is %s)", soft, hard)
    return soft if soft != resource.RLIM_INFINITY else FD_CEILING
