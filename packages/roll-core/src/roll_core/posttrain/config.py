"""The `data` node of a run config: the row files the file-fed pipelines (sft, dpo, distill_offline) read.

A plain dataclass (the lead's run config types it as the `data` node, so an unknown key is a composition error);
`__post_init__` checks values and says how to fix them; `check_installed()` names the pip extra a Parquet file or
a `datasets` folder needs. Files are local: roll never downloads a data set from a hub (save one with
`datasets.Dataset.save_to_disk` or as Parquet/JSONL first).
"""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.errors import Extra

PYARROW = Extra("pyarrow", "Parquet data (data.path=*.parquet)", "pyarrow", "roll-core[data]")
DATASETS = Extra("datasets", "a datasets folder (data.path=<folder>)", "datasets", "roll-core[data]")

#: Row forms `data.format` accepts. SFT and distillation rows: messages | prompt_completion | tokens;
#: preference rows: preference (prompt/chosen/rejected) | rollout (pairs built from a rollout-only output file).
FORMATS = ("auto", "messages", "prompt_completion", "tokens", "preference", "rollout")


def _paths(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name}={value!r} must be a path, a glob, or a list of them")
    return list(value)


@dataclass
class DataConfig:
    """Row files for sft / dpo / distill_offline, their form and column names, and what to do with long rows."""

    # Data files or folders: a path, a glob (data/*.parquet) or a list of them, read in order and concatenated.
    # .jsonl, .json (a list of objects, or JSON lines), .parquet, .csv (text columns only), a folder of Parquet
    # parts (rollout-only's rows.parquet/), or a folder written by datasets' save_to_disk. Local only: nothing is
    # downloaded.
    path: Any = None
    # Held-out rows (same forms as `path`; a `datasets` folder of train and one other split gives that split, as
    # `path` takes its train split); null: `eval_size` rows of `path` held out by a stable hash of their prompt (rows
    # sharing a prompt stay on one side).
    eval_path: Any = None
    # Held-out rows taken from `path` when `eval_path` is null (0: no held-out split; with `eval_path` an error).
    eval_size: int = 0
    # Row form: auto (detected per file) | messages | prompt_completion | tokens (sft, distill_offline) |
    # preference | rollout (dpo: explicit pairs, or pairs built from a rollout-only output).
    format: str = "auto"
    # Prompt/completion text rows: true renders the prompt as a user message with the tokenizer's chat template
    # (the completion is the assistant turn, ended by its end-of-turn token); false concatenates the raw text
    # (the prompt with the tokenizer's bos, the completion followed by eos).
    chat_template: bool = True
    # Passed to every chat-template rendering of the rows, on top of model.chat_template_kwargs (the rows are
    # rendered as the model's prompts are; a key given here wins), e.g. +data.chat_template_kwargs.enable_thinking=true.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # A response longer than model.max_response_length is cut to it (counted as truncated); false skips the row,
    # and a rollout row whose generation was cut (finish_reason=length), which is counted as truncated otherwise.
    # A prompt longer than model.max_prompt_length is always skipped (counted).
    truncate: bool = True
    # Column names.
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    prompt_ids_key: str = "prompt_ids"
    response_ids_key: str = "response_ids"
    # Optional 0/1 loss mask over response_ids (multi-turn rows: observation tokens are 0); absent: all 1.
    response_mask_key: str = "response_mask"
    # Rollout rows: which prompt a sample answers (rows without it are grouped by their prompt_ids).
    group_key: str = "prompt_id"
    # Rollout rows' score (data.min_score, data.pair_margin): the 0/1 flag `correct_key` when any row has it, else
    # the number `reward_key`. null: always the reward (a judge's or reward model's continuous score; rollout-only
    # output has both columns, and its `correct` is the task's threshold of the reward).
    reward_key: str = "reward"
    correct_key: str | None = "correct"
    # Distillation rows: the teacher's top-k token ids and log-probs, one list of K per response token.
    teacher_ids_key: str = "teacher_topk_ids"
    teacher_logprobs_key: str = "teacher_topk_logprobs"
    # Distillation rows: the teacher tokenizer's fingerprint (roll_core.posttrain.tokenize.tokenizer_fingerprint).
    tokenizer_key: str = "tokenizer"
    # Rollout rows read as SFT or distillation rows: keep only samples whose score is at least this (the others
    # are counted as below_min_score); null keeps every sample. On the 0/1 `correct` score only 0 or 1 mean
    # something (1: the correct samples): another value is an error; set correct_key=null to threshold the reward.
    min_score: float | None = None
    # Pairs built from rollout rows: at most this many (chosen, rejected) pairs per prompt.
    pairs_per_prompt: int = 1
    # Pairs built from rollout rows: chosen's score must exceed rejected's by more than this. On the 0/1 `correct`
    # score only 0 means something (correct over incorrect); set correct_key=null to pair by the reward's margin.
    pair_margin: float = 0.0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r} is not one of {', '.join(FORMATS)}")
        _paths(self.path, "data.path")
        _paths(self.eval_path, "data.eval_path")
        if self.eval_size < 0:
            raise ValueError(f"data.eval_size={self.eval_size} must be >= 0 (0: no held-out rows)")
        if self.eval_size and _paths(self.eval_path, "data.eval_path"):
            # eval_path wins in load_rows: eval_size was silently ignored and every row of `path` trained
            raise ValueError(
                f"data.eval_size={self.eval_size} holds rows of data.path out, but data.eval_path is set and is the "
                "held-out split instead: drop one of them"
            )
        if self.pairs_per_prompt < 1:
            raise ValueError(f"data.pairs_per_prompt={self.pairs_per_prompt} must be >= 1")
        if not math.isfinite(self.pair_margin) or self.pair_margin < 0:
            raise ValueError(f"data.pair_margin={self.pair_margin!r} must be a finite number >= 0")
        if self.min_score is not None and not math.isfinite(self.min_score):
            raise ValueError(f"data.min_score={self.min_score!r} must be a finite number or null")

    @property
    def paths(self) -> list[str]:
        """`path` as a list (a single path becomes a list of one)."""
        return _paths(self.path, "data.path")

    @property
    def eval_paths(self) -> list[str]:
        """`eval_path` as a list ([] when null)."""
        return _paths(self.eval_path, "data.eval_path")

    def check_installed(self) -> None:
        """Raise MissingExtraError when a Parquet file or a datasets folder is named and its reader is absent."""
        for p in self.paths + self.eval_paths:
            for name in sorted(glob.glob(p)) or [p]:
                if name.endswith(".parquet"):
                    PYARROW.require()
                elif Path(name).is_dir():
                    (PYARROW if any(Path(name).glob("*.parquet")) else DATASETS).require()
