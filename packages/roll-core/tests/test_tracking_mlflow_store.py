"""MLflow tracking on the run folder's own SQLite store (no server): the default store and the experiment it
names, params flat and cut at MLflow's length limit, every metric key a name MLflow accepts, the table-list tag of
a long run that resumes, the one-line error without the package. Read back through MLflow's own client. Against a
real tracking server: test_tracking_mlflow.py (through outages: test_tracking_mlflow_outage.py); names that must
stay distinct: test_tracking_mlflow_keys.py. Shared helpers: roll_core.testing.mlflow_server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from roll_core.testing.mlflow_server import clear_mlflow_env, run_id_of
from roll_core.tracking import Tracker


@pytest.fixture(autouse=True)
def _no_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_mlflow_env(monkeypatch)


# Reading the SQLite store here: MLflow's SQL store uses what SQLAlchemy 2.1 deprecates (the backend hides it).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_default_store_is_sqlite_in_the_run_folder(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    from roll_core.trackers.mlflow import read_run

    tracker = Tracker(tmp_path, "experiment: local\ntracking:\n  group: g1\n", ["mlflow"])
    tracker.log(0, {"eval/accuracy": 0.5, "odd key=1": 2.0})
    tracker.samples(0, [{"prompt": "p", "response": "r", "reward": 0.0}])
    tracker.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(run_id_of(tmp_path))
    assert client.get_experiment(run.info.experiment_id).name == "g1"  # tracking.group names the experiment
    assert read_run(client, run.info.run_id) == {0: {"eval/accuracy": 0.5, "odd key_1": 2.0}}
    assert (tmp_path / "mlflow" / "artifacts").is_dir() and not Path("mlruns").exists()
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["config.yaml", "samples"]


def test_params_are_flat_valid_and_cut_at_mlflows_limit() -> None:
    from roll_core.trackers.mlflow import MAX_PARAM_VALUE, PARAM_CUT_NOTE, flatten_config

    params = flatten_config({"a": {"b": 1e-6, "c": [1, 2], "d": None, "e": {}}, "x y=z": "s", "long": "v" * 7000})
    assert params["a.b"] == "1e-06" and params["a.c"] == "[1, 2]" and params["a.d"] == "null" and params["a.e"] == "{}"
    assert params["x y_z"] == "s"
    assert len(params["long"]) == MAX_PARAM_VALUE and params["long"].endswith(PARAM_CUT_NOTE)


def test_every_key_becomes_a_name_mlflow_accepts() -> None:
    """A key MLflow refuses failed the whole batch and the run: a leading '/' (an empty prefix), '..' parts, a cut
    that ends in '/'. Each key, after `mlflow_key`, passes MLflow's own checks of metric and param names."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    import random

    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_metric_name, _validate_param_name

    from roll_core.trackers.mlflow import mlflow_key

    rng = random.Random(0)
    keys = ["/loss", "a/..", "a/../b", "..", ".", "../a", "./a", "a/.", "..x", "", "/", "a/" * 130, "b" * 249 + "/.c"]
    keys += ["".join(rng.choice("/.a@ ") for _ in range(rng.randint(0, 300))) for _ in range(3000)]
    for key in keys:
        name = mlflow_key(key)
        _validate_metric_name(name)
        _validate_param_name(name)
        assert len(name) <= MAX_ENTITY_KEY_LENGTH, key
    valid = ["reward/mean", "eval/math/accuracy", ".hidden", "a/.b", "x y:z-1_2", "é/ü"]
    assert [mlflow_key(k) for k in valid] == valid  # names MLflow takes are kept as they are
    assert [mlflow_key(k) for k in ("/loss", "a/../b", "reward/", "a//b")] == ["_/loss", "a/__/b", "reward/_", "a/_/b"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_the_table_list_tag_stays_json_and_a_long_run_resumes(tmp_path: Path) -> None:
    """The `mlflow.loggedArtifacts` tag listed every step's table: past MLflow's 8000-character tag value (~150
    steps) MLflow cut it, the UI listed no table, and a resume failed reading it back (JSONDecodeError)."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    cfg = "experiment: long\n"
    local = Tracker(tmp_path, cfg, [])  # 200 steps of samples in the run folder, then mlflow on resume
    for step in range(200):
        local.log(step, {"loss": 1.0})
        local.samples(step, [{"prompt": "p", "response": "r", "reward": 0.0}])
    local.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")

    def listed() -> list[int]:
        tag = client.get_run(run_id_of(tmp_path)).data.tags["mlflow.loggedArtifacts"]
        assert len(tag) <= MAX_TAG_VAL_LENGTH
        return [int(entry["path"].removeprefix("samples/step_").removesuffix(".json")) for entry in json.loads(tag)]

    tracker = Tracker(tmp_path, cfg, ["mlflow"], resume=True)
    tracker.truncate(199)  # a new MLflow run: steps 0..199 replayed from the run folder
    tracker.close()
    steps = listed()
    assert steps == list(range(steps[0], 200)) and len(steps) > 100  # the newest tables
    tracker = Tracker(tmp_path, cfg, ["mlflow"], resume=True)
    tracker.truncate(199)  # the same run continues: it reads the tag back
    tracker.samples(200, [{"prompt": "p", "response": "r", "reward": 1.0}])
    tracker.close()
    assert listed() == [*steps[1:], 200]
    assert len(client.list_artifacts(run_id_of(tmp_path), "samples")) == 201  # every table stays an artifact


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (SQLAlchemy's, from MLflow's sqlite store)
def test_the_run_ends_as_the_caller_says_not_as_sys_exc_info_reads(tmp_path: Path) -> None:
    """`close()` read "failed" from sys.exc_info(): a run started and finished inside its caller's `except` (a retry
    loop in user code) ended FAILED. Told how the run ended, MLflow shows that; a caller that says nothing still gets
    FAILED while an exception propagates."""
    pytest.importorskip("mlflow", reason="the roll-core[mlflow] extra")
    from mlflow.tracking import MlflowClient

    def status(name: str, failed: bool | None, propagating: bool) -> str:
        tracker = Tracker(tmp_path / name, "experiment: ends\n", ["mlflow"])
        tracker.log(1, {"loss": 1.0})
        if not propagating:
            tracker.close(failed)
        else:
            try:
                raise RuntimeError("the first attempt failed")
            except RuntimeError:
                tracker.close(failed)
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / name / 'mlflow' / 'mlflow.db'}")
        return client.get_run(run_id_of(tmp_path / name)).info.status

    assert status("retry-ok", False, propagating=True) == "FINISHED"
    assert status("told", True, propagating=False) == "FAILED"
    assert status("unsaid", None, propagating=True) == "FAILED"


def test_without_mlflow_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core.errors import MissingExtraError

    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(MissingExtraError) as err:
        Tracker(tmp_path, "experiment: demo\n", ["mlflow"])
    assert str(err.value) == "pipeline.trackers=[mlflow] needs mlflow: pip install 'roll-core[mlflow]'"
