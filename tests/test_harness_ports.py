"""The test servers' ports: free, distinct, and outside the kernel's ephemeral range, so
that a server restarted on its ports (an outage test) finds them free again."""

from __future__ import annotations

import socket

from harness.processes import LISTEN_PORTS_FROM, ephemeral_port_range, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, high = ephemeral_port_range()
    assert LISTEN_PORTS_FROM < low <= high
    ports = free_ports(10)
    assert len(set(ports)) == 10
    assert all(LISTEN_PORTS_FROM <= p < low for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()


def test_an_outgoing_connection_never_takes_a_server_port():
    """The kernel gives an outgoing connection a local port from the ephemeral range."""
    with socket.socket() as server, socket.socket() as client:
        (port,) = free_ports(1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client.connect(("127.0.0.1", port))
        low, high = ephemeral_port_range()
        assert low <= client.getsockname()[1] <= high
        assert not low <= port <= high
