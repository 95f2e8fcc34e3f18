"""Prompt samplers over several epochs: an interrupted and resumed sampler draws exactly the prompts of an
uninterrupted one (whatever sizes the draws have: dynamic-sampling refills, one at a time), each epoch is one
permutation, a state of the other kind of sampler is a ConfigError, data/epoch counts only domains that are drawn,
and the data fingerprint tells chat rows apart by their context."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.data import DomainSampler, PromptSampler, data_fingerprint, make_sampler
from roll_core.errors import ConfigError

SLICES = {"math": range(0, 7), "code": range(7, 10), "chat": range(10, 21)}
MIXTURES = (
    {"weights": {}, "counts": {"math": 3, "code": 1, "chat": 2}},
    {"weights": {"math": 0.5, "code": 0.2, "chat": 0.3}, "counts": {}},
)


def _draw_sizes(seed: int, n: int) -> list[int]:
    """Batches, refills of a few prompts and single prompts, as the collectors draw them."""
    r = random.Random(seed)
    return [r.choice([6, 6, 6, 1, 2, 5, 13]) for _ in range(n)]


def _new(kind: str, **mix: dict) -> PromptSampler | DomainSampler:
    if kind == "one":
        return PromptSampler(7, seed=11, window=6)
    return DomainSampler(SLICES, batch_size=6, seed=11, **mix)


@pytest.mark.parametrize("kind", ["one", "counts", "weights"])
@pytest.mark.parametrize("cut", [1, 4, 9, 23])
def test_a_resumed_sampler_draws_the_uninterrupted_runs_prompts(kind: str, cut: int) -> None:
    mix = {} if kind == "one" else MIXTURES[kind == "weights"]
    sizes = _draw_sizes(cut, 40)
    whole = _new(kind, **mix)
    expected = [whole.next(k) for k in sizes]
    first = _new(kind, **mix)
    before = [first.next(k) for k in sizes[:cut]]
    resumed = _new(kind, **mix)
    resumed.load_state_dict(first.state_dict())
    assert before + [resumed.next(k) for k in sizes[cut:]] == expected
    assert first.state_dict() != _new(kind, **mix).state_dict()  # (the cut is past the start)


def test_every_epoch_is_one_permutation_and_reshuffled_by_seed_and_epoch() -> None:
    s = PromptSampler(7, seed=3)
    drawn = [i for k in [3, 5, 6, 1, 6] for i in s.next(k)]  # 21 = three epochs, draws straddling each end
    epochs = [drawn[0:7], drawn[7:14], drawn[14:21]]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    assert drawn == PromptSampler(7, seed=3).next(21)  # however the draws cut it
    assert drawn != PromptSampler(7, seed=4).next(21)


def test_a_multi_domain_state_into_a_single_list_run_is_a_config_error() -> None:
    """A KeyError 'size' said nothing of a run resumed with another env (several domains, then one list)."""
    multi = DomainSampler(SLICES, batch_size=6, seed=0, **MIXTURES[0])
    multi.next(6)
    with pytest.raises(ConfigError, match=r"for domains \['chat', 'code', 'math'\]; this run samples one"):
        PromptSampler(21, seed=0).load_state_dict(multi.state_dict())


@pytest.mark.parametrize(
    "mix",
    [
        {"weights": {"math": 0.5, "code": 0.0, "chat": 0.5}, "counts": {}},
        {"weights": {}, "counts": {"math": 4, "code": 0, "chat": 2}},
    ],
)
def test_data_epoch_leaves_out_a_domain_that_is_never_drawn(mix: dict) -> None:
    """A domain weighted (or counted) 0 is never drawn: data/epoch, the least drawn domain's epochs, was 0 for
    the whole run."""
    s = DomainSampler(SLICES, batch_size=6, seed=0, **mix)
    for _ in range(20):
        s.next(6)
    drawn = [sampler for d, sampler in s.samplers.items() if d != "code"]
    assert s.samplers["code"].progress() == 0.0
    assert s.progress() == min(x.progress() for x in drawn) > 1.0


def _row(prompt: str, system: str | None) -> SimpleNamespace:
    context = ({"role": "system", "content": system},) if system is not None else ()
    return SimpleNamespace(prompt=prompt, answer="a", images=(), context=context)


def test_the_fingerprint_tells_chat_rows_apart_by_their_context() -> None:
    """Chat rows sharing their last user turn ("Continue.") but not their earlier turns: swapped or edited, the
    training list is another, but the fingerprint hashed only prompt and answer and resumed without a word."""
    rows = [_row("Continue.", "You are a pirate."), _row("Continue.", "You are a lawyer.")]
    fp = data_fingerprint(rows)
    assert data_fingerprint([_row("Continue.", "You are a pirate."), _row("Continue.", "You are a lawyer.")]) == fp
    assert data_fingerprint(rows[::-1]) != fp
    assert data_fingerprint([rows[0], _row("Continue.", "You are a judge.")]) != fp
    # A multi-domain row carries its source problem's context.
    wrapped = [SimpleNamespace(prompt=r.prompt, answer=r.answer, source=r) for r in rows]
    assert data_fingerprint(wrapped) != data_fingerprint(wrapped[::-1])
    # Rows without context hash as before (saved text fingerprints still match).
    assert data_fingerprint([_row("q", None)]) == data_fingerprint([SimpleNamespace(prompt="q", answer="a")])


# ---- epoch boundaries inside a batch --------------------------------------------------------------------------


class _Task:
    """A single-list task of `n` prompts (what `make_sampler` builds the RL collectors' sampler from)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def train_set(self) -> list[int]:
        return list(range(self.n))


def _collector(n: int, batch: int, seed: int) -> Any:
    """The RLVR collector's drawing and checkpointing part (`_draw`, `state_dict`, `load_state_dict`) over `n`
    prompts, its sampler built as the collector builds it."""
    from roll_core.pipelines.collectors.prompts import PromptCollector

    c = PromptCollector.__new__(PromptCollector)
    c.train_set, c._replay, c.reward_model = [f"q{i}" for i in range(n)], [], None
    c.sampler = make_sampler(_Task(n), batch_size=batch, seed=seed)
    c.reward_budget = SimpleNamespace(state_dict=dict, load_state_dict=lambda s: None)
    return c


def test_a_batch_straddling_two_epochs_holds_no_prompt_twice() -> None:
    """10 prompts, batches of 4: the third batch ends epoch 0 and starts epoch 1. With seed 3 the shuffles are
    [0 1 7 3 5 6 8 9 4 2] and [2 7 8 0 6 3 5 9 1 4]: the batch was [4 2 2 7], prompt 2 twice (and 2 came back
    after one draw). Now epoch 1's order keeps the prompts of epoch 0's last three (9, 4, 2: 3, 2 and 1 draws
    before the boundary) at least 4 draws from their last use: 9 from place 1, 4 from place 2, 2 from place 3;
    each place takes the first prompt of the shuffle allowed there: 7, 8, 0, then 2. Epoch 1 is
    [7 8 0 2 6 3 5 9 1 4]: still a permutation, changed in its first four places only."""
    c = _collector(10, 4, 3)
    assert c.sampler._permutation(0) == [0, 1, 7, 3, 5, 6, 8, 9, 4, 2]
    assert c.sampler._permutation(1) == [2, 7, 8, 0, 6, 3, 5, 9, 1, 4]
    batches = [c._draw(4) for _ in range(5)]
    assert batches == [[0, 1, 7, 3], [5, 6, 8, 9], [4, 2, 7, 8], [0, 2, 6, 3], [5, 9, 1, 4]]
    assert sorted(batches[2][2:] + batches[3] + batches[4]) == list(range(10))  # epoch 1: every prompt once
    # Resumed from the checkpoint's JSON after the third batch (epoch 1, position 2): the moved start of epoch 1
    # comes with the state, so the next batch is [0 2 6 3] as in the whole run ([8 0 6 3], from the seed's
    # shuffle of epoch 1 rebuilt alone, would skip 2 and repeat 8).
    cut = _collector(10, 4, 3)
    for _ in range(3):
        cut._draw(4)
    state = json.loads(json.dumps(cut.state_dict()))
    assert state["sampler"] == {"epoch": 1, "position": 2, "size": 10, "seed": 3, "window": 4, "head": [7, 8, 0, 2]}
    resumed = _collector(10, 4, 3)
    resumed.load_state_dict(state)
    assert [resumed._draw(4) for _ in range(22)] == batches[3:] + [c._draw(4) for _ in range(20)]


def test_a_training_set_smaller_than_a_batch_gives_every_prompt_in_every_batch() -> None:
    """3 prompts, batches of 4 (seed 0; shuffles [2 0 1], [1 2 0], [0 2 1]): the batches were [2 0 1 1] and
    [2 0 0 2], prompt 1 missing from the second and twice in the first. Any 3 in a row are now distinct, so epoch
    1 must keep 0 from place 1 and 1 from place 2 on: [2 0 1] again, and so on; every batch holds all three and
    one of them again, in turn (each prompt 4 times in 3 batches)."""
    s = make_sampler(_Task(3), batch_size=4, seed=0)
    assert [s._permutation(e) for e in range(3)] == [[2, 0, 1], [1, 2, 0], [0, 2, 1]]
    assert [s.next(4) for _ in range(3)] == [[2, 0, 1, 2], [0, 1, 2, 0], [1, 2, 0, 1]]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 9, 10, 11, 16, 40])
@pytest.mark.parametrize("window", [1, 2, 4, 8])
def test_every_epoch_once_and_any_window_in_a_row_distinct_however_drawn(size: int, window: int) -> None:
    """The contract for any training set and batch size, with draws cut at random (batches, refills, one at a
    time): each epoch a permutation, any min(window, size) prompts in a row distinct, the same stream however the
    draws cut it and after a resume at any draw."""
    for seed in range(6):
        r = random.Random(seed)
        sizes = [r.choice([window, window, 1, 2, 3, 7]) for _ in range(30)]
        whole = PromptSampler(size, seed=seed, window=window)
        draws = [whole.next(k) for k in sizes]
        stream = [i for d in draws for i in d]
        epochs = len(stream) // size
        assert all(sorted(stream[e * size : (e + 1) * size]) == list(range(size)) for e in range(epochs))
        w = min(window, size)
        assert all(len(set(stream[i : i + w])) == w for i in range(len(stream) - w + 1))
        assert stream == PromptSampler(size, seed=seed, window=window).next(len(stream))
        cut = r.randrange(1, len(sizes))
        first = PromptSampler(size, seed=seed, window=window)
        for k in sizes[:cut]:
            first.next(k)
        resumed = PromptSampler(size, seed=seed, window=window)
        resumed.load_state_dict(first.state_dict())
        assert [resumed.next(k) for k in sizes[cut:]] == draws[cut:]


@pytest.mark.parametrize("mix", MIXTURES)
def test_a_multi_domain_batch_straddling_a_domains_epochs_holds_no_prompt_twice(mix: dict) -> None:
    """Every domain's prompts in a batch are consecutive draws of its own sampler (at most its count, or the
    whole batch for weights): none repeats inside a batch while a domain has at least that many prompts."""
    slices = {"math": range(0, 7), "code": range(7, 13), "chat": range(13, 24)}
    for seed in range(20):
        s = DomainSampler(slices, batch_size=6, seed=seed, **mix)
        batches = [s.next(6) for _ in range(30)]
        assert all(len(set(b)) == 6 for b in batches), seed


def test_an_older_checkpoint_continues_its_epoch_in_the_order_it_was_saved_with() -> None:
    """A state without `head` (saved by a roll before the seam rule) means the seed's shuffle of its epoch: the
    resumed run finishes that epoch as the saved run would have, and applies the rule from the next boundary."""
    old = {"epoch": 1, "position": 2, "size": 10, "seed": 3}  # epoch 1 as the old roll drew it: [2 7 | 8 0 ...]
    s = PromptSampler(10, seed=3, window=4)
    s.load_state_dict(old)
    rest = s.next(8)
    assert rest == [8, 0, 6, 3, 5, 9, 1, 4]
    nxt = s.next(3)  # epoch 2's shuffle [5 8 2 0 ...]: 1 and 4 ended epoch 1, far enough from places 0-2
    assert nxt == [5, 8, 2] and s.state_dict()["epoch"] == 2
    s = PromptSampler(10, seed=3, window=4)
    with pytest.raises(ConfigError, match="no reordering of that epoch's shuffle"):
        s.load_state_dict({**old, "head": [7, 7, 0, 2]})


def test_a_resume_with_another_batch_size_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """pipeline.rollout_batch_size 4 -> 8 on resume: the window of distinct prompts changed (the stream is then
    neither run's) and nothing said so; the multi-domain sampler logs it (test_domain_sampler.py). The position
    itself resumes exactly; the same size, a size the training set caps to the same window and a checkpoint
    saved without `window` (an older roll) load quietly."""
    saved = PromptSampler(10, seed=3, window=4)
    saved.next(6)
    state = json.loads(json.dumps(saved.state_dict()))
    assert state["window"] == 4
    wider = PromptSampler(10, seed=3, window=8)
    with caplog.at_level("INFO", logger="roll_core.data"):
        wider.load_state_dict(state)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "roll_core.data"]
    assert "pipeline.rollout_batch_size=8 (the checkpoint's was 4)" in line and "any 8 drawn in a row" in line
    assert wider.next(4) == saved.next(4)  # the saved epoch goes on in its order
    caplog.clear()
    older = {k: v for k, v in state.items() if k != "window"}
    small = PromptSampler(3, seed=3, window=4)
    small.next(2)
    with caplog.at_level("INFO", logger="roll_core.data"):
        PromptSampler(10, seed=3, window=4).load_state_dict(state)
        PromptSampler(10, seed=3, window=8).load_state_dict(older)
        PromptSampler(3, seed=3, window=8).load_state_dict(small.state_dict())  # 3 prompts: a window of 3 both
    assert not [r for r in caplog.records if r.name == "roll_core.data"]
