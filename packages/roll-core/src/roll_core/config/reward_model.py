"""Config schema of the `reward_model` group: a transformers sequence-classification reward model as a role.

`reward_model=none` (the default) builds nothing. `reward_model=hf reward_model.path=<folder or hub id>` scores
every (prompt, response) with the model's single logit, batched on the role's devices, and then either replaces
the task reward (`mode=replace`) or is added to it (`mode=add`: task score + weight x RM score), after the
normalisation chosen by `normalize`. Checks here need no files; the model itself (a sequence classifier with one
label, a pad token) is checked when the run builds the role (roll_core.pipelines.reward_model), before step 1.

Deliberately free of imports from roll_core.config.schema, which imports this module.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass

from omegaconf import MISSING

NAMES = ("none", "hf")
NORMALIZE = ("none", "batch", "running")
MODES = ("replace", "add")
PLACEMENTS = (None, "colocated", "disaggregated")
TRUNCATION_SIDES = ("left", "right")
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: `template` value that formats rows with the reward model tokenizer's chat template.
CHAT_TEMPLATE = "chat"
#: Placeholders of a text `template` (roll_core.cluster.reward_model.format_row fills them).
TEXT_SLOTS = ("prompt", "conversation", "response")


def _check(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"reward_model.{name}: {message}")


@dataclass
class RewardModelConfig:
    """A reward model scoring (prompt, response) pairs (see the module docstring)."""

    # none: no reward model | hf: a transformers AutoModelForSequenceClassification with one label.
    name: str = "none"
    # HF folder or hub id of the reward model (name=hf). Mandatory in the schema, so that `reward_model=hf` without
    # it is a missing value at composition; reward_model/none.yaml sets null (a Python-built default keeps "???").
    path: str | None = MISSING
    # Tokenizer folder or id; null: `path`.
    tokenizer: str | None = None
    # How a row becomes the model's input: "chat" (the tokenizer's chat template over the policy's prompt conversation
    # and an assistant turn holding the response), or a text with {response} and {prompt} (the user message alone)
    # and/or {conversation} (the whole prompt conversation, system prompt and earlier turns included, as
    # "role: content" blocks) placeholders.
    template: str = CHAT_TEMPLATE
    # Rows per forward pass.
    batch_size: int = 16
    # Most tokens of one input; longer inputs are cut (rows counted in reward_model/truncated).
    max_length: int = 1024
    # Which end of a too-long input is cut: left (keeps the response's end, which the model judges) | right.
    truncation_side: str = "left"
    # Weights dtype: auto | float32 | bfloat16 | float16 (auto: bf16 where the platform runs it fast, else fp32).
    dtype: str = "float32"
    # attn_implementation for transformers (sdpa, eager, flash_attention_2).
    attn_implementation: str = "sdpa"
    # Passed to transformers' from_pretrained.
    trust_remote_code: bool = False
    # Worker processes (data-parallel replicas), one device each.
    world_size: int = 1
    # Devices on Ray: null follows cluster.placement | colocated: time-share the trainer's devices |
    # disaggregated: devices of its own.
    placement: str | None = None
    # Keep the weights in host memory between scoring calls (device memory is the trainer's meanwhile); null: on
    # when colocated on an accelerator.
    offload: bool | None = None
    # Normalisation of the model's scores: none | batch (z-score within each batch) | running (z-score by the
    # running mean and std of every score seen so far; kept in checkpoints). Evaluation, with batch or running, is
    # z-scored by the running statistics of the training scores (never by the eval batch's own).
    normalize: str = "none"
    # replace: the row's score is the (normalised) reward-model score | add: task score + weight x that score.
    mode: str = "replace"
    # Weight of the reward-model score in mode=add.
    weight: float = 1.0
    # Added to the variance before the square root of the z-score.
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check("name", self.name in NAMES, f"{self.name!r} is not one of {', '.join(NAMES)}")
        if self.name == "hf":
            has_path = self.path not in (None, "", MISSING)
            _check("path", has_path, "reward_model=hf needs the model: reward_model.path=<folder or hub id>")
        _check("normalize", self.normalize in NORMALIZE, f"{self.normalize!r} is not one of {', '.join(NORMALIZE)}")
        _check("mode", self.mode in MODES, f"{self.mode!r} is not one of {', '.join(MODES)}")
        _check("placement", self.placement in PLACEMENTS, f"{self.placement!r} is not null, colocated or disaggregated")
        _check(
            "truncation_side",
            self.truncation_side in TRUNCATION_SIDES,
            f"{self.truncation_side!r} is not left or right",
        )
        _check("dtype", self.dtype in DTYPES, f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        _check("batch_size", self.batch_size >= 1, f"{self.batch_size} must be >= 1")
        _check("max_length", self.max_length >= 2, f"{self.max_length} must be >= 2")
        _check("world_size", self.world_size >= 1, f"{self.world_size} must be >= 1")
        _check("weight", math.isfinite(self.weight), f"{self.weight} must be a finite number")
        _check("eps", math.isfinite(self.eps) and self.eps > 0, f"{self.eps} must be > 0")
        # A weight that would silently do nothing is refused rather than ignored.
        _check(
            "weight",
            self.mode == "add" or self.weight == 1.0,
            f"{self.weight} acts only with reward_model.mode=add (replace uses the model's score as is)",
        )
        if self.template != CHAT_TEMPLATE:
            self._check_text_template()

    def _check_text_template(self) -> None:
        # Parsed, not searched: "{{prompt}}" (a literal) contains "{prompt}", and "{prompt.upper}" formats a method.
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as exc:
            fields, bad = [], f"ValueError: {exc}"
        else:
            unknown = [f for f in fields if f not in TEXT_SLOTS]
            bad = f"unknown placeholder {{{unknown[0]}}}" if unknown else ""
            if not bad:
                try:  # (a placeholder nested in a format spec, "{prompt:{width}}", is not parsed above)
                    self.template.format(**dict.fromkeys(TEXT_SLOTS, ""))
                except (KeyError, IndexError, ValueError) as exc:
                    bad = f"{type(exc).__name__}: {exc}"
        if bad:
            raise ValueError(
                f"reward_model.template: {self.template!r} is not a format string with only "
                f"{', '.join('{' + s + '}' for s in TEXT_SLOTS)} ({bad}); write a literal brace as {{{{ or }}}}"
            )
        _check("template", "response" in fields, f"{self.template!r} has no {{response}} (or use 'chat')")
        _check(
            "template",
            "prompt" in fields or "conversation" in fields,
            f"{self.template!r} has neither {{prompt}} nor {{conversation}} (or use 'chat')",
        )

    @property
    def enabled(self) -> bool:
        """Whether a reward model scores rows."""
        return self.name != "none"
