"""Device placement and Ray settings a run cannot honour are refused before anything starts.

- Colocated roles on Ray share the placement group the first of them makes (one single-device bundle per rank of
  actor_train): `infer_engine.world_size` or `reward_model.world_size` above `train_engine.world_size`, or an
  inference engine spanning several devices per worker (`tensor_parallel_size=2`), was refused only when that role's
  turn came, after actor_train's workers had started and loaded the model. Now `build_roles` refuses it before it
  starts any role (roll_core.pipelines.wiring).
- `cluster.address` where no Ray answers: `ray.init` retried without end (over 200 s measured, then stopped by
  hand). Now a ConfigError names the address before `ray.init` (roll_core.cluster.ray_address).
- `+cluster.resources.GPU=1.5` and `+cluster.resources.CPU=4` were refused only where Ray starts: `--cfg job`
  printed them as a valid config. Now the schema refuses them (roll_core.config.schema.ClusterConfig).

Compose only, and a local TCP socket: no Ray instance starts, no model loads.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.wiring import RoleNeeds, build_roles


class _NoGroups:
    """A cluster that records the roles asked of it and starts none."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.platform = type("P", (), {"name": "cpu"})

    def group(self, group_cls: Any, role: str, *args: Any, **kwargs: Any) -> Any:
        self.asked.append(role)
        raise AssertionError(f"{role} started before the layout was checked")


@pytest.mark.parametrize(
    ("overrides", "needs", "says"),
    [
        (
            ["train_engine=fsdp2", "train_engine.world_size=2", "infer_engine.world_size=3"],
            RoleNeeds(train=True),
            r"infer_engine\.world_size=3, but cluster\.placement=colocated shares the 2 device bundle\(s\) of "
            r"train_engine\.world_size=2 .*cluster\.placement=disaggregated",
        ),
        (
            ["reward_model=hf", "reward_model.path=rm", "reward_model.world_size=2"],
            RoleNeeds(train=True),
            r"reward_model\.world_size=2, but .* of train_engine\.world_size=1",
        ),
        (
            ["infer_engine.world_size=2", "reward_model=hf", "reward_model.path=rm", "reward_model.world_size=3"],
            RoleNeeds(train=False),
            r"reward_model\.world_size=3, but .* of infer_engine\.world_size=2",
        ),
        (
            ["infer_engine=vllm", "infer_engine.tensor_parallel_size=2"],
            RoleNeeds(train=True),
            r"infer_engine=vllm spans 2 devices per worker \(tensor_parallel_size\).*cluster\.placement=disaggregated",
        ),
    ],
)
def test_colocated_roles_whose_layouts_disagree_are_refused_before_any_role_starts(
    overrides: list[str], needs: RoleNeeds, says: str
) -> None:
    cfg = load_config(["cluster=ray", *overrides])
    cluster = _NoGroups()
    with pytest.raises(ConfigError, match=says):
        build_roles(cfg, cluster, "unused", needs)  # type: ignore[arg-type]
    assert cluster.asked == []


def test_layouts_that_fit_or_do_not_share_devices_pass_the_check() -> None:
    """The check lets through what the cluster can place: smaller later roles, disaggregated placement, local."""
    for overrides in (
        ["train_engine=fsdp2", "train_engine.world_size=2", "infer_engine.world_size=1"],
        [
            "cluster.placement=disaggregated",
            "infer_engine.world_size=3",
            "infer_engine=vllm",
            "infer_engine.tensor_parallel_size=2",
        ],
    ):
        cluster = _NoGroups()
        with pytest.raises(AssertionError, match="actor_train started"):
            build_roles(load_config(["cluster=ray", *overrides]), cluster, "unused")  # type: ignore[arg-type]
        assert cluster.asked == ["actor_train"]
    local = _NoGroups()
    with pytest.raises(AssertionError, match="actor_train started"):
        build_roles(load_config(["infer_engine.world_size=3"]), local, "unused")  # type: ignore[arg-type]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound on every interface but not listening: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        yield s.getsockname()[1]


def test_an_address_where_no_ray_answers_is_a_config_error_before_ray_init(
    monkeypatch: pytest.MonkeyPatch, closed_port: int
) -> None:
    ray = pytest.importorskip("ray")
    from roll_core.cluster.launch import Cluster
    from roll_core.config.schema import ClusterConfig, HwConfig

    inits: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))
    address = f"127.0.0.1:{closed_port}"
    t0 = time.monotonic()
    with pytest.raises(
        ConfigError, match=rf"cluster\.address={address}: no Ray cluster to join: nothing answers at .*:{closed_port}"
    ):
        Cluster(ClusterConfig(backend="ray", address=address), HwConfig(platform="cpu"))
    assert inits == [] and time.monotonic() - t0 < 10


def test_unreachable_tells_a_listening_address_from_a_closed_one(closed_port: int) -> None:
    pytest.importorskip("ray")
    from roll_core.cluster.ray_address import unreachable

    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        assert unreachable(f"127.0.0.1:{port}") == ""
        assert unreachable(f"ray://127.0.0.1:{port}") == ""
    assert f"nothing answers at 127.0.0.1:{closed_port}" in unreachable(f"ray://127.0.0.1:{closed_port}")
    assert unreachable("local") == ""  # starts a new instance: nothing to join


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("+cluster.resources.GPU=1.5", r"cluster\.resources\.GPU=1\.5: a Ray instance holds a whole number of GPUs"),
        ("+cluster.resources.CPU=4", r"cluster\.resources\.CPU: Ray counts CPU itself.*set cluster\.num_cpus"),
    ],
)
def test_cfg_job_refuses_ray_resources_ray_would_refuse(
    roll_train: Callable[..., int], capsys: pytest.CaptureFixture[str], override: str, says: str
) -> None:
    import re

    assert roll_train("cluster=ray", override, "--cfg", "job") == 2
    out, err = capsys.readouterr()
    assert re.search(says, err) and out == ""
