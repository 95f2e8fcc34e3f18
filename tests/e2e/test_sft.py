"""pipeline=sft on the tiny model: it learns a small memorisable set (train and held-out NLL fall, greedy generation
of the env's held-out prompts reproduces the trained completion), the loss is the NLL of the loss-masked tokens
only, a resumed run equals the uninterrupted one, its checkpoint starts an RL run, every train engine composes,
and bad data is a clear error before any model loads."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.pipelines.objectives.sft import SFTLoss
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import load_rows
from roll_core.testing import run_pipeline, tiny_overrides

sys.path.insert(0, str(Path(__file__).parent))
from sft_runs import BATCH, COMPLETION, STEPS, sft_data, sft_overrides

#: Trained tokens per row: the character-level tokenizer's ids of COMPLETION and the end-of-turn (eos) token.
ROW_TOKENS = len(COMPLETION) + 1


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The SFT rows and the env task (sft_runs.sft_data); the runs' overrides: sft_runs.sft_overrides."""
    return sft_data(tmp_path_factory.mktemp("sft-data"))


def steps_of(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {h["step"]: h for h in history}


@pytest.fixture(scope="module")
def full(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """The uninterrupted run: 4 steps of 8 rows (2 optimizer steps each), evaluated at steps 0 and 4, checkpoints
    at steps 2 and 4."""
    out = tmp_path_factory.mktemp("full") / "run"
    summary, history = run_pipeline(sft_overrides(data, out))
    assert summary["train_rows"] + summary["held_out_rows"] == 40 and summary["held_out_rows"] >= 8
    assert summary["skipped_rows"] == {} and summary["truncated_rows"] == 0
    by_step = steps_of(history)
    by_step[0]["train_rows"] = summary["train_rows"]
    return out, by_step


def test_sft_learns_the_rows_and_generates_them(full: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, by_step = full
    assert sorted(by_step) == list(range(STEPS + 1))
    for s in range(1, STEPS + 1):
        # Only the completion and its eos carry loss: 8 rows x 10 tokens, whatever the prompt's length.
        assert by_step[s]["sft/tokens"] == BATCH * ROW_TOKENS
        assert by_step[s]["actor/optimizer_steps"] == 2.0 and by_step[s]["actor/nonfinite_steps"] == 0.0
        assert by_step[s]["sft/ppl"] == pytest.approx(math.exp(by_step[s]["sft/loss"]), rel=1e-6)
        assert by_step[s]["data/epoch"] == pytest.approx(s * BATCH / by_step[0]["train_rows"])
    # A random model's NLL is about log(vocab) = log(99) ~ 4.6 per token; the memorised completion's falls far.
    assert by_step[1]["sft/loss"] > 4.0
    assert by_step[STEPS]["sft/loss"] < 0.65 * by_step[1]["sft/loss"]  # measured: 4.35 -> 2.55
    assert by_step[STEPS]["eval/sft_loss"] < 0.6 * by_step[0]["eval/sft_loss"]  # measured: 4.61 -> 2.26
    # Greedy generation of the env's held-out prompts reproduces the trained completion (the pushed weights).
    assert by_step[0]["eval/accuracy"] == 0.0
    assert by_step[STEPS]["eval/accuracy"] == 1.0 and by_step[STEPS]["eval/n"] == 8
    assert by_step[0]["eval/accuracy_stderr"] == by_step[STEPS]["eval/accuracy_stderr"] == 0.0  # no spread


def test_resumed_run_equals_the_uninterrupted_run(
    data: dict[str, Path], full: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    # "Crashed" after the checkpoint of step 2 (evaluation off: it does not touch the training side).
    run_pipeline(sft_overrides(data, out, f"pipeline.max_steps={STEPS // 2}", "pipeline.eval_every=0"))
    _, history = run_pipeline(sft_overrides(data, out, "pipeline.resume=true"))
    resumed = steps_of(history)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    keys = ("sft/loss", "actor/grad_norm", "data/epoch", "eval/sft_loss", "eval/accuracy")
    # The same rows in the same order, from the same weights and optimizer state.
    for s in range(STEPS // 2 + 1, STEPS + 1):
        for k in keys:
            if k in full[1][s]:
                assert resumed[s][k] == pytest.approx(full[1][s][k], rel=1e-5, abs=1e-6), (s, k)


def test_sft_checkpoint_starts_an_rl_run(
    data: dict[str, Path], full: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    actor = full[0] / "checkpoints" / f"step_{STEPS:06d}" / "actor" / "model"
    overrides = [
        *tiny_overrides(data["seven"], tmp_path / "rl", "pipeline.max_steps=1", "model.max_response_length=12"),
        f"model.path={actor}",
        "algo.group_size=2",
        "infer_engine.temperature=0.05",  # near-greedy rollouts: what the SFT model answers
    ]
    _, history = run_pipeline(overrides)
    rl = steps_of(history)[1]
    # The RL run starts from the SFT model (whose greedy answers were all correct), not from a random one.
    assert full[1][STEPS]["eval/accuracy"] == 1.0
    assert rl["reward/accuracy"] == 1.0
    assert rl["actor/optimizer_steps"] == 1.0 and math.isfinite(rl["actor/pg_loss"])


@pytest.fixture(scope="module")
def first_batch_nll(data: dict[str, Path], tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> float:
    """Token-mean NLL of a run's first batch under the initial weights, by plain transformers: the rows the
    collector reads for this config, drawn by the sampler's first draw, each scored alone without padding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.data import PromptSampler
    from roll_core.pipelines.collectors.sft import read_rows

    cfg = load_config(sft_overrides(data, tmp_path_factory.mktemp("nll")))
    rows = read_rows(cfg, AutoTokenizer.from_pretrained(tiny_model)).train
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    total, tokens = 0.0, 0
    for i in PromptSampler(len(rows), seed=cfg.pipeline.seed).next(BATCH):
        row = rows.items[i]
        ids = torch.tensor([row.prompt_ids + row.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(row.prompt_ids) - 1 : -1].float(), -1)
        picked = logp.gather(-1, torch.tensor(row.response_ids)[:, None])[:, 0]
        total -= float((picked * torch.tensor(row.mask)).sum())
        tokens += sum(row.mask)
    return total / tokens


@pytest.fixture
def gloo_group_of_one(request: pytest.FixtureRequest):
    """train_engine=fsdp2 joins its worker group's process group; a local run is one process: give it a gloo group
    of one, as the engine's conformance hook does (destroyed after the test)."""
    import torch.distributed as dist

    created = False
    if "fsdp2" in request.node.callspec.id and not dist.is_initialized():
        from roll_core.cluster.ports import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(["train_engine=megatron"], id="megatron"),
        pytest.param(["train_engine.lora_rank=8"], id="lora"),
        pytest.param(["train_engine=fsdp2", "train_engine.world_size=1"], id="fsdp2"),
    ],
)
def test_every_train_engine_trains_sft(
    engine: list[str], data: dict[str, Path], first_batch_nll: float, gloo_group_of_one: None, tmp_path: Path
) -> None:
    if "megatron" in engine[0]:
        pytest.importorskip("megatron.core")
    if "lora" in engine[0]:
        pytest.importorskip("peft")
    one_step = ("pipeline.max_steps=1", "pipeline.eval_every=0", "algo.num_mini_batches=1")
    _, history = run_pipeline(sft_overrides(data, tmp_path / "run", *engine, *one_step))
    first = steps_of(history)[1]
    # One optimizer step on the first batch: its loss is the initial weights' NLL of those rows (LoRA's adapters
    # start at zero), whatever the engine.
    assert first["sft/tokens"] == BATCH * ROW_TOKENS
    assert first["sft/loss"] == pytest.approx(first_batch_nll, rel=1e-4)
    assert first["actor/optimizer_steps"] == 1.0 and math.isfinite(first["actor/grad_norm"])


def test_loss_is_the_nll_of_the_masked_tokens_only(tiny_model: str, tmp_path: Path) -> None:
    """The engine's SFT loss equals -sum(logp * mask) / sum(mask) computed by hand from compute_logprobs, over
    micro-batches of one row and a multi-turn row whose untrained assistant turn is context (mask 0 inside)."""
    from transformers import AutoTokenizer

    from roll_engines.train.hf import HFTrainEngine

    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "garbage 123", "train": False},
        {"role": "user", "content": "say 7"},
        {"role": "assistant", "content": "7"},
    ]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "Q1: say 7", "completion": "the answer is 7"}) + "\n")
    paths = [str(tmp_path / "chat.jsonl"), str(tmp_path / "text.jsonl")]  # a file per row form
    tok = AutoTokenizer.from_pretrained(tiny_model)
    source = load_rows("sft", DataConfig(path=paths), tok, max_prompt_length=64, max_response_length=64).train
    batch = source.batch([0, 1])
    mask = batch["response_mask"]
    # The chat row trains "7" + eos only; its earlier assistant turn and the user turn between are context.
    assert int(mask[0].sum()) == 2 and int((mask[0] == 0).sum()) > len("garbage 123")
    assert int(mask[1].sum()) == len("the answer is 7") + 1
    engine = HFTrainEngine(tiny_model, lr=1e-3, micro_batch_size=1)
    logp = engine.compute_logprobs(batch.tensors())["logprobs"]
    nll = -(logp * mask).sum() / mask.sum()
    metrics = engine.train_step(batch.tensors(), SFTLoss(), mini_batches=1)
    # Per-micro-batch metric sums averaged alike: their ratio is the batch's token-mean NLL (2 vs 16 tokens).
    assert metrics["sft/nll_sum"] / metrics["sft/micro_tokens"] == pytest.approx(float(nll), rel=1e-5)
    # And the loss value the gradient comes from, per micro-batch, is the row's own token mean.
    row0 = -(logp[0] * mask[0]).sum() / mask[0].sum()
    loss0, _ = SFTLoss()({"logprobs": logp[:1]}, {"response_mask": mask[:1]})
    assert float(loss0) == pytest.approx(float(row0), rel=1e-6)
    assert SFTLoss().units({"response_mask": mask}) == float(mask.sum())
    assert torch.isfinite(torch.tensor(metrics["grad_norm"]))


def _pipeline_error(data: dict[str, Path], tmp_path: Path, *extra: str) -> str:
    from roll_core.pipelines.loop import Pipeline

    with pytest.raises(ConfigError) as err:
        Pipeline(load_config(sft_overrides(data, tmp_path / "run", *extra)))
    # Raised by the collector's check or the objective's needs: before any model loads (build_roles).
    assert not any(entry.name == "build_roles" for entry in err.traceback)
    assert any(entry.name in ("check", "needs") for entry in err.traceback)
    return str(err.value)


def test_bad_data_is_a_clear_error_before_models_load(data: dict[str, Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "holds no rows (empty file)" in _pipeline_error(data, tmp_path, f"data.path={empty}")
    bad = tmp_path / "bad.jsonl"
    # Every row is unusable: a conversation without an assistant turn, one that starts with the turn to train.
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "assistant", "content": "7"}]})
        + "\n"
    )
    msg = _pipeline_error(data, tmp_path, f"data.path={bad}")
    assert "no usable rows" in msg and "no_assistant_turn" in msg, msg
    # Rollout-only output filtered to correct samples (data.min_score): none reaches it.
    rollout = tmp_path / "rollout.jsonl"
    rollout.write_text(
        "".join(json.dumps({"prompt_ids": [5, 6], "response_ids": [7, 2], "reward": r}) + "\n" for r in (0.0, 0.5))
    )
    msg = _pipeline_error(data, tmp_path, f"data.path={rollout}", "data.min_score=1")
    assert "no usable rows" in msg and "below_min_score" in msg, msg
    assert "set data.path" in _pipeline_error(data, tmp_path, "data.path=null")
    # RL settings SFT would silently ignore are refused.
    assert "algo.ppo_epochs=1" in _pipeline_error(data, tmp_path, "algo.ppo_epochs=2")
