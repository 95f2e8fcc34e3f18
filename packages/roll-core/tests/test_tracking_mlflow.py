"""MLflow tracking against a healthy tracking server that the tests start (`mlflow server`, SQLite store, 127.0.0.1).

Everything is read back through MLflow's own client (`MlflowClient`): runs, params, metric histories, artifacts.
Covered: the conformance suite (roll_core.testing.trackers) against the server; a tiny roll run with
`pipeline.trackers=[mlflow]` (experiment, run name, the flattened config as params, every metric of metrics.jsonl
at its step, the sample tables, config.yaml); a resume that redoes steps (a new run replays the kept steps, the
old one is retired); credentials kept out of MLflow and of errors. The server (roll_core.testing.mlflow_server) is
started once per module and killed at the end, also on failure. A server that is away, hung or gone:
test_tracking_mlflow_outage.py; the run folder's own SQLite store (no server): test_tracking_mlflow_store.py.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from roll_core.testing.mlflow_server import (
    MlflowServer,
    clear_mlflow_env,
    free_port,
    run_id_of,
    sample_tables,
    serve,
)
from roll_core.testing.trackers import FIRST_ATTEMPT, TrackerTestSuite, assert_steps
from roll_core.tracking import Tracker

#: A smaller tiny run than tiny_overrides' (what is tested is the tracking, not the learning).
SMALLER = ["algo.group_size=2", "pipeline.rollout_batch_size=2", "env.eval_size=2", "pipeline.eval_size=2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    with serve(tmp_path_factory.mktemp("mlflow-server")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_mlflow_env(monkeypatch)


def _config_artifact(client: Any, run_id: str, dst: Path) -> str:
    return Path(client.download_artifacts(run_id, "config.yaml", str(dst))).read_text()


class TestMlflowConformance(TrackerTestSuite):
    tracker = "mlflow"

    @pytest.fixture(autouse=True)
    def _uri(self, server: MlflowServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.server, self.downloads = server, tmp_path / "downloads"
        options = {"tracking_uri": server.url, "experiment": "conformance", "retries": 0}
        monkeypatch.setattr(type(self), "run_config", {"tracking": {"mlflow": options}})

    def read_back(self, run_dir: Path) -> dict[int, dict[str, float]]:
        from roll_core.trackers.mlflow import read_run

        return read_run(self.server.client(), run_id_of(run_dir))

    def read_samples(self, run_dir: Path) -> dict[int, list[dict[str, Any]]]:
        return sample_tables(self.server.client(), run_id_of(run_dir), self.downloads / "samples")

    def read_config(self, run_dir: Path) -> dict[str, Any]:
        return yaml.safe_load(_config_artifact(self.server.client(), run_id_of(run_dir), self.downloads / "config"))

    def test_redone_steps_start_a_new_run_and_retire_the_old(self, tmp_path: Path) -> None:
        from roll_core.trackers.mlflow import read_run

        self._first_attempt(tmp_path, range(4))
        first = run_id_of(tmp_path)
        resumed = self.build(tmp_path, resume=True)
        resumed.truncate(1)
        resumed.log(2, {"loss": 9.0})
        resumed.close()
        client, second = self.server.client(), run_id_of(tmp_path)
        old, new = client.get_run(first), client.get_run(second)
        assert second != first and new.info.run_name == old.info.run_name == "conformance"
        assert new.info.experiment_id == old.info.experiment_id
        assert new.data.tags["roll.resumed_from"] == first and old.data.tags["roll.superseded_by"] == second
        assert old.info.lifecycle_stage == "deleted" and old.info.status == "KILLED"  # restorable, not shown
        assert new.info.status == "FINISHED"
        assert_steps(read_run(client, first), FIRST_ATTEMPT)  # the retired run keeps what it had
        # The new run's history is plain: one point per logged step (nothing for a reader to filter).
        assert [(p.step, p.value) for p in client.get_metric_history(second, "loss")] == [(1, 1.5), (2, 9.0)]


def test_tiny_run_reads_back_through_the_mlflow_client(server: MlflowServer, tmp_path: Path) -> None:
    from roll_core.testing import constant_answer_task, run_pipeline, tiny_overrides
    from roll_core.trackers.mlflow import flatten_config, read_run

    out = tmp_path / "run"
    overrides = ["pipeline.max_steps=2", "pipeline.trackers=[mlflow]", f"tracking.mlflow.tracking_uri={server.url}"]
    overrides += ["+tracking.mlflow.tags.team=rl", *SMALLER]
    _, history = run_pipeline(tiny_overrides(constant_answer_task(tmp_path / "seven.jsonl"), out, *overrides))

    client, run_id = server.client(), run_id_of(out)
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "rlvr"  # no group: the experiment name
    assert (run.info.run_name, run.info.status, run.data.tags["team"]) == ("rlvr", "FINISHED", "rl")
    config_text = (out / "config.yaml").read_text()
    assert _config_artifact(client, run_id, tmp_path / "dl") == config_text  # the whole resolved config
    params = flatten_config(yaml.safe_load(config_text))
    assert run.data.params == params and params["algo.lr"] == "0.003" and params["pipeline.max_steps"] == "2"

    assert [h["step"] for h in history][-2:] == [1, 2]
    assert_steps(read_run(client, run_id), {h["step"]: {k: v for k, v in h.items() if k != "step"} for h in history})
    for key in run.data.metrics:  # each history as MLflow stores it: one point per step, no duplicates
        points = [(p.step, p.value) for p in client.get_metric_history(run_id, key)]
        assert points == [(h["step"], pytest.approx(h[key])) for h in history if h.get(key) is not None], key
    samples: dict[int, list[dict[str, Any]]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        samples.setdefault(row.pop("step"), []).append(row)
    assert samples and sample_tables(client, run_id, tmp_path / "dl") == samples
    shown = json.loads(run.data.tags["mlflow.loggedArtifacts"])  # the UI lists them as tables
    assert shown == [{"path": f"samples/step_{s:06d}.json", "type": "table"} for s in sorted(samples)]


#: A config carrying credentials: a tracking URI with `user:token@`, a reward header, a token (and non-secrets).
def _secret_config(uri: str) -> dict[str, Any]:
    return {
        "experiment": "secrets",
        "tracking": {"mlflow": {"tracking_uri": uri, "retries": 0, "timeout_s": 5}},
        "env": {"reward": {"headers": {"X-API-Key": "key-123", "Accept": "json"}, "api_key_env": "JUDGE_KEY"}},
        "hf_token": "hf_abc",
        "algo": {"max_tokens": 8},
    }


def test_credentials_in_the_config_reach_neither_mlflow_nor_run_json(server: MlflowServer, tmp_path: Path) -> None:
    """Params, the config.yaml artifact and run.json hold no credential; the run folder's config.yaml is kept whole,
    and a resume still finds its run (run.json's URI without userinfo names the same store)."""
    uri = server.url.replace("http://", "http://alice:s3cr3t@")
    cfg = yaml.safe_dump(_secret_config(uri))
    tracker = Tracker(tmp_path, cfg, ["mlflow"])
    tracker.log(0, {"loss": 1.0})
    tracker.close()
    client, run_id = server.client(), run_id_of(tmp_path)
    params = client.get_run(run_id).data.params
    artifact = _config_artifact(client, run_id, tmp_path / "dl")
    state = (tmp_path / "mlflow" / "run.json").read_text()
    for sent in (json.dumps(params), artifact, state):
        assert not any(secret in sent for secret in ("s3cr3t", "alice", "key-123", "hf_abc")), sent
    shown = server.url.replace("http://", "http://***@")
    assert params["tracking.mlflow.tracking_uri"] == shown and json.loads(state)["tracking_uri"] == shown
    assert params["env.reward.headers.X-API-Key"] == params["hf_token"] == "***"
    assert (params["env.reward.headers.Accept"], params["env.reward.api_key_env"]) == ("json", "JUDGE_KEY")
    assert params["algo.max_tokens"] == "8" and yaml.safe_load(artifact)["env"]["reward"]["headers"]["Accept"] == "json"
    assert (tmp_path / "config.yaml").read_text() == cfg  # the user's own file
    resumed = Tracker(tmp_path, cfg, ["mlflow"], resume=True)
    resumed.truncate(0)
    resumed.log(1, {"loss": 0.5})
    resumed.close()
    assert run_id_of(tmp_path) == run_id


def test_an_error_names_the_tracking_uri_without_its_credentials(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    uri = f"http://alice:s3cr3t@127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError, match="cannot start the run") as err:
        Tracker(tmp_path, yaml.safe_dump(_secret_config(uri)), ["mlflow"])
    assert "s3cr3t" not in str(err.value) and "http://***@127.0.0.1:" in str(err.value)
    # What a crash prints: the whole chain. MLflow's own exception, chained as the cause, named the URI with its
    # `alice:s3cr3t@` ("API request to http://alice:s3cr3t@127.0.0.1:.../get-by-name failed ...").
    printed = "".join(traceback.format_exception(err.value))
    assert "direct cause" in printed and "API request to http://***@127.0.0.1:" in printed  # the cause, redacted
    assert "s3cr3t" not in printed and "alice" not in printed
