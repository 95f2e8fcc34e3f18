"""On-policy distillation (`pipeline=distill`) on the tiny model: the student samples, teachers score its tokens.

The teacher of most tests is the tiny model trained for a few steps inside the test to put its mass on the digits
(after any prefix), saved as safetensors: a random student starts far from it (reverse KL ~10 nats per token).
Checked: the advantages are -coef x (student - teacher) log-probs computed by hand with plain transformers (the
teacher after its own chat-templated prompt, the task's system prompt included), rows are routed to their
domain's teacher and scored by it only, the reverse KL falls as the student learns, a resumed run equals the
uninterrupted one, a teacher with another tokenizer (and other unusable settings) is refused before any model
loads, and the objective composes with every train engine.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.testing import run_pipeline, tiny_overrides

DIGITS = "0123456789"


@pytest.fixture(scope="module")
def digit_teacher(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> str:
    """The tiny model after 8 Adam steps of putting its mass on the digits after any prompt and any response
    prefix (teacher log-prob of a non-digit ~ -14, of a digit ~ -2.3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("digit_teacher")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    digits = torch.tensor(tok.convert_tokens_to_ids(list(DIGITS)))
    gen = torch.Generator().manual_seed(0)
    prompts = [_chat_ids(tok, [{"role": "user", "content": f"Q{i}: say 7"}]) for i in range(8)]
    ids, mask = _pad_left(prompts, tok.pad_token_id)
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(8):
        responses = torch.randint(3, len(tok), (len(prompts), 6), generator=gen)
        logits = _response_logits(model, ids, mask, responses)
        loss = -torch.log_softmax(logits, -1)[..., digits].mean()  # cross-entropy to "any digit, uniformly"
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)  # safetensors
    tok.save_pretrained(folder)
    return str(folder)


def _chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def _pad_left(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def _response_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """Logits (B, R, V) predicting each response token after its left-padded prompt."""
    x = torch.cat([ids, responses], 1)
    m = torch.cat([mask, torch.ones_like(responses)], 1)
    logits = model(input_ids=x, attention_mask=m, position_ids=(m.cumsum(1) - 1).clamp_min(0)).logits
    return logits[:, ids.shape[1] - 1 : -1]


def _logprobs_by_hand(path: str, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of `response` after `prompt`: one unpadded plain-transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _distill(data: Path, out: Path, *extra: str) -> list[str]:
    return tiny_overrides(
        data,
        out,
        "pipeline=distill",
        "pipeline.rollout_batch_size=2",
        "algo.group_size=4",
        "pipeline.eval_every=0",
        "pipeline.trackers=[]",
        *extra,
    )


def _rows(path: Path, name: str, answer: str) -> Path:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"{name}{i}: say {answer}", "answer": answer, "example": f"{name} -> {answer}"})
            + "\n"
            for i in range(40)
        )
    )
    return path


def _two_domains(tmp: Path, teacher: str, *extra: str) -> list[str]:
    """env=multi with domains seven and three (one prompt each per step); seven's rows go to `teacher`, three's
    to the default teacher: the student's own model shown an example (context distillation)."""
    seven, three = _rows(tmp / "seven.jsonl", "S", "7"), _rows(tmp / "three.jsonl", "T", "3")
    base = [o for o in _distill(seven, tmp / "run") if not o.startswith("env")]
    return [
        *base,
        "env=multi",
        "~env@env.tasks.math",
        "~env@env.tasks.code",
        "~env@env.tasks.instruct",
        "+env@env.tasks.seven=file",
        f"env.tasks.seven.path={seven}",
        "+env@env.tasks.three=file",
        f"env.tasks.three.path={three}",
        "env.tasks.three.system_prompt=Be brief.",
        "+env.counts.seven=1",
        "+env.counts.three=1",
        "distill.teacher=builtin:tiny",
        f"+distill.teachers.seven={teacher}",
        "distill.teacher_prompt='Example: {example}\n{prompt}'",
        "distill.coef=0.5",
        *extra,
    ]


def test_routed_teachers_score_their_rows_and_advantages_are_their_log_ratios(
    digit_teacher: str, tiny_model: str, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from roll_core.cli import pipeline_class
    from roll_core.pipelines.collectors import Collected
    from roll_core.pipelines.metrics import StepLog

    cfg = load_config(_two_domains(tmp_path, digit_teacher))
    pipe = pipeline_class("distill")(cfg)
    seen: dict[str, Any] = {}
    collected: list[Any] = []
    try:
        assert sorted(pipe.roles.teachers) == ["default", "domain_seven"]
        for name, group in pipe.roles.teachers.items():
            scored = group.compute_logprobs

            def spy(batch: Any, *args: Any, _name: str = name, _scored: Any = scored, **kw: Any) -> Any:
                seen[_name] = batch
                return _scored(batch, *args, **kw)

            group.compute_logprobs = spy
        nxt = pipe.collector.next
        pipe.collector.next = lambda step, log: collected.append(nxt(step, log)) or collected[-1]
        out = pipe.step(1)
        # The task reward's weight: the same rows (behaviour and teacher log-probs unchanged) with chosen scores.
        again = collected[0].batch.index(list(range(8)))
        pipe.trainer.objective.distill = dataclasses.replace(cfg.distill, task_reward_weight=0.3)
        pipe.trainer.objective.update(2, Collected(again, torch.tensor([1.0, 0, 0, 0, 0, 0, 1, 1])), StepLog())
    finally:
        pipe.shutdown()
    batch = collected[0].batch
    domains = [m["domain"] for m in batch["metadata"]]
    assert sorted(domains) == ["seven"] * 4 + ["three"] * 4
    # Each teacher saw exactly its domain's rows, once.
    assert [m["domain"] for m in seen["domain_seven"]["metadata"]] == ["seven"] * 4
    assert [m["domain"] for m in seen["default"]["metadata"]] == ["three"] * 4
    assert out["distill/domain_seven/rows"] == 4 and out["distill/default/rows"] == 4
    assert "old_logprobs" not in batch  # one optimizer step: the student's log-probs are the behaviour ones

    tok = AutoTokenizer.from_pretrained(tiny_model)
    temperature = cfg.infer_engine.temperature
    student_p, teacher_p = torch.zeros_like(batch["behaviour_logprobs"]), torch.zeros_like(batch["behaviour_logprobs"])
    mask = batch["response_mask"].float()
    for i, (meta, prompt) in enumerate(zip(batch["metadata"], batch["prompt_text"])):
        system = [{"role": "system", "content": "Be brief."}] if meta["domain"] == "three" else []
        student_prompt = _chat_ids(tok, [*system, {"role": "user", "content": prompt}])
        teacher_prompt = _chat_ids(tok, [*system, {"role": "user", "content": f"Example: {meta['example']}\n{prompt}"}])
        n = int(batch["response_mask"][i].sum())
        response = batch["responses"][i, :n].tolist()
        teacher_path = digit_teacher if meta["domain"] == "seven" else tiny_model
        student_p[i, :n] = _logprobs_by_hand(tiny_model, student_prompt, response, temperature)
        teacher_p[i, :n] = _logprobs_by_hand(teacher_path, teacher_prompt, response, temperature)
    # The engine sampled with the student's prompt; its log-probs are plain transformers' to float noise.
    assert torch.allclose(batch["behaviour_logprobs"] * mask, student_p, atol=1e-4)
    expected = -0.5 * (student_p - teacher_p) * mask
    assert torch.allclose(batch["advantages"], expected, atol=2e-4), (batch["advantages"] - expected).abs().max()
    # GRPO by hand: (r - group mean) / unbiased group std: [1, 0, 0, 0] -> 1.5, -0.5 x3; [0, 0, 1, 1] -> -+sqrt(3)/2.
    grpo = torch.tensor([1.5, -0.5, -0.5, -0.5, -(3**0.5) / 2, -(3**0.5) / 2, 3**0.5 / 2, 3**0.5 / 2])
    assert torch.allclose(again["advantages"], expected + 0.3 * grpo[:, None] * mask, atol=2e-4)
    gap = (student_p - teacher_p) * mask
    assert out["distill/reverse_kl"] == pytest.approx(float(gap.sum() / mask.sum()), abs=1e-4)
    seven = torch.tensor([d == "seven" for d in domains])
    kl7 = float(gap[seven].sum() / mask[seven].sum())
    assert out["distill/domain_seven/reverse_kl"] == pytest.approx(kl7, abs=1e-4)
    assert kl7 > 3.0  # the digit teacher is far from the random student; the context teacher is not
    assert abs(out["distill/default/reverse_kl"]) < 0.5


def test_reverse_kl_falls_and_a_resumed_run_equals_the_uninterrupted_one(
    digit_teacher: str, seven_task: Path, tmp_path: Path
) -> None:
    common = (f"distill.teacher={digit_teacher}", "algo.lr=1e-2", "pipeline.max_steps=8", "pipeline.save_every=4")
    _, full = run_pipeline(_distill(seven_task, tmp_path / "full", *common))
    steps = [h for h in full if h["step"] > 0]
    kl = [h["distill/reverse_kl"] for h in steps]
    assert len(kl) == 8 and all(h["distill/default/rows"] == 8 for h in steps)
    # Measured: 9.9, 10.0, 8.7, 9.8, 8.5, 7.0, 6.4, 5.3 (the student moves its mass to the digits).
    assert sum(kl[-2:]) < 0.75 * sum(kl[:2]), kl
    assert steps[-1]["distill/teacher_logp"] > steps[0]["distill/teacher_logp"] + 1.0

    # "Stopped" after step 4: the same folder without the step-8 checkpoint, resumed to step 8.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step_000008")
    _, resumed = run_pipeline(_distill(seven_task, resumed_dir, *common, "pipeline.resume=true"))
    by_step = {h["step"]: h for h in steps}
    redone = [h for h in resumed if h["step"] > 4]
    assert [h["step"] for h in redone] == [5, 6, 7, 8]
    for h in redone:
        for k in ("distill/reverse_kl", "distill/teacher_logp", "actor/pg_loss", "reward/mean"):
            assert h[k] == pytest.approx(by_step[h["step"]][k], rel=1e-5, abs=1e-6), (h["step"], k)


def test_context_teacher_shown_the_students_prompt_is_the_student(
    digit_teacher: str, seven_task: Path, tmp_path: Path
) -> None:
    """distill.teacher null: the teacher is the student's starting model (here the digit model: it answers 7 now
    and then, so accuracies are not all 0). Shown the student's own prompt it is the student at step 1 (reverse KL
    0 to float noise), and its step-0 held-out accuracy is the student's, sample for sample."""
    _, history = run_pipeline(
        _distill(
            seven_task,
            tmp_path,
            f"model.path={digit_teacher}",
            "distill.teacher_prompt='{prompt}'",
            "pipeline.max_steps=1",
            "pipeline.eval_every=1",
            "pipeline.eval_size=16",
            "model.max_response_length=1",  # one digit: 7 is correct
        )
    )
    first = next(h for h in history if h["step"] == 0)
    assert first["eval/teacher_n"] == first["eval/n"] == 16 and first["eval/reward"] > 0
    assert first["eval/teacher_accuracy"] == first["eval/accuracy"]
    assert first["eval/teacher_reward"] == first["eval/reward"]
    step = next(h for h in history if h["step"] == 1)
    assert abs(step["distill/reverse_kl"]) < 1e-4 and "eval/teacher_accuracy" not in step
    assert step["distill/teacher_logp"] < -1.0  # a random student: far from certain of its tokens


def test_a_teacher_equal_to_the_student_gives_no_signal_under_truncated_sampling(
    seven_task: Path, tmp_path: Path
) -> None:
    """Top-p sampling (the model presets' defaults: qwen2_5 0.8, llama3 0.9): the engine's log-probs are the
    truncated distribution's, renormalised over the kept tokens, the teacher's the full softmax's. A teacher that
    is the student (its own model, shown its own prompt) measured a reverse KL of -log(kept mass) per token (1.19
    nats here) and pushed every advantage down by it; the student's side is now the trainer's full softmax."""
    _, history = run_pipeline(
        _distill(
            seven_task,
            tmp_path,
            "distill.teacher_prompt='{prompt}'",
            "pipeline.max_steps=1",
            "infer_engine.top_p=0.3",
            "model.max_response_length=8",
        )
    )
    step = next(h for h in history if h["step"] == 1)
    assert abs(step["distill/reverse_kl"]) < 1e-4, step["distill/reverse_kl"]
    assert step["actor/advantage_abs_mean"] < 1e-4
    assert step["distill/student_logp"] == pytest.approx(step["distill/teacher_logp"], abs=1e-4)


def test_rows_without_a_template_field_are_skipped_with_their_group_and_counted(tmp_path: Path) -> None:
    data = tmp_path / "half.jsonl"  # every other problem has an `example` column
    rows = [{"prompt": f"Q{i}: say 7", "answer": "7", **({"example": "7"} if i % 2 else {})} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, history = run_pipeline(
        _distill(
            data,
            tmp_path / "run",
            "distill.teacher_prompt='{example} {prompt}'",
            "pipeline.rollout_batch_size=4",
            "pipeline.max_steps=2",
        )
    )
    steps = [h for h in history if h["step"] > 0]
    skipped = [h["data/skipped_teacher_prompt_rows"] for h in steps]
    for h, n in zip(steps, skipped):
        assert n % 4 == 0 and n + h.get("distill/default/rows", 0) == 16  # whole groups of 4, the rest trained
    assert sum(skipped) > 0 and summary["skipped_teacher_prompt_rows"] == sum(skipped)


def test_unusable_teachers_are_refused_before_any_model_loads(
    digit_teacher: str, tmp_path: Path, seven_task: Path
) -> None:
    from transformers import AutoTokenizer

    from roll_core.config.build import build
    from roll_core.pipelines.collectors.distill import distill_collectors

    def check(*extra: str, overrides: list[str] | None = None) -> None:
        cfg = load_config(overrides or _distill(seven_task, tmp_path / "run", *extra))
        distill_collectors.check(cfg, build(cfg.env))

    other = tmp_path / "other_tokenizer"
    shutil.copytree(digit_teacher, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<tool>"])  # one more token: ids past the student's vocabulary mean other text
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match=rf"(?s)teacher default \({other}\) tokenizes differently.*student \("):
        check(f"distill.teacher={other}")
    check(f"distill.teacher={digit_teacher}")  # same tokenizer: accepted
    with pytest.raises(ConfigError, match="the teacher would be the student itself"):
        check()
    with pytest.raises(ConfigError, match=r"teacher_prompt names \{example\}, which no training problem"):
        check("distill.teacher_prompt='{example} {prompt}'")
    with pytest.raises(ConfigError, match=r"routes domain\(s\) \['maths'\]"):
        check(f"+distill.teachers.maths={digit_teacher}")
    with pytest.raises(ConfigError, match=r"also has domain\(s\) \['three'\] and distill.teacher .* is null"):
        two = [o for o in _two_domains(tmp_path, digit_teacher) if o != "distill.teacher=builtin:tiny"]
        check(overrides=two)
    with pytest.raises(ConfigError, match=r"algo\.adv_estimator=gae trains a critic"):
        from roll_core.pipelines.objectives.distill import distill_objective

        distill_objective.needs(load_config(_distill(seven_task, tmp_path, "algo=ppo", "distill.teacher=x")))


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(("train_engine=fsdp2", "train_engine.world_size=1"), id="fsdp2"),
        pytest.param(("train_engine=megatron",), id="megatron"),
        pytest.param(("train_engine.lora_rank=8",), id="lora"),
    ],
)
def test_distill_composes_with_every_train_engine(
    engine: tuple[str, ...],
    digit_teacher: str,
    seven_task: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One step per engine (hf runs above): the teacher scores on its own copy of the engine, adapters off. fsdp2
    runs as one rank in this process (its multi-rank runs on Ray are tests/e2e/test_multinode.py's)."""
    import torch.distributed as dist

    from roll_core.cluster.ports import free_port

    if "megatron" in engine[0]:
        pytest.importorskip("megatron.core")
    if "fsdp2" in engine[0]:
        for k, v in {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }.items():
            monkeypatch.setenv(k, v)
    try:
        _, history = run_pipeline(
            _distill(seven_task, tmp_path, f"distill.teacher={digit_teacher}", "pipeline.max_steps=1", *engine)
        )
    finally:
        if "fsdp2" in engine[0] and dist.is_initialized():
            dist.destroy_process_group()
    (step,) = [h for h in history if h["step"] == 1]
    assert step["distill/reverse_kl"] > 3.0 and step["distill/default/rows"] == 8
    assert step["actor/grad_norm"] > 0 and step["actor/nonfinite_steps"] == 0
