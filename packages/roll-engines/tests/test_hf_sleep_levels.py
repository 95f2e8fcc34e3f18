"""Sleep levels of the hf inference engine stay what the deepest sleep made them until `wake_up`: a level-1 sleep
after a level-2 one (weights discarded) used to record level 1, so `wake_up` kept the parameters' empty storage
and every later full sync was refused for its shapes ("the inference model's is (0,)"): the engine could never
serve again. A sync that arrives while the weights are discarded is refused saying to wake the engine first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from roll_core.interfaces import SamplingParams
from roll_engines.infer.hf import HFInferEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny: str) -> Iterator[tuple[HFInferEngine, HFInferEngine, dict[str, Tensor]]]:
    """(the engine under test, a never-slept engine, new weights both are given)."""
    engine, fresh = HFInferEngine(tiny), HFInferEngine(tiny)
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in fresh.model.state_dict().items()}
    fresh.load_weights(new)
    yield engine, fresh, new
    engine.shutdown()
    fresh.shutdown()


def test_a_lighter_sleep_after_a_level_2_one_still_wakes_to_fresh_storage(
    engines: tuple[HFInferEngine, HFInferEngine, dict[str, Tensor]],
) -> None:
    engine, fresh, new = engines
    engine.sleep(level=2)
    engine.sleep(level=1)
    engine.wake_up()
    engine.load_weights(new)  # was: ValueError, the sync sent shape (99, 64), the inference model's is (0,)
    got, want = engine.generate(PROMPTS, GREEDY), fresh.generate(PROMPTS, GREEDY)
    assert torch.equal(got.responses, want.responses)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)


def test_a_sync_into_discarded_weights_before_wake_up_says_so(
    engines: tuple[HFInferEngine, HFInferEngine, dict[str, Tensor]],
) -> None:
    engine, fresh, new = engines
    version = engine.weight_version
    engine.sleep(level=2)
    with pytest.raises(RuntimeError, match=r"sleep\(level=2\) discarded the weights; wake_up\(\) before"):
        engine.load_weights(new)
    assert engine.weight_version == version
    engine.wake_up()
    engine.load_weights(new)
    assert torch.equal(engine.generate(PROMPTS, GREEDY).responses, fresh.generate(PROMPTS, GREEDY).responses)


@pytest.mark.cuda
def test_a_level_2_sleep_after_a_level_1_one_wakes_with_buffers_on_the_device(tiny: str) -> None:
    """GPU path (skipped on CPU machines): a level-1 sleep moves the whole model, buffers included, to the host; the
    level-2 wake-up rebuilt the parameters on the device only, leaving the buffers (rotary tables) on the host: the
    next generate failed mixing devices."""
    engine, fresh = HFInferEngine(tiny, device="cuda"), HFInferEngine(tiny, device="cuda")
    try:
        new = {k: v + 0.01 for k, v in fresh.model.state_dict().items()}
        fresh.load_weights(new)
        engine.sleep(level=1)
        engine.sleep(level=2)
        engine.wake_up()
        engine.load_weights(new)
        assert all(b.device.type == "cuda" for b in engine.model.buffers())
        assert torch.equal(engine.generate(PROMPTS, GREEDY).responses, fresh.generate(PROMPTS, GREEDY).responses)
    finally:
        engine.shutdown()
        fresh.shutdown()
