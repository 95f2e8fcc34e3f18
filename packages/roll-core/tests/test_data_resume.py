"""Prompt samplers over several epochs: an interrupted and resumed sampler draws exactly the prompts of an
uninterrupted one (whatever sizes the draws have: dynamic-sampling refills, one at a time), each epoch is one
permutation, a state of the other kind of sampler is a ConfigError, data/epoch counts only domains that are drawn,
and the data fingerprint tells chat rows apart by their context."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from roll_core.data import DomainSampler, PromptSampler, data_fingerprint
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
        return PromptSampler(7, seed=11)
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
