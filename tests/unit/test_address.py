"""host:port read one way everywhere, IPv6 brackets included."""

from __future__ import annotations

import pytest

from sidecar.config import address
from sidecar.serve.workers import standby_addresses, worker_addresses


@pytest.mark.parametrize(("addr", "parts"), [
    ("127.0.0.1:9000", ("127.0.0.1", 9000)),
    ("[::1]:9000", ("::1", 9000)),
    ("sidecar.local:50051", ("sidecar.local", 50051)),
    (":80", ("", 80)),
])
def test_split(addr, parts):
    assert address.split(addr) == parts
    assert address.host_of(addr) == parts[0]


@pytest.mark.parametrize("bad", ["127.0.0.1", "host:port", "host:65536", "host:-1", ""])
def test_split_refuses_what_is_not_host_port(bad):
    with pytest.raises(ValueError, match="host:port"):
        address.split(bad)


def test_join_brackets_ipv6_and_round_trips():
    for addr in ("127.0.0.1:9000", "[::1]:9000", "name:1"):
        assert address.join(*address.split(addr)) == addr


def test_the_worker_port_layout():
    grpc, admin = worker_addresses("[::1]:50051", "127.0.0.1:9190", 3)
    assert grpc == ["[::1]:50051", "[::1]:50052", "[::1]:50053"]
    assert admin == ["127.0.0.1:9190", "127.0.0.1:9191", "127.0.0.1:9192"]
    assert worker_addresses("a:1", "", 2)[1] == ["", ""]
    assert standby_addresses(grpc) == ["[::1]:50054", "[::1]:50055", "[::1]:50056"]
