"""pipeline=dpo on the tiny model: one DPO step through the hf engine has the gradient of the true preference loss
(autograd through plain transformers; sigmoid, IPO, SimPO, cDPO + RPO's NLL) over micro-batches that split pairs;
the model learns a rule (chosen responses are digits, rejected ones letters) on training and held-out pairs; the
reference scores each row once over two epochs; a resumed run equals the uninterrupted one; every train engine
composes (LoRA with its base as the reference, no reference model built)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_algos.preference import preference_loss
from roll_core.cli import pipeline_class
from roll_core.cluster.roles import TrainWorker
from roll_core.config import load_config
from roll_core.config.posttrain import DPOConfig
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.dpo import DPOObjective, dpo_objective
from roll_core.posttrain.source import load_rows
from roll_core.testing import constant_answer_task, run_pipeline, tiny_overrides
from roll_core.tracking import Tracker

TRAIN_PAIRS, BATCH, STEPS = 24, 8, 6  # 3 steps an epoch: steps 4-6 are the second epoch


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Pairs whose chosen response is 3 digits and rejected one 3 letters (a rule a tiny model learns), and the
    env task whose held-out problems evaluations sample."""
    folder = tmp_path_factory.mktemp("dpo-data")
    rng = random.Random(0)
    rows = []
    for i in range(TRAIN_PAIRS + 8):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        letters = "".join(rng.choice("abcdefghij") for _ in range(3 + i % 2))  # lengths differ: IPO/SimPO see it
        rows.append({"prompt": f"Q{i}: answer", "chosen": digits, "rejected": letters})
    (folder / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:TRAIN_PAIRS]))
    (folder / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[TRAIN_PAIRS:]))
    return {"task": constant_answer_task(folder / "seven.jsonl", rows=40), "folder": folder}


def dpo_overrides(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    base = [o for o in tiny_overrides(data["task"], out) if not o.startswith(("algo.", "pipeline.max_steps"))]
    return [
        *base,
        "pipeline=dpo",
        f"data.path={data['folder'] / 'pairs.jsonl'}",
        f"data.eval_path={data['folder'] / 'held_out.jsonl'}",
        "env.eval_size=4",
        "algo.lr=2e-3",
        "algo.lr_schedule=constant",
        f"pipeline.rollout_batch_size={BATCH}",
        f"pipeline.max_steps={STEPS}",
        *extra,
    ]


def by_step(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {h["step"]: h for h in history}


# ---- the gradient is the true DPO loss's -------------------------------------------------------------------------
def _row_logps(model: Any, batch: Any) -> torch.Tensor:
    """(B,) summed response log-probs under `model`: teacher-forced on each row's unpadded prompt + response."""
    p_len = batch["prompts"].shape[1]
    rows = []
    for b in range(len(batch)):
        prompt = batch["input_ids"][b, :p_len][batch["attention_mask"][b, :p_len].bool()]
        response = batch["responses"][b][batch["response_mask"][b].bool()]
        logits = model(torch.cat([prompt, response])[None]).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
        rows.append(logp.gather(-1, response[:, None])[:, 0].sum())
    return torch.stack(rows)


def _true_loss(model: Any, batch: Any, ref: torch.Tensor | None, d: DPOConfig) -> torch.Tensor:
    """The preference loss (+ sft_weight x token-mean NLL of the chosen rows) of the pair batch under `model`,
    differentiable (what TRL's DPOTrainer minimises)."""
    seq = _row_logps(model, batch)
    lengths = batch["response_mask"].sum(-1).float()
    loss, _ = preference_loss(
        seq[0::2],
        seq[1::2],
        None if ref is None else ref[0::2],
        None if ref is None else ref[1::2],
        variant=d.loss,
        beta=d.beta,
        label_smoothing=d.label_smoothing,
        simpo_gamma=d.simpo_gamma if d.loss == "simpo" else 0.0,
        chosen_len=lengths[0::2],
        rejected_len=lengths[1::2],
    )
    nll = -seq[0::2].sum() / lengths[0::2].sum()
    return loss.mean() + d.sft_weight * nll


def test_dpo_step_has_the_true_dpo_gradient(data: dict[str, Path], tmp_path: Path) -> None:
    """compute_gradients of the objective's surrogate (micro-batches of 3 rows: pairs split across them) equals
    autograd of the true loss through a plain transformers model, for each loss; then update() takes one
    optimizer step whose reported loss is the true loss's value at the initial weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.cluster.launch import Cluster
    from roll_core.models import resolve_model_path
    from roll_core.pipelines.wiring import build_roles

    cfg = load_config(
        dpo_overrides(data, tmp_path, "train_engine.micro_batch_size=3", "train_engine.pack_sequences=true")
    )
    path = resolve_model_path(cfg.model.path)
    roles = build_roles(cfg, Cluster(cfg.cluster, cfg.hw), path, dpo_objective.needs(cfg))
    assert roles.reference is not None and not roles.reference_is_base
    tok = AutoTokenizer.from_pretrained(path)
    src = load_rows("preference", cfg.data, tok, max_prompt_length=64, max_response_length=6).train
    batch = src.batch([0, 1, 2])  # 6 rows: micro-batches of 3 split pair 1 across two of them
    batch["row_id"] = torch.arange(6)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ref_true = _row_logps(model, batch)  # the initial weights: the reference
    variants = [
        DPOConfig(loss="sigmoid", beta=0.5),
        DPOConfig(loss="sigmoid", beta=0.3, label_smoothing=0.1, sft_weight=0.7),
        DPOConfig(loss="ipo", beta=0.2),
        DPOConfig(loss="simpo", beta=2.0, simpo_gamma=0.3),
    ]
    for d in variants:
        obj = DPOObjective(dataclasses.replace(cfg, dpo=d), roles)
        ref = obj.reference_logps(batch)[0] if d.uses_reference else None
        if ref is not None:
            torch.testing.assert_close(ref, ref_true, atol=1e-5, rtol=1e-5)
        mini, loss_fn, _ = obj.surrogate(batch.index(range(6)), ref)
        got = roles.actor_train.call(TrainWorker.compute_gradients, mini, loss_fn)[0]
        model.zero_grad()
        _true_loss(model, batch, None if ref is None else ref_true, d).backward()
        want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert set(got) == set(want), d
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, atol=2e-6, rtol=1e-4, msg=f"{d} {name}")

    # update(): one optimizer step (algo=dpo's single mini-batch), metrics = the true loss at the initial weights.
    d = variants[1]
    obj = DPOObjective(dataclasses.replace(cfg, dpo=d), roles)
    with torch.no_grad():
        want_loss = float(_true_loss(model, batch, ref_true, d))
    out = StepLog()
    obj.update(1, Collected(batch, batch["is_chosen"].float()), out)
    assert out["actor/optimizer_steps"] == 1.0 and out["actor/nonfinite_steps"] == 0.0
    assert out["dpo/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert out["dpo/reference_rows"] == 6.0  # a new objective's cache starts empty


# ---- runs of the pipeline ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    """An uninterrupted 6-step run (two epochs of the training pairs), evaluated at steps 0, 3 and 6."""
    out = tmp_path_factory.mktemp("dpo-full") / "run"
    _, history = run_pipeline(dpo_overrides(data, out, "pipeline.eval_every=3", "pipeline.save_every=3"))
    return out, by_step(history)


def test_dpo_learns_the_rule_and_scores_each_reference_row_once(full: tuple[Path, dict[int, dict[str, Any]]]) -> None:
    _, steps = full
    first, last = steps[1], steps[STEPS]
    # At the initial weights the policy is the reference: every implicit reward is 0 and the loss is log 2.
    assert first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    margins = [steps[s]["dpo/reward_margin"] for s in range(1, STEPS + 1)]
    assert margins == sorted(margins) and last["dpo/reward_margin"] > 0.3 and last["dpo/reward_accuracy"] == 1.0
    assert last["dpo/loss"] < 0.55 and last["dpo/chosen_logp"] > first["dpo/chosen_logp"]
    # Held-out pairs follow the same rule: their preference accuracy and margin rise, their loss falls.
    assert steps[0]["eval/dpo_accuracy"] == 0.0 and steps[0]["eval/dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert last["eval/dpo_accuracy"] == 1.0 and last["eval/dpo_margin"] > 0.3 and last["eval/dpo_loss"] < 0.55
    assert last["eval/dpo_pairs"] == 8.0 and "eval/accuracy" in last  # the env task's held-out problems, sampled
    # The reference scores each training row once: 2 x 8 rows in each step of the first epoch, none in the second.
    assert [steps[s]["dpo/reference_rows"] for s in range(1, STEPS + 1)] == [16.0] * 3 + [0.0] * 3
    assert all(steps[s]["actor/optimizer_steps"] == 1.0 and steps[s]["data/pairs"] == BATCH for s in range(1, 7))
    # Epochs drawn, fractional: step s has drawn s x BATCH of the TRAIN_PAIRS pairs.
    assert [steps[s]["data/epoch"] for s in range(1, STEPS + 1)] == pytest.approx(
        [s * BATCH / TRAIN_PAIRS for s in range(1, STEPS + 1)]
    )


def test_resumed_run_equals_the_uninterrupted_run(
    data: dict[str, Path], full: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    """The full run's folder, cut back to its step-3 checkpoint, resumed to step 6: the same pairs, losses and
    weights (the reference cache is rebuilt: step 4 scores its rows again, to the same values)."""
    out, steps = full
    crashed = tmp_path / "run"
    shutil.copytree(out, crashed)
    shutil.rmtree(crashed / "checkpoints" / f"step_{STEPS:06d}")
    _, history = run_pipeline(
        dpo_overrides(data, crashed, "pipeline.eval_every=3", "pipeline.save_every=3", "pipeline.resume=true")
    )
    resumed = by_step(history)
    assert sorted(resumed) == list(range(STEPS + 1))
    keys = ["dpo/loss", "dpo/reward_margin", "dpo/chosen_logp", "dpo/rejected_logp", "actor/grad_norm"]
    for s in range(4, STEPS + 1):
        for k in keys:
            assert resumed[s][k] == pytest.approx(steps[s][k], rel=1e-5, abs=1e-6), (s, k)
    assert resumed[4]["dpo/reference_rows"] == 16.0
    assert resumed[STEPS]["eval/dpo_loss"] == pytest.approx(steps[STEPS]["eval/dpo_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(["train_engine=fsdp2", "train_engine.world_size=1"], id="fsdp2"),
        pytest.param(["train_engine=megatron"], id="megatron"),
        pytest.param(["train_engine.lora_rank=8", "algo.lr=2e-2"], id="lora"),
    ],
)
def test_every_train_engine_trains_dpo(
    engine: list[str], data: dict[str, Path], full: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    """Two steps on each engine: step 1 scores the initial weights (engine-independent); step 2 follows a step
    that raised the chosen responses over the rejected ones (the hf run's, for full fine-tuning engines). With LoRA
    the reference is the actor's base (adapters off): no reference model is built."""
    if "megatron" in engine[0]:
        pytest.importorskip("megatron.core")
    lora = "lora" in engine[0]
    if lora:
        pytest.importorskip("peft")
    import torch.distributed as dist

    cfg = load_config(dpo_overrides(data, tmp_path / "run", *engine, "pipeline.max_steps=2", "pipeline.eval_every=0"))
    group = "fsdp2" in engine[0] and not dist.is_initialized()
    if group:  # fsdp2 joins its worker group's process group: a local run is one process, so a gloo group of one
        from roll_core.cluster.ports import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    pipeline = None
    try:
        pipeline = pipeline_class(cfg.pipeline.name)(cfg)
        roles = pipeline.roles
        assert (roles.reference is None, roles.reference_is_base) == ((True, True) if lora else (False, False))
        pipeline.run()
    finally:
        if pipeline is not None:
            pipeline.shutdown()
        if group and dist.is_initialized():
            dist.destroy_process_group()
    steps = by_step(Tracker.read_metrics(Path(pipeline.out) / "metrics.jsonl"))
    _, hf = full
    assert steps[1]["dpo/chosen_logp"] == pytest.approx(hf[1]["dpo/chosen_logp"], rel=1e-4)
    assert steps[1]["dpo/reference_rows"] == 16.0
    assert all(steps[s]["actor/optimizer_steps"] == 1.0 for s in (1, 2))
    assert steps[2]["dpo/reward_margin"] > 0 and steps[2]["dpo/loss"] < math.log(2)
    if not lora:  # the same step as hf's
        for k in ("dpo/loss", "dpo/reward_margin", "dpo/chosen_logp"):
            assert steps[2][k] == pytest.approx(hf[2][k], rel=1e-3), k


def test_bad_settings_and_data_are_clear_errors_before_models_load(data: dict[str, Path], tmp_path: Path) -> None:
    """The factory's check (run before any model loads) and the config schema refuse what DPO cannot use."""
    from roll_core.config.build import build
    from roll_core.errors import ConfigError
    from roll_core.pipelines.collectors.dpo import dpo_collectors
    from roll_core.pipelines.objectives.dpo import check_pair_batch

    base = load_config(dpo_overrides(data, tmp_path, "pipeline.eval_every=0"))
    task = build(base.env)

    def check(data_: dict[str, Any] | None = None, **sections: dict[str, Any]) -> None:
        """The factory's and the objective's checks of `base` with some fields replaced."""
        cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, **(data_ or {})))
        for name, fields in sections.items():
            cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields)})
        dpo_collectors.check(cfg, task)
        dpo_objective.needs(cfg)

    check()  # the good data passes
    with pytest.raises(ConfigError, match=r"set data\.path="):
        check({"path": None})
    with pytest.raises(ConfigError, match=r"data\.format='messages' cannot feed pipeline=dpo"):
        check({"format": "messages"})
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        check({"eval_path": None}, pipeline={"eval_every": 2}, dpo={"generate_eval": False})
    with pytest.raises(ConfigError, match="a mini-batch holds whole pairs"):
        check(algo={"num_mini_batches": BATCH + 1})
    # Settings DPO would take differently from the LR schedule, or ignore: refused (the schedule counted 2x the
    # optimizer steps with mini_batch_size=1, so the LR was still half its peak when the run ended).
    with pytest.raises(ConfigError, match=r"algo\.mini_batch_size=1 makes .* set algo\.mini_batch_size >= 2"):
        check(algo={"mini_batch_size": 1})
    with pytest.raises(ConfigError, match=r"algo\.group_size=8: a DPO step holds 2 rows per pair"):
        check(algo={"mini_batch_size": 4, "group_size": 8})
    for field in ("kl_coef", "entropy_coef"):
        with pytest.raises(ConfigError, match=r"do not apply to DPO"):
            check(algo={field: 0.1})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"prompt": f"Q{i}", "chosen": "1"}) + "\n" for i in range(4)))
    with pytest.raises(ConfigError, match="cannot tell the row form"):
        check({"path": str(bad)})
    for setting, match in (("dpo.loss=kto", "dpo.loss='kto'"), ("dpo.loss=ipo dpo.label_smoothing=0.1", "applies")):
        with pytest.raises((ConfigError, ValueError), match=match):
            load_config(dpo_overrides(data, tmp_path, *setting.split()))
    # A batch that is not chosen/rejected pairs is refused by the objective, never trained on.
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path

    pairs = load_rows(
        "preference",
        base.data,
        AutoTokenizer.from_pretrained(resolve_model_path(base.model.path)),
        max_prompt_length=64,
        max_response_length=6,
    ).train.batch([0, 1])
    pairs["row_id"] = torch.arange(4)
    assert check_pair_batch(pairs) == 2
    with pytest.raises(ValueError, match="chosen at even rows"):
        check_pair_batch(pairs.index([1, 0, 2, 3]))
