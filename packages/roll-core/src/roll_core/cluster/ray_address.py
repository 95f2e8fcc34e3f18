"""Whether a Ray cluster answers at `cluster.address`, asked before `ray.init` joins it.

`ray.init(address="host:port")` with nothing listening there (a head not started yet, a typo in the port, a stale
`/tmp/ray/ray_current_cluster` that `address=auto` reads after a head died) does not fail: the driver retries the
GCS without end (over 200 s measured, then stopped by hand), logging a warning every few seconds. `unreachable`
resolves the address as `ray.init` does (`auto`, RAY_ADDRESS, `localhost` replaced by the node's address) and opens
one TCP connection to it, bounded by `timeout_s`; a refused or timed-out connection is a reason, which
roll_core.cluster.launch raises as a ConfigError naming `cluster.address`.

Covers addresses `host:port`, `auto` and `ray://host:port` (Ray Client's server). Does not cover a port where
something other than Ray listens (`ray.init` then fails with its own error) or a `ray://` address without a port
(left to Ray).
"""

from __future__ import annotations

import socket


def unreachable(address: str, timeout_s: float = 5.0) -> str:
    """Why no Ray cluster can be joined at `address` ("" when something listens there, or when `address` is
    `local`, which starts a new instance)."""
    from ray._private import services

    if address.startswith("ray://"):
        target: str | None = address[len("ray://") :].split("/", 1)[0]
    else:
        try:
            target = services.canonicalize_bootstrap_address(address)
        except ConnectionError as exc:  # `auto` with no Ray recorded or running on this machine
            return str(exc)
    if target is None:
        return ""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return ""  # no port to try: Ray's defaults apply, and its own error
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"nothing answers at {target} ({exc.strerror or type(exc).__name__})"
    return ""
