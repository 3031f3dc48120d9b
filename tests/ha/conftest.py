"""Fixtures of the HA tests."""

from ha_helpers import etcd_server_tls, etcd_tls_url, etcd_url

__all__ = ["etcd_server_tls", "etcd_tls_url", "etcd_url"]
