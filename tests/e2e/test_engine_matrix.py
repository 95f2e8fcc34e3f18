"""One tiny step of every experiment x infer_engine x train_engine this machine can run (tests/configs composes
all of them, installed or not).

Each combination keeps the experiment's pipeline, environment, algorithm and engine settings and shrinks only the
sizes (the tiny model with a long context, one step of 2 x 2 samples, short turns). A combination
- runs one step that trains, when its engines are installed here and its cluster is local;
- fails at build with the error naming the key to change, when it cannot work as composed (train_engine=fsdp2
  needs a process per rank, so cluster=ray; an engine in its own venv needs Ray actors);
- is skipped, with the one-line missing-extra message, when an engine is not installed here; or when another test
  already runs that shape (named in the reason; cluster=ray experiments are the quickstart's pipeline on Ray).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from roll_core.cluster.launch import resolve_python
from roll_core.config import ConfigError, compose, to_object
from roll_core.config.search_path import group_options
from roll_core.errors import MissingExtraError, check_installed
from roll_core.models import resolve_model_path
from roll_core.multimodal.processor import is_vision_model
from roll_core.testing import run_pipeline

EXPERIMENTS = sorted(group_options("experiment"))  # packaged and the repository's conf/experiment
INFER = sorted(group_options("infer_engine"))
TRAIN = sorted(group_options("train_engine"))
MATRIX = list(itertools.product(EXPERIMENTS, INFER, TRAIN))

#: Shapes another test runs already: (experiment, infer, train) -> where.
COVERED = {
    ("quickstart", "hf", "megatron"): "tests/e2e/test_learning.py runs rlvr on train_engine=megatron, cluster=local",
    ("agentic_sokoban", "hf", "megatron"): "same pipeline and engines as agentic_quickstart-hf-megatron here",
    # The README runs these experiments' first steps with the default engines (hf x hf), evaluation included.
    ("quickstart", "hf", "hf"): "test_readme_commands.py runs `roll-train experiment=quickstart`",
    (
        "agentic_quickstart",
        "hf",
        "hf",
    ): "test_readme_commands.py runs `roll-train experiment=agentic_quickstart`",
    ("agentic_sokoban", "hf", "hf"): "test_readme_commands.py runs `roll-train experiment=agentic_sokoban`",
    # env=multi feeds the same prompts collector and engines as the quickstart (a per-domain sampler and reward).
    ("multi_domain", "hf", "hf"): "tests/e2e/test_multi_domain.py runs env=multi on hf x hf (shares, metrics, eval)",
    ("multi_domain", "hf", "megatron"): "the quickstart's collector on train_engine=megatron runs in test_learning.py",
    ("context_distill", "hf", "megatron"): "pipeline=distill on train_engine=megatron runs in test_distill.py",
    ("vlm_quickstart", "hf", "hf"): "tests/e2e/test_vlm.py runs experiment=vlm_quickstart (learning and blank control)",
    ("vlm_agentic", "hf", "hf"): "tests/e2e/test_vlm_agentic.py runs experiment=vlm_agentic",
}
RAY_EXPERIMENTS = (
    "cluster=ray experiment: the quickstart's pipeline on Ray, run by tests/e2e/test_sweep.py (sweep_tiny), "
    "test_learning.py (hf on Ray), test_multinode.py (fsdp2), test_megatron_ray.py and test_vllm_ray.py"
)


@pytest.fixture(scope="module")
def long_tiny_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny model with a 4096-token context: agentic prompts (rules, board) are ~1k characters and
    its tokenizer is character-level (rotary positions: the limit is only a number in the config)."""
    folder = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _overrides(experiment: str, infer: str, train: str, model: str, data: Path, out: Path) -> list[str]:
    base = [f"experiment={experiment}", f"infer_engine={infer}", f"train_engine={train}"]
    composed = compose(base)
    pipeline = composed.pipeline.name
    # A vision-language experiment keeps its own (tiny) VLM: the text model cannot read its pictures.
    # Only roll's built-in tiny VLMs are resolved here: other presets may name a package CI does not install.
    path = str(composed.model.path)
    vision = path.startswith("builtin:tiny-") and is_vision_model(resolve_model_path(path))
    sizes = [] if vision else ["model=tiny", f"model.path={model}"]
    sizes += [
        "model.max_prompt_length=512",
        "model.max_response_length=8",
        "algo.group_size=2",
        "pipeline.max_steps=1",
        "pipeline.rollout_batch_size=2",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
        "train_engine.micro_batch_size=4",
    ]
    if pipeline == "agentic":
        sizes += ["env.demonstrations=0", "env.max_turns=2", "env.max_tokens_per_turn=8", "env.system_prompt=Solve it."]
    env = composed.env
    if env.get("_target_", "").endswith("FileTask"):
        sizes.append(f"env.path={data}")
    if env.get("counts"):  # fixed prompts per domain: the batch is their sum (a smaller one is a ConfigError)
        sizes.append(f"pipeline.rollout_batch_size={sum(env.counts.values())}")
    return base + sizes


@pytest.mark.parametrize(("experiment", "infer", "train"), MATRIX, ids=["-".join(c) for c in MATRIX])
def test_tiny_step(
    experiment: str, infer: str, train: str, long_tiny_model: str, seven_task: Path, tmp_path: Path
) -> None:
    overrides = _overrides(experiment, infer, train, long_tiny_model, seven_task, tmp_path)
    typed = to_object(compose(overrides))  # composes whatever is installed
    try:
        check_installed(typed)
    except MissingExtraError as exc:
        pytest.skip(f"not installed here: {exc}")
    if typed.cluster.backend == "ray":
        pytest.skip(RAY_EXPERIMENTS)
    if (experiment, infer, train) in COVERED:
        pytest.skip(f"covered: {COVERED[experiment, infer, train]}")
    if train == "megatron" and is_vision_model(resolve_model_path(typed.model.path)):
        with pytest.raises(ConfigError, match=r"train_engine=megatron cannot train the vision-language model"):
            run_pipeline(overrides)
        return
    if typed.train_engine.world_size > 1:  # train_engine=fsdp2: one process per rank
        with pytest.raises(ValueError, match=r"local backend cannot give: use cluster=ray"):
            run_pipeline(overrides)
        return
    if resolve_python(typed.infer_engine.python, infer) is not None:  # vLLM from its venv (python=auto found it)
        with pytest.raises(ConfigError, match=r"own Python environment .* use cluster=ray"):
            run_pipeline(overrides)
        return
    _, history = run_pipeline(overrides)
    steps = [h for h in history if h["step"] == 1]
    assert steps and steps[0].get("actor/optimizer_steps", 0) >= 1, steps  # a rollout was scored and trained on
