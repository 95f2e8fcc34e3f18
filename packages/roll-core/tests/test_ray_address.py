"""`cluster.address` forms Ray joins are not refused by roll's probe before `ray.init` (roll_core.cluster.ray_address).

- `cluster.address=auto` with RAY_ADDRESS=ray://head:10001 (Ray Client; a job's environment): the probe parsed the
  client address as a GCS address and raised Ray's ValueError ("Invalid address format") before `ray.init`, which
  connects through Ray Client. So did another client protocol (`anyscale://...`), which `ray.init` hands to Ray
  Client too. The probe now resolves `auto` as `ray.init` does and tries the client server's port.
- A head that listens but does not complete the connection within the 5 s limit (its accept queue full under load)
  was refused as "nothing answers"; a timeout is now a warning and `ray.init` is left to connect.

Local TCP sockets only: no Ray instance starts.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from roll_core.cluster.ray_address import unreachable

pytest.importorskip("ray")


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        yield s.getsockname()[1]


def test_auto_with_a_ray_client_address_in_ray_address_joins_through_the_client(
    monkeypatch: pytest.MonkeyPatch, listening_port: int, closed_port: int
) -> None:
    ray = pytest.importorskip("ray")
    from roll_core.cluster.launch import Cluster
    from roll_core.config.schema import ClusterConfig, HwConfig

    inits: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{listening_port}")
    Cluster(ClusterConfig(backend="ray", address="auto"), HwConfig(platform="cpu"))
    assert [kw["address"] for kw in inits] == ["auto"]  # ray.init reads RAY_ADDRESS itself

    # Where no client server answers, the client's port is the one named.
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{closed_port}/")
    assert f"nothing answers at 127.0.0.1:{closed_port}" in unreachable("auto")
    # An explicit address wins over RAY_ADDRESS, as in ray.init.
    assert unreachable(f"127.0.0.1:{listening_port}") == ""


def test_other_client_protocols_and_malformed_addresses_are_left_to_ray(closed_port: int) -> None:
    from ray._private import services

    # ray.init hands any `<protocol>://` address to Ray Client, which knows its protocols: not roll's to probe.
    assert unreachable(f"anyscale://127.0.0.1:{closed_port}") == ""
    # A form Ray itself refuses at once (no hang to spare the user): its own error stays the one raised.
    with pytest.raises(ValueError, match="Invalid address format"):
        services.canonicalize_bootstrap_address("localhost")
    assert unreachable("localhost") == ""


def test_a_head_that_does_not_accept_in_time_is_joined_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A listening socket whose accept queue is full: the kernel drops further connection attempts, which time out,
    as at a head too busy to accept. Something listens there: no refusal, a warning."""
    held: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen(0)
        port = server.getsockname()[1]
        try:
            for _ in range(8):  # fill the queue until a connection attempt times out
                try:
                    held.append(socket.create_connection(("127.0.0.1", port), timeout=0.3))
                except TimeoutError:
                    break
            else:
                pytest.skip("this kernel completes connections beyond the listen backlog")
            with caplog.at_level(logging.WARNING, logger="roll_core.cluster.ray_address"):
                assert unreachable(f"127.0.0.1:{port}", timeout_s=0.3) == ""
        finally:
            for c in held:
                c.close()
    # The address tried is the one ray.init connects to (127.0.0.1 stands for the node's address there).
    assert any(re.search(rf"no answer at \S+:{port} within 0\.3s", r.getMessage()) for r in caplog.records)
