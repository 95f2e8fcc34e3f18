"""The distill settings each distillation pipeline ignores are refused, not silently accepted, and stored teacher
ids are checked against the student model's vocabulary.

`pipeline=distill` (on-policy) reads distill.coef and distill.task_reward_weight, not distill.kind / topk / tail /
eval_task; `pipeline=distill_offline` the reverse, and distill.topk only when distill.teacher computes the top-k.
A changed value of an ignored key is a ConfigError naming the key, the pipeline and the fix; the defaults (which
the `distill` node fills whatever the pipeline) pass. Stored `teacher_topk_ids` are read against the tokenizer's
length; an id the model config's `vocab_size` lacks is refused when the collector is built, naming the row (it
failed inside the engine's gather). Real composed configs, the real task, tokenizer and collector."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from roll_core.config import load_config
from roll_core.config.build import build
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import CollectorContext
from roll_core.pipelines.collectors.distill import check_distill
from roll_core.pipelines.collectors.distill_offline import OfflineDistillCollector
from roll_core.pipelines.objectives.distill_offline import check_offline_distill

ON_POLICY = ["model=tiny", "pipeline=distill"]
OFFLINE = ["model=tiny", "pipeline=distill_offline"]


@pytest.mark.parametrize(
    "override", ["distill.kind=reverse", "distill.topk=5", "distill.tail=false", "distill.eval_task=false"]
)
def test_on_policy_distill_refuses_offline_only_settings(override: str) -> None:
    cfg = load_config([*ON_POLICY, "distill.teacher_prompt='Example: 1+1=2. {prompt}'", override])
    key = re.escape(override)
    with pytest.raises(ConfigError, match=rf"^{key}: pipeline=distill \(on-policy\).*ignored here: drop them"):
        check_distill(cfg, build(cfg.env))


def test_on_policy_distill_accepts_its_own_settings_and_the_defaults() -> None:
    own = ["distill.teacher_prompt='Example: 1+1=2. {prompt}'", "distill.coef=0.5", "distill.task_reward_weight=0.3"]
    cfg = load_config([*ON_POLICY, *own])
    check_distill(cfg, build(cfg.env))  # context distillation: no other tokenizer to load


@pytest.mark.parametrize("override", ["distill.coef=0.5", "distill.task_reward_weight=0.3"])
def test_offline_distill_refuses_on_policy_settings(override: str) -> None:
    cfg = load_config([*OFFLINE, "distill.teacher=builtin:tiny", override])
    why = r"pipeline=distill_offline trains the top-k KL alone .* ignores them: drop them.*or use pipeline=distill"
    with pytest.raises(ConfigError, match=rf"^{re.escape(override)}: .*{why}"):
        check_offline_distill(cfg)


def test_offline_distill_refuses_topk_for_rows_that_store_their_own() -> None:
    stored = r"without distill\.teacher the rows' stored teacher_topk_ids .* ignores distill\.topk: drop it"
    with pytest.raises(ConfigError, match=rf"^distill\.topk=5: {stored}, or set distill\.teacher="):
        check_offline_distill(load_config([*OFFLINE, "distill.topk=5"]))
    # a teacher computes the top-distill.topk; the offline loss's own settings and the defaults pass
    own = ["distill.topk=5", "distill.kind=reverse", "distill.tail=false", "distill.eval_task=false"]
    check_offline_distill(load_config([*OFFLINE, "distill.teacher=builtin:tiny", *own]))
    check_offline_distill(load_config(OFFLINE))


def test_stored_teacher_ids_beyond_the_models_vocabulary_are_refused_naming_the_row(tmp_path: Path) -> None:
    """A model whose config's vocab_size is below the tokenizer's length (added tokens without logits): a stored id
    between the two passes the rows' tokenizer check and must be refused by the collector, naming the row."""
    from transformers import LlamaConfig

    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    vocab = len(tok) - 8
    model = tmp_path / "model"
    tok.save_pretrained(model)
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    LlamaConfig(vocab_size=vocab, **small).save_pretrained(model)  # the config is all _vocab_size reads

    def rows(bad_id: int) -> str:
        out = []
        for i in range(4):
            ids = [[40 + i, 6, 7], [8, 9, bad_id if i == 2 else 10]]
            lps = [[-1.5, -2.0, -2.5]] * 2
            out.append(
                dict(prompt_ids=[3, 4], response_ids=[20 + i, 30], teacher_topk_ids=ids, teacher_topk_logprobs=lps)
            )
        path = tmp_path / f"rows_{bad_id}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in out))
        return str(path)

    def collector(bad_id: int) -> OfflineDistillCollector:
        paths = [f"model.path={model}", f"data.path={rows(bad_id)}", f"pipeline.output_dir={tmp_path / 'run'}"]
        cfg = load_config([*OFFLINE, *paths, "data.eval_size=0", "pipeline.eval_every=0"])
        ctx = CollectorContext(cfg, None, None, None, tok, None, str(model))  # no roles: stored rows, no evaluation
        return OfflineDistillCollector(ctx)

    assert len(collector(vocab - 1).data.train) == 4  # the model's last id: accepted
    bad = vocab + 3
    where = rf"rows_{bad}\.jsonl:3: teacher_topk_ids holds token id {bad}"
    outside = rf"outside the vocabulary of model\.path={re.escape(str(model))} \(its config's vocab_size={vocab}"
    with pytest.raises(ConfigError, match=rf"{where}, {outside}"):
        collector(bad)


def test_stored_top_1_lists_without_the_tail_bucket_are_refused_when_the_collector_is_built(tmp_path: Path) -> None:
    """Rows storing the teacher's top-1 with distill.tail=false train nothing (the KL over one id, renormalised on both
    sides, is 0 whatever the student). The loss refuses it, but only at the first step inside the train worker; the
    collector refuses it when it is built, naming the row. With the tail bucket the rows pass."""
    from transformers import LlamaConfig

    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = tmp_path / "model"
    tok.save_pretrained(model)
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    LlamaConfig(vocab_size=len(tok), **small).save_pretrained(model)
    path = tmp_path / "top1.jsonl"
    rows = [
        dict(
            prompt_ids=[3, 4],
            response_ids=[20 + i, 30],
            teacher_topk_ids=[[40], [8]],
            teacher_topk_logprobs=[[-0.1]] * 2,
        )
        for i in range(4)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def collector(tail: bool) -> OfflineDistillCollector:
        paths = [f"model.path={model}", f"data.path={path}", f"pipeline.output_dir={tmp_path / 'run'}"]
        cfg = load_config([*OFFLINE, *paths, "data.eval_size=0", "pipeline.eval_every=0", f"distill.tail={tail}"])
        return OfflineDistillCollector(CollectorContext(cfg, None, None, None, tok, None, str(model)))

    assert len(collector(True).data.train) == 4
    with pytest.raises(ConfigError, match=r"top1\.jsonl:1: teacher_topk_ids holds top-1 lists and distill\.tail=false"):
        collector(False)
