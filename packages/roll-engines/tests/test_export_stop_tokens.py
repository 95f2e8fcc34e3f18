"""A checkpoint's exported `actor/model` stops where the run stopped: `model.stop_tokens` (the end-of-turn tokens
every inference engine of the run stopped on, besides the base's eos) join the eos ids of the folder's
generation_config.json, after the base's own, none twice (roll_core.pipelines.exported_stops, called by the
trainer's save). The export's generation config named the base's eos only: plain `model.generate()` on the folder
(and a vLLM server of it) generated past the token the policy learned to end its turns with, to the length limit.

Checked on the folders the `hf` (full and LoRA-merged), `fsdp2` and `megatron` (gloo, one process) engines export,
through `Trainer.save` as the pipeline's checkpoint calls it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.pipelines.trainer import Trainer
from roll_core.testing.models import tiny_model

PROMPT = [[5, 6, 7, 8]]
NEW = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2.5 whose generation config names <|im_end|> as its one eos id (as the hub's name theirs)."""
    from transformers import AutoTokenizer

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    folder = Path(tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), family="qwen2.5"))
    tok = AutoTokenizer.from_pretrained(folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "eos_token_id": [tok.convert_tokens_to_ids("<|im_end|>")]}, indent=2))
    return str(folder)


def _greedy(folder: str | Path, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0, len(PROMPT[0]) :].tolist()


@pytest.mark.parametrize("engine", ["hf", "lora", "fsdp2", "megatron"])
def test_the_exported_model_stops_on_the_runs_stop_tokens(
    base: str, tmp_path: Path, engine: str, one_process_train_engine: Callable[..., Any]
) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(base)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    free = _greedy(base, eos_token_id=None)  # the base's greedy continuation, no stop at all
    assert len(free) == NEW and im_end not in free
    # The run's stop token: the first the continuation reaches after its first token, seen nowhere before it.
    k = next((i for i in range(1, NEW) if free[i] not in free[:i]), 0)
    stop = free[k]
    names = [tok.convert_ids_to_tokens(stop), "<|im_end|>"]  # the base's eos named again: not listed twice

    trainer = SimpleNamespace(
        cfg=SimpleNamespace(model=SimpleNamespace(stop_tokens=names, trust_remote_code=False)),
        roles=SimpleNamespace(actor_train=one_process_train_engine(engine, base, lr=1e-2)),
        objective=SimpleNamespace(state_dict=dict),
        version=0,
        _critics=list,
    )
    Trainer.save(trainer, tmp_path, base)  # (the engine stands for its group: the same save(folder, tokenizer))
    folder = tmp_path / "actor" / "model"

    assert GenerationConfig.from_pretrained(folder).eos_token_id == [im_end, stop]  # was [im_end]
    saved = json.loads((folder / "generation_config.json").read_text())
    kept = json.loads((Path(base) / "generation_config.json").read_text())
    assert {k: v for k, v in saved.items() if k != "eos_token_id"} == {
        k: v for k, v in kept.items() if k not in ("eos_token_id", "_from_model_config")
    }  # the base's sampling defaults kept as they were
    # Plain transformers on the folder stops on the run's stop token (it generated all 8 tokens, past it).
    assert _greedy(folder) == free[: k + 1]
