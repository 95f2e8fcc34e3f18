"""A model's own generation settings (`model.generation`, `model.stop_tokens`, `model.chat_template_kwargs`): what a
model preset states from its family's model card, and how they reach sampling and prompts.

Contract:
- `GenerationConfig` holds the family's published sampling defaults. The infer engines' YAML (roll_engines'
  `conf/infer_engine/*.yaml`) default `infer_engine.temperature/top_p/top_k` to these through interpolation, so a
  preset's values apply unless the run sets `infer_engine.*` itself (a command-line or experiment value wins).
  The schema defaults (1.0, 1.0, 0) sample the model's full distribution, as roll did before presets.
- `stop_token_ids(tokenizer, names)` turns `model.stop_tokens` (token strings such as `<|eot_id|>`) into ids for
  `SamplingParams.stop_token_ids`, so every infer engine stops on them even when the checkpoint's generation config
  lists only its eos. A name that is not exactly one token of the tokenizer is an error (a stop string split into
  several tokens would never match one sampled id: generation would run to the length limit silently).
- `model.chat_template_kwargs` go to every chat-template rendering of the policy's prompts (e.g.
  `{enable_thinking: false}` for Qwen3); roll templates prompts itself and sends token ids to the engines.
Imports nothing heavy: configs compose without torch or transformers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class GenerationConfig:
    """Sampling defaults published for a model (its model card or generation_config.json)."""

    # Softmax temperature (>= 1e-5, GREEDY_TEMPERATURE: RL rollouts sample, and the trainer's log-probs divide by it).
    temperature: float = 1.0
    # Nucleus sampling mass; 1 disables.
    top_p: float = 1.0
    # Top-k sampling; 0 disables.
    top_k: int = 0

    def __post_init__(self) -> None:
        from roll_core.interfaces.inference import GREEDY_TEMPERATURE

        # It defaults infer_engine.temperature, the trainer's divisor: below GREEDY_TEMPERATURE engines are greedy.
        if not (math.isfinite(self.temperature) and self.temperature >= GREEDY_TEMPERATURE):
            raise ValueError(
                f"model.generation.temperature={self.temperature} must be > 0, at least {GREEDY_TEMPERATURE} (below it "
                "engines decode greedily, while the trainer divides logits by it)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"model.generation.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"model.generation.top_k={self.top_k} must be >= 0 (0 disables)")


def check_stop_tokens(names: Sequence[str]) -> None:
    """Config-time checks of `model.stop_tokens` (the tokenizer checks the rest when the run starts)."""
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"model.stop_tokens: {name!r} is not a token string such as '<|eot_id|>'")


def stop_token_ids(tokenizer: Any, names: Sequence[str]) -> tuple[int, ...]:
    """The ids of `names` in `tokenizer`, each one token of its vocabulary (added special tokens included).

    Raises:
        ConfigError: a name the tokenizer does not hold as a single token (it names the tokenizer's specials); a
            ValueError, shown by the CLIs as one line (a preset of another model family, `model=gemma3` on a
            Qwen checkpoint, was a traceback).
    """
    from roll_core.errors import ConfigError

    vocab = tokenizer.get_vocab()
    ids = []
    for name in names:
        if name not in vocab:
            specials = ", ".join(getattr(tokenizer, "all_special_tokens", [])[:12])
            raise ConfigError(
                f"model.stop_tokens: {name!r} is not a token of the tokenizer at {tokenizer.name_or_path!r} (its "
                f"special tokens: {specials}): a stop token must be one token; set model.stop_tokens to the "
                "model's own end-of-turn token or use infer_engine.stop for strings"
            )
        ids.append(int(vocab[name]))
    return tuple(dict.fromkeys(ids))
