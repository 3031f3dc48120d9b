"""local_etcd's failed start: the error names the member and quotes its log."""

from __future__ import annotations

import socket

import pytest

from flowsched.testbed.daemons import free_ports
from flowsched.testbed.etcd import etcd_binary, local_etcd

pytestmark = pytest.mark.skipif(
    etcd_binary() is None, reason="etcd is not installed (Debian: apt-get install etcd-server)"
)


def test_a_member_whose_port_is_taken_says_so() -> None:
    client, peer = free_ports(2)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", client))
        squatter.listen()
        with pytest.raises(RuntimeError) as failed, local_etcd(ports=(client, peer)):
            pytest.fail("etcd started on a port held by another socket")
    message = str(failed.value)
    assert f"etcd at http://127.0.0.1:{client} did not start (exit status 1)" in message
    assert "bind: address already in use" in message
