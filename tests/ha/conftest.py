"""Fixtures of the HA tests."""

from ha_helpers import etcd_url

__all__ = ["etcd_url"]
