"""The hf engine's `update_weights` called outside `begin_weight_update` / `finish_weight_update` (a notebook's or a
test's one-call update) is a sync of its own: no keys and values of the old weights are served afterwards."""

from __future__ import annotations

import torch

from roll_core.interfaces import SamplingParams
from roll_core.interfaces.inference import Request
from roll_engines.infer.hf import HFInferEngine

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def test_an_update_outside_a_sync_drops_the_cached_prefixes_of_the_old_weights(tiny: str) -> None:
    """The next turn of a conversation reused the first turn's cached keys and values computed under the old
    weights (measured: log-prob gaps of ~1 and other tokens than the new model's)."""
    engine = HFInferEngine(tiny)
    fresh = HFInferEngine(tiny, prefix_cache_mb=0)
    try:
        prompt = engine.tokenizer.encode("hello world")
        first = engine.submit(Request("turn-1", prompt, GREEDY)).result(timeout=60)
        assert engine.batcher.prefixes.entries  # the first turn's keys and values are cached
        gen = torch.Generator().manual_seed(0)
        changed = {k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in engine.model.state_dict().items()}
        version = engine.weight_version
        engine.update_weights(changed.items())  # no begin/finish around it
        follow = [*prompt, *first.token_ids, *engine.tokenizer.encode(" again")]
        got = engine.submit(Request("turn-2", follow, GREEDY)).result(timeout=60)
        fresh.load_weights(changed)
        want = fresh.submit(Request("ref", follow, GREEDY)).result(timeout=60)
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
        assert engine.weight_version == version + 1  # it finished a sync: requests say which weights they saw
    finally:
        engine.shutdown()
        fresh.shutdown()
