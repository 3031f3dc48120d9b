"""flowsched: network flow scheduling for large-model GPU clusters (RMLQ on the wire)."""

__version__ = "0.1.0"
