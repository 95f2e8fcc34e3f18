"""A dry run refuses what the run would refuse: `roll-train ... --cfg job` and tracker plugin options.

- `--cfg job` (and `--cfg all`) printed an invalid config (`algo.group_size=0`, `+algo.foo=1`) with exit 0, since
  Hydra prints without calling the task where roll validates; now it exits 2 with the run's message, prints nothing,
  and still prints a valid config (roll_core.cli_dry_run).
- `tracking.plugins.<name>` of a name no installed tracker plugin has (a misspelt one), or of a built-in backend
  (`wandb`: its options are `tracking.wandb.*`), was accepted and never read (roll_core.config.tracking).

Compose only: nothing trains (the task function is replaced by one that records being called).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from roll_core.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["algo.group_size=0", "--cfg", "job"], "algo.group_size=0 must be >= 1"),
        (["+algo.foo=1", "--cfg", "job"], "Key 'foo' not in 'AlgoConfig'"),
        (["--cfg", "all", "algo.lr=-1"], "algo.lr=-1.0 must be > 0"),
        (["-c", "job", "env=file", "env.eval_size=-1"], "env.eval_size=-1 must be >= 0"),
        (["--cfg", "job", "algo.lr=${algo.nope}"], "Interpolation key 'algo.nope' not found"),
    ],
)
def test_cfg_job_refuses_what_the_run_would_refuse(
    roll_train: Callable[..., int], capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert roll_train(*args) == 2
    out, err = capsys.readouterr()
    assert says in err and "invalid config" in err
    assert out == ""  # the invalid config is not printed as if it were fine


def test_cfg_job_still_prints_a_valid_config_and_one_whose_resolvers_need_the_run(
    roll_train: Callable[..., int], capsys: pytest.CaptureFixture[str]
) -> None:
    assert roll_train("experiment=quickstart", "algo.lr=2e-6", "--cfg", "job") == 0
    assert "lr: 2.0e-06" in capsys.readouterr().out
    # ${hydra:...} resolves only inside a run: no proof the config is wrong, so it is printed (with a warning)
    assert roll_train("--cfg", "job", "pipeline.output_dir=${hydra:runtime.output_dir}") == 0
    assert "output_dir: ${hydra:runtime.output_dir}" in capsys.readouterr().out
    # a value the user is to set (env.path: `???`) is printed as such, the rest checked
    assert roll_train("--cfg", "job", "experiment=sweep_tiny") == 0
    assert "path: ???" in capsys.readouterr().out
    # Hydra's own node is not the job's config: left to Hydra
    assert roll_train("--cfg", "hydra", "algo.group_size=0") == 0


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("+tracking.plugins.dummy_recrd.every=2", "no installed tracker plugin is named 'dummy_recrd' (did you mean "),
        ("+tracking.plugins.wandb.project=demo", "wandb's options are tracking.wandb.<key>"),
        ("+tracking.plugins.tensorboard.flush_secs=5", "the built-in tensorboard tracker takes no options"),
    ],
)
def test_tracker_plugin_options_nobody_reads_are_refused(override: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"tracking\.plugins") as info:
        load_config([override])
    assert says in str(info.value)


def test_an_installed_tracker_plugin_keeps_its_free_form_options() -> None:
    cfg = load_config(["+tracking.plugins.dummy_record.every=2"])
    assert cfg.tracking.plugins == {"dummy_record": {"every": 2}}
