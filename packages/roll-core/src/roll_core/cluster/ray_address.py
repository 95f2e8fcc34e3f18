"""Whether a Ray cluster answers at `cluster.address`, asked before `ray.init` joins it.

`ray.init(address="host:port")` with nothing listening there (a head not started yet, a typo in the port, a stale
`/tmp/ray/ray_current_cluster` that `address=auto` reads after a head died) does not fail: the driver retries the
GCS without end (over 200 s measured, then stopped by hand), logging a warning every few seconds. `unreachable`
resolves the address as `ray.init` does and opens one TCP connection to it, bounded by `timeout_s`; a refused
connection (or a name that does not resolve, a host with no route) is a reason, which roll_core.cluster.launch
raises as a ConfigError naming `cluster.address`.

Resolution follows `ray.init`: `auto` is replaced by RAY_ADDRESS when that is set (a `ray://` one included: Ray
Client then); an address with a protocol (`://`) is Ray Client's, whose server at `ray://host:port` is the port
tried; `localhost` is replaced by the node's address; `auto` without RAY_ADDRESS reads the address the last
`ray start` recorded.

Refuses only what is certain: a connection that times out is not a reason (something may listen with its accept
queue full, a head under load; a warning is logged and `ray.init` tries), nor is what Ray refuses itself at once
(a malformed address: its own ValueError), nor another client protocol (`anyscale://`) or a `ray://` address
without a port (left to Ray). Does not cover a port where something other than Ray listens (`ray.init` then fails
with its own error).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def _target(address: str) -> str | None:
    """The `host:port` that `ray.init(address=address)` connects to first (None: starts a new instance, or Ray
    decides). Raises ConnectionError for `auto` with no Ray recorded or running on this machine."""
    from ray._private import services

    env = os.environ.get("RAY_ADDRESS")
    if env and address == "auto":  # as ray.init: RAY_ADDRESS overrides `auto` before anything else is read
        address = env
    if "://" in address:  # ray.init hands any address with a protocol to Ray Client
        scheme, _, rest = address.partition("://")
        return rest.split("/", 1)[0].split("?", 1)[0] if scheme == "ray" else None
    try:
        return services.canonicalize_bootstrap_address(address)
    except ValueError:  # malformed (`localhost` without a port): ray.init raises the same error at once
        return None


def unreachable(address: str, timeout_s: float = 5.0) -> str:
    """Why no Ray cluster can be joined at `address` ("" when something listens there, when the answer is not
    certain, or when `address` is `local`, which starts a new instance)."""
    try:
        target = _target(address)
    except ConnectionError as exc:  # `auto` with no Ray recorded or running on this machine
        return str(exc)
    if target is None:
        return ""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return ""  # no port to try: Ray's defaults apply, and its own error
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except TimeoutError:
        log.warning(
            "cluster.address=%s: no answer at %s within %gs (a head busy accepting connections, or a network that "
            "drops them); joining anyway: ray.init keeps trying until the cluster answers",
            address,
            target,
            timeout_s,
        )
        return ""
    except OSError as exc:
        return f"nothing answers at {target} ({exc.strerror or type(exc).__name__})"
    return ""
