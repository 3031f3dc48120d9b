"""The node agent: shared-memory flow table, SDK socket, coordinator link, local fallback.

``serve(config, *, shutdown_trigger=None)`` runs one agent; :class:`AgentConfig` configures it.
"""

from flowsched.agent.config import AgentConfig, ReadyInfo, default_table_path
from flowsched.agent.service import Agent, serve

__all__ = ["Agent", "AgentConfig", "ReadyInfo", "default_table_path", "serve"]
