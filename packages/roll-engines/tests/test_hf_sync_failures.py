"""A weight sync into the hf inference engine that fails part way (a name the model lacks, a wrong shape, a sender
whose stream broke, one that died between buckets) leaves the engine on its complete old weights: the same tokens
and log-probs as before it, the same weight version, and requests paused by it resume as if it never happened.
Before, the buckets written before the failure stayed: the engine served a half-new model, and said it was new."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from roll_core.interfaces import Request, SamplingParams
from roll_engines.infer._sync_undo import SyncUndo
from roll_engines.infer.hf import HFInferEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)


@pytest.fixture(scope="module")
def shared(tiny: str) -> Iterator[tuple[HFInferEngine, dict[str, Tensor]]]:
    engine = HFInferEngine(tiny)
    original = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    yield engine, original
    engine.shutdown()


@pytest.fixture
def engine(shared: tuple[HFInferEngine, dict[str, Tensor]]) -> HFInferEngine:
    """The module's engine, on the checkpoint's weights again (a test that failed may have left others)."""
    engine, original = shared
    engine.wake_up()
    engine.load_weights(original)
    return engine


def _changed(original: dict[str, Tensor], seed: int = 0) -> list[tuple[str, Tensor]]:
    """Every weight moved: any of them left behind shows in the outputs."""
    gen = torch.Generator().manual_seed(seed)
    return [(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in original.items()]


def _outputs(engine: HFInferEngine) -> tuple[Tensor, Tensor]:
    out = engine.generate(PROMPTS, SAMPLED)
    return out.responses, out.logprobs


def _assert_same(got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor]) -> None:
    assert torch.equal(got[0], want[0]), f"tokens {got[0].tolist()} vs {want[0].tolist()}"
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def _broken_stream(named: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    yield from named
    raise ConnectionError("the sender died")


def _failing_bucket(kind: str, named: list[tuple[str, Tensor]]) -> object:
    """A bucket that writes some tensors, then fails the way `kind` says."""
    if kind == "unknown-name":
        return [*named, ("model.no_such_layer.weight", torch.zeros(3))]
    if kind == "wrong-shape":
        name, value = named[-1]
        return [*named[:-1], (name, value[:1])]
    return _broken_stream(named)


@pytest.mark.parametrize("kind", ["unknown-name", "wrong-shape", "broken-stream"])
def test_a_sync_failing_part_way_leaves_the_old_weights_and_version(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]], kind: str
) -> None:
    original = shared[1]
    before, version = _outputs(engine), engine.weight_version
    changed = _changed(original)
    half = len(changed) // 2
    engine.begin_weight_update()
    try:
        assert engine.update_weights(changed[:half]) > 0  # a whole bucket lands...
        with pytest.raises((KeyError, ValueError, ConnectionError)):
            engine.update_weights(_failing_bucket(kind, changed[half:-2]))  # ...then the next one fails inside
    finally:
        finished = engine.finish_weight_update()
    mixed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, original[k])]
    assert mixed == [], "these weights kept values of the failed sync"
    _assert_same(_outputs(engine), before)
    assert finished == engine.weight_version == version  # the sync did not happen: no new version
    # The engine is not stuck: the next sync goes through.
    engine.load_weights(dict(changed))
    assert engine.weight_version == version + 1
    assert not torch.equal(_outputs(engine)[1], before[1])


def test_a_sync_whose_sender_died_between_buckets_is_aborted_back_to_the_old_weights(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]]
) -> None:
    """The engine cannot see a failure between two buckets (the transport raises to the sync's caller):
    `abort_weight_update` ends the sync and undoes what its buckets wrote."""
    before, version = _outputs(engine), engine.weight_version
    changed = _changed(shared[1], seed=1)
    engine.begin_weight_update()
    engine.update_weights(changed[:5])
    engine.update_weights(changed[5:9])
    assert engine.abort_weight_update("the sender died") == version
    assert engine.weight_version == version
    _assert_same(_outputs(engine), before)
    # With no sync open there is nothing to undo, and still nothing to count.
    assert engine.abort_weight_update() == version
    _assert_same(_outputs(engine), before)


def test_later_buckets_of_a_failed_sync_are_refused(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]]
) -> None:
    """A caller that goes on after a bucket failed must not patch new weights onto the restored old ones."""
    before = _outputs(engine)
    changed = _changed(shared[1], seed=2)
    engine.begin_weight_update()
    try:
        engine.update_weights(changed[:4])
        with pytest.raises(KeyError):
            engine.update_weights([("model.no_such_layer.weight", torch.zeros(3))])
        with pytest.raises(RuntimeError, match="already failed"):
            engine.update_weights(changed[4:])
    finally:
        engine.finish_weight_update()
    _assert_same(_outputs(engine), before)


def test_a_request_paused_across_a_failed_sync_samples_what_it_would_have_without_it(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]]
) -> None:
    """A request running when the sync began resumes on the old weights: its tokens and log-probs are those of the
    same seeded request run undisturbed, and it reports the version it was sampled under."""
    params = SamplingParams(temperature=1.0, max_new_tokens=100, ignore_eos=True, seed=11)
    alone = engine.submit(Request("alone", [5, 6, 7], params)).result(timeout=120)
    version = engine.weight_version
    fut = engine.submit(Request("crossing", [5, 6, 7], params))
    deadline = time.monotonic() + 60
    while not any(s.request.request_id == "crossing" and s.tokens for s in engine.batcher.running):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.002)
    engine.begin_weight_update()
    try:
        assert not fut.done(), "the request finished before the sync (a very slow machine): nothing crossed it"
        changed = _changed(shared[1], seed=3)
        engine.update_weights(changed[:10])
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights([(changed[10][0], torch.zeros(1))])
    finally:
        engine.finish_weight_update()
    crossed = fut.result(timeout=120)
    assert crossed.token_ids == alone.token_ids
    assert crossed.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert crossed.weight_version == version


DISCARDED = r"refusing to generate: its weights were discarded by sleep\(level=2\); a weight sync that sends every"


def test_a_failed_sync_into_discarded_weights_refuses_to_generate_until_a_sync_succeeds(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]]
) -> None:
    """After sleep(level=2) there are no old weights to go back to: a failed sync leaves generating refused with an
    error saying the weights were discarded (it served the half-written, half-NaN model), and the next whole sync
    serves again."""
    original = shared[1]
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before, version = engine.generate(PROMPTS, greedy).responses, engine.weight_version
    engine.sleep(level=2)
    engine.wake_up()
    engine.begin_weight_update()
    try:
        engine.update_weights(list(original.items())[:8])
        with pytest.raises(KeyError):
            engine.update_weights([("model.no_such_layer.weight", torch.zeros(3))])
    finally:
        assert engine.finish_weight_update() == version
    with pytest.raises(RuntimeError, match=DISCARDED):
        engine.generate(PROMPTS, greedy)
    engine.load_weights(original)
    assert torch.equal(engine.generate(PROMPTS, greedy).responses, before)


def test_after_sleep_level_2_only_syncs_that_rewrote_every_weight_serve(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]], tiny: str
) -> None:
    """sleep(level=2) discards every parameter (NaN after `wake_up`): generating is refused until syncs that complete
    have rewritten all of them. A sync of one tensor (a changed-only sync) used to lift the refusal and serve the
    NaN rest; a failed sync lifts nothing; the full sync then serves what a fresh engine given those weights serves."""
    changed = _changed(shared[1], seed=5)
    n_params = len(list(engine.model.parameters()))
    assert n_params == len(changed) > 2  # every state-dict entry is a parameter of its own (untied tiny Llama)
    version = engine.weight_version
    engine.sleep(level=2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match=rf"{DISCARDED}.*\({n_params} still to be rewritten\)"):
        engine.generate(PROMPTS, SAMPLED)
    with pytest.raises(RuntimeError, match=DISCARDED):
        engine.submit(Request("early", [5, 6, 7], SAMPLED))
    assert engine.load_weights(dict(changed[:1])) > 0  # completes: a new version, still n - 1 weights of NaN
    assert engine.weight_version == version + 1
    with pytest.raises(RuntimeError, match=rf"{DISCARDED}.*\({n_params - 1} still to be rewritten\)"):
        engine.generate(PROMPTS, SAMPLED)
    engine.begin_weight_update()
    try:  # writes every other weight, then fails: its writes lift nothing
        with pytest.raises(KeyError):
            engine.update_weights([*changed[1:], ("model.no_such_layer.weight", torch.zeros(3))])
    finally:
        assert engine.finish_weight_update() == version + 1
    with pytest.raises(RuntimeError, match=rf"{DISCARDED}.*\({n_params - 1} still to be rewritten\)"):
        engine.generate(PROMPTS, SAMPLED)
    engine.load_weights(dict(changed))
    assert engine.weight_version == version + 2
    fresh = HFInferEngine(tiny)
    try:
        fresh.load_weights(dict(changed))
        _assert_same(_outputs(engine), _outputs(fresh))
    finally:
        fresh.shutdown()


def test_a_tensor_written_under_two_names_gets_its_value_from_before_the_sync() -> None:
    """Tied weights (an embedding that is also the output layer) reach one tensor under two names: the second
    write must not make the undo keep the first write's value."""
    tied = torch.arange(6.0).reshape(2, 3)
    undo = SyncUndo(keep=True)
    for value in (10.0, 20.0):  # "model.embed_tokens.weight", then "lm_head.weight"
        undo.save(tied)
        tied.fill_(value)
    assert undo.undo() == 1 and undo.written == 2  # one copy held, of the value from before the sync
    assert torch.equal(tied, torch.arange(6.0).reshape(2, 3))


class _LostCopy:
    """A tensor whose copy back fails (the device or host memory gave out during the undo)."""

    def copy_(self, _old: Tensor) -> None:
        raise RuntimeError("device lost during the undo")


def test_a_failed_sync_whose_undo_failed_refuses_to_generate_until_a_full_sync(
    engine: HFInferEngine, shared: tuple[HFInferEngine, dict[str, Tensor]]
) -> None:
    """The undo of a failed sync raises part way: the engine holds a mix of both versions. Every request is refused
    with an error naming the sync (it served the mix, with an error logged once), a sync that rewrites only some
    of the mixed tensors does not lift it, and the next full sync serves exactly what an engine given those weights
    serves."""
    original = shared[1]
    version = engine.weight_version
    changed = _changed(original, seed=4)
    half = len(changed) // 2
    engine.begin_weight_update()
    try:
        engine.update_weights(changed[:half])
        saved = engine._undo._saved  # type: ignore[union-attr]
        k = len(saved) // 2  # the undo restores those after it, then fails: a real mix
        saved[k] = (_LostCopy(), saved[k][1])  # type: ignore[assignment]
        paused = engine.submit(Request("paused", [5, 6, 7], SAMPLED))  # waits for the sync to end
        with pytest.raises(KeyError):
            engine.update_weights([*changed[half:-2], ("model.no_such_layer.weight", torch.zeros(3))])
    finally:
        assert engine.finish_weight_update() == version
    state = engine.model.state_dict()
    assert any(torch.equal(state[k], v) for k, v in changed[: half // 4]), "nothing of the failed sync stayed"
    mixed = rf"mix of two versions since the weight sync to version {version + 1} failed part way .*could not be undone"
    with pytest.raises(RuntimeError, match=mixed):
        paused.result(timeout=120)
    with pytest.raises(RuntimeError, match=mixed):
        engine.generate(PROMPTS, SAMPLED)
    with pytest.raises(RuntimeError, match=mixed):
        engine.submit(Request("later", [5, 6, 7], SAMPLED))
    # A sync that completes but rewrites only one of the mixed tensors leaves the others mixed.
    assert engine.load_weights(dict(changed[:1])) > 0
    assert engine.weight_version == version + 1
    with pytest.raises(RuntimeError, match=rf"{mixed}.*\(\d+ still to be rewritten\)"):
        engine.generate(PROMPTS, SAMPLED)
    # The next full sync makes the weights whole: exactly the new ones, served as a fresh load of them serves them.
    engine.load_weights(dict(changed))
    assert engine.weight_version == version + 2
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in changed)
    healed = _outputs(engine)
    engine.load_weights(original)
    engine.load_weights(dict(changed))
    _assert_same(healed, _outputs(engine))
