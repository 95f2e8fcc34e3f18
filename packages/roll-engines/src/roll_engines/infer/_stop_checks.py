"""The stop conditions every infer engine refuses before a request is queued (hf, vllm, sglang: one check, one message).

Contract: `check_stops(name, params, vocab)` raises ValueError for
- an empty stop string: vLLM refuses it (SamplingParams._verify_args, "stop cannot contain an empty string", raised
  only as the row reaches it, after the batch's first rows were queued); SGLang matches `stop_str in tail_str`, which
  an empty string always satisfies, so every response ended after its first token; the hf engine dropped it;
- a stop token id that is not an int (a bool included) or lies outside the model's vocabulary [0, vocab): vLLM
  refuses both (non-ints in _verify_args, out-of-vocab ids at add_request, _validate_stop_token_ids); SGLang casts
  with `int()` (2.7 became 2) and an id no logit row holds could never be sampled, so it never stopped anything.
`vocab`: the model's vocabulary size (its logits' width, as vLLM bounds it), or None where it is not known (a check
run before the engine read its model): the upper bound is then not checked, the rest is.
"""

from __future__ import annotations

from roll_core.interfaces import SamplingParams


def check_stops(name: str, params: SamplingParams, vocab: int | None) -> None:
    """Raise ValueError naming engine `name` when `params` holds a stop string or stop token id no engine can honour
    alike (module docstring)."""
    if any(not s for s in params.stop):
        raise ValueError(
            f"{name} engine: stop={list(params.stop)!r} holds an empty string (vLLM refuses it; SGLang would end "
            "every response at its first token)"
        )
    bad = [t for t in params.stop_token_ids if type(t) is not int or t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        where = f"the model's vocabulary [0, {vocab})" if vocab is not None else "a vocabulary (non-negative ints)"
        raise ValueError(
            f"{name} engine: stop_token_ids {bad!r} are not token ids of {where} (vLLM refuses them; none could be "
            "sampled)"
        )
