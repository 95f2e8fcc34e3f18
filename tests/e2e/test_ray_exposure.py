"""What a local Ray instance that roll starts exposes to the network: every listening socket of the driver and of
every process Ray starts (GCS, raylet, agents, workers) is on loopback, and token authentication is on.

The instance runs in a child process so that it is a fresh one, started exactly as `roll-train cluster=ray`
(`Cluster`) or a multirun on the Ray launcher (`start_sweep_ray`) starts it, with RAY_AUTH_MODE removed from its
environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

PROBE = textwrap.dedent(
    """
    import json
    import sys

    import psutil
    import ray
    from omegaconf import OmegaConf

    from roll_core.cluster.launch import Cluster
    from roll_core.config.schema import ClusterConfig, HwConfig
    from roll_core.sweep import start_sweep_ray

    if sys.argv[1] == "cluster":
        Cluster(ClusterConfig(backend="ray", num_cpus=2), HwConfig(platform="cpu"))
    else:  # what `roll-train -m ... hydra/launcher=ray` starts before its first job
        launcher = OmegaConf.load(sys.argv[2])
        launcher.ray.init.num_cpus = 2
        assert start_sweep_ray(launcher)

    @ray.remote
    def node_ip():
        return ray.util.get_node_ip_address()

    ip = ray.get(node_ip.remote())  # a worker process exists and has opened its server
    listeners = []
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        listeners += [[name, c.laddr.ip, c.laddr.port] for c in conns if c.status == psutil.CONN_LISTEN]
    auth = ray._private.authentication.authentication_utils.is_token_auth_enabled()
    ray.shutdown()
    print("PROBE " + json.dumps({"ip": ip, "listeners": listeners, "auth": auth}))
    """
)
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


LAUNCHER = Path(__file__).resolve().parents[2] / "packages/roll-core/src/roll_core/conf/hydra/launcher/ray.yaml"


def _probe(how: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    cmd = [sys.executable, "-c", PROBE, how, str(LAUNCHER)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


@pytest.mark.parametrize("how", ["cluster", "sweep"])
def test_a_ray_instance_roll_starts_listens_on_loopback_only_with_token_auth(how: str) -> None:
    """`cluster`: roll-train cluster=ray; `sweep`: the Ray launcher's instance of a multirun."""
    got = _probe(how)
    names = {name for name, _, _ in got["listeners"]}
    # The probe sees Ray's own servers, so an empty or partial list cannot pass for "nothing exposed".
    assert {"gcs_server", "raylet"} <= names, got["listeners"]
    exposed = [entry for entry in got["listeners"] if entry[1] not in LOOPBACK]
    assert exposed == [], f"listening beyond loopback: {exposed}"
    assert got["ip"] == "127.0.0.1"
    assert got["auth"] is True
