"""DomainSampler: fixed per-batch counts hold for any run of batch_size draws, weights give their shares, and a
resumed sampler continues exactly."""

from __future__ import annotations

import pytest

from roll_core.data import DomainSampler, PromptSampler, make_sampler
from roll_core.errors import ConfigError

SLICES = {"math": range(0, 50), "code": range(50, 60), "ifeval": range(60, 90)}


def _domain(i: int) -> str:
    return next(d for d, r in SLICES.items() if i in r)


def _counts(indices: list[int]) -> dict[str, int]:
    return {d: sum(_domain(i) == d for i in indices) for d in SLICES}


def test_counts_hold_for_every_batch_however_it_is_drawn() -> None:
    counts = {"math": 4, "code": 1, "ifeval": 3}
    s = DomainSampler(SLICES, weights={}, counts=counts, batch_size=8, seed=3)
    assert _counts(s.next(8)) == counts
    # A refill of 3 then 5 (8 slots in a row), a whole batch, one prompt at a time (the asynchronous collector):
    # every 8 consecutive slots hold exactly the counts, however the draws cut them.
    assert _counts(s.next(3) + s.next(5)) == counts
    assert _counts(s.next(8)) == counts
    assert _counts([s.next(1)[0] for _ in range(8)]) == counts
    assert _counts(s.next(2) + s.next(6)) == counts
    # Within a domain, an epoch is a permutation of that domain's slice.
    many = DomainSampler(SLICES, weights={}, counts=counts, batch_size=8, seed=0).next(80)
    code = [i for i in many if i in SLICES["code"]]
    assert sorted(code) == list(SLICES["code"])


def test_weights_give_their_shares_and_zero_weight_never_draws() -> None:
    s = DomainSampler(SLICES, weights={"math": 0.6, "code": 0.0, "ifeval": 0.4}, counts={}, batch_size=8, seed=1)
    drawn = [i for _ in range(250) for i in s.next(8)]
    c = _counts(drawn)
    assert c["code"] == 0
    assert abs(c["math"] / len(drawn) - 0.6) < 0.03, c


def test_resumed_sampler_continues_exactly() -> None:
    mixtures = (
        {"weights": {}, "counts": {"math": 2, "code": 1, "ifeval": 1}},
        {"weights": {"math": 1.0, "code": 1.0, "ifeval": 2.0}, "counts": {}},
    )
    for kw in mixtures:
        a = DomainSampler(SLICES, batch_size=4, seed=7, **kw)
        a.next(4), a.next(3)
        b = DomainSampler(SLICES, batch_size=4, seed=7, **kw)
        b.load_state_dict(a.state_dict())
        assert [b.next(4) for _ in range(20)] == [a.next(4) for _ in range(20)]


def test_bad_mixtures_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"sums to 5; it must equal pipeline\.rollout_batch_size=8"):
        DomainSampler(SLICES, weights={}, counts={"math": 3, "code": 1, "ifeval": 1}, batch_size=8)
    with pytest.raises(ValueError, match="exactly one"):
        DomainSampler(SLICES, weights={"math": 1.0}, counts={"math": 8}, batch_size=8)
    s = DomainSampler(SLICES, weights={"math": 1.0}, counts={}, batch_size=8)
    with pytest.raises(ValueError, match="single-domain run"):
        s.load_state_dict(PromptSampler(10).state_dict())


def test_make_sampler_picks_by_task() -> None:
    class One:
        def train_set(self) -> list[int]:
            return list(range(5))

    class Many(One):
        def domain_slices(self) -> dict[str, range]:
            return {"a": range(0, 2), "b": range(2, 5)}

        def mixture(self) -> tuple[dict[str, float], dict[str, int]]:
            return {}, {"a": 1, "b": 1}

    assert isinstance(make_sampler(One(), batch_size=2, seed=0), PromptSampler)
    many = make_sampler(Many(), batch_size=2, seed=0)
    assert isinstance(many, DomainSampler) and sorted(_i < 2 for _i in many.next(2)) == [False, True]


def test_a_training_set_smaller_than_a_batch_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Three prompts and batches of four: every batch repeats one, which nothing said."""

    class Small:
        def train_set(self) -> list[int]:
            return list(range(3))

    class Domains(Small):
        def domain_slices(self) -> dict[str, range]:
            return {"a": range(0, 1), "b": range(1, 3)}

        def mixture(self) -> tuple[dict[str, float], dict[str, int]]:
            return {}, {"a": 2, "b": 2}

    with caplog.at_level("WARNING", logger="roll_core.data"):
        sampler = make_sampler(Small(), batch_size=4, seed=0)
    assert "3 prompt(s), fewer than pipeline.rollout_batch_size=4" in caplog.text
    assert len(set(sampler.next(4))) == 3  # (what it warns about)
    caplog.clear()
    with caplog.at_level("WARNING", logger="roll_core.data"):
        make_sampler(Domains(), batch_size=4, seed=0)
        make_sampler(Small(), batch_size=3, seed=0)
    assert "domain 'a' has 1 training prompt(s), fewer than its 2 per batch" in caplog.text
    assert "'b'" not in caplog.text and "rollout_batch_size" not in caplog.text


def test_a_domain_smaller_than_its_weighted_share_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Weights 3:1 over batches of 8 expect 6 prompts of 'a' per batch; 'a' has 2, so most batches repeat them.
    Counts mode warned about that; weights mode said nothing."""

    class Weighted:
        def train_set(self) -> list[int]:
            return list(range(12))

        def domain_slices(self) -> dict[str, range]:
            return {"a": range(0, 2), "b": range(2, 12)}

        def mixture(self) -> tuple[dict[str, float], dict[str, int]]:
            return {"a": 3.0, "b": 1.0, "c": 0.0}, {}

    with caplog.at_level("WARNING", logger="roll_core.data"):
        sampler = make_sampler(Weighted(), batch_size=8, seed=0)
    assert "domain 'a' has 2 training prompt(s), fewer than the 6 per batch its weight gives" in caplog.text
    assert "0.75 of pipeline.rollout_batch_size=8" in caplog.text
    assert "'b'" not in caplog.text  # 10 prompts against its expected 2
    batch = sampler.next(8)
    assert sum(i < 2 for i in batch) > 2  # (what it warns about: 'a' drawn more often than it has prompts)
    caplog.clear()
    with caplog.at_level("WARNING", logger="roll_core.data"):
        make_sampler(Weighted(), batch_size=2, seed=0)  # 'a' expects 1.5 of 2: its 2 prompts suffice
    assert "roll_core.data" not in caplog.text and not caplog.records


def test_a_resume_with_the_domains_in_another_order_or_size_names_them() -> None:
    """env.tasks listed in another order on resume (the config check compares the domains, not their order): each
    domain's order is seeded by its place, so its saved seed no longer matched and the error blamed pipeline.seed
    with two seeds the user never set. A domain whose data changed size was "a training set of 10 prompts",
    naming no domain."""
    saved = DomainSampler(SLICES, weights={}, counts={"math": 4, "code": 1, "ifeval": 3}, batch_size=8, seed=5)
    saved.next(8), saved.next(3)
    state = saved.state_dict()
    order = ["ifeval", "math", "code"]
    starts = {"ifeval": 0, "math": 30, "code": 80}
    moved = {d: range(starts[d], starts[d] + len(SLICES[d])) for d in order}
    again = DomainSampler(moved, weights={}, counts={"math": 4, "code": 1, "ifeval": 3}, batch_size=8, seed=5)
    with pytest.raises(ConfigError, match=r"in the order \['math', 'code', 'ifeval'\]; this run has them in the "):
        again.load_state_dict(state)
    grown = dict(SLICES, code=range(50, 62))
    bigger = DomainSampler(grown, weights={}, counts={"math": 4, "code": 1, "ifeval": 3}, batch_size=8, seed=5)
    with pytest.raises(ConfigError, match=r"for 10 training prompts of domain 'code'; this run has 12"):
        bigger.load_state_dict(state)
    # The domains in the saved order and sizes resume exactly, as before.
    same = DomainSampler(SLICES, weights={}, counts={"math": 4, "code": 1, "ifeval": 3}, batch_size=8, seed=5)
    same.load_state_dict(state)
    assert [same.next(8) for _ in range(5)] == [saved.next(8) for _ in range(5)]


def test_counts_not_summing_to_the_batch_size_are_refused_before_any_model_loads() -> None:
    """The check the run makes before it starts the engines (the collector factory's `check`): env.counts summing to
    5 with batches of 8 was refused only when the collector built its sampler, after the engines loaded the model."""
    from types import SimpleNamespace

    from roll_core.pipelines.collectors import prompt_collectors

    class Mixed:
        def __init__(self, counts: dict[str, int]) -> None:
            self.domains, self.counts = list(SLICES), counts

        def train_set(self) -> list[int]:
            return list(range(90))

        def eval_set(self) -> list[int]:
            return list(range(4))

        def domain_slices(self) -> dict[str, range]:
            return dict(SLICES)

        def mixture(self) -> tuple[dict[str, float], dict[str, int]]:
            return {}, dict(self.counts)

    pipeline = SimpleNamespace(rollout_batch_size=8, eval_every=0, eval_size=4, name="rlvr")
    cfg = SimpleNamespace(pipeline=pipeline, env=SimpleNamespace(name="multi"))
    with pytest.raises(ConfigError, match=r"sums to 5; it must equal pipeline\.rollout_batch_size=8"):
        prompt_collectors.check(cfg, Mixed({"math": 3, "code": 1, "ifeval": 1}))
    prompt_collectors.check(cfg, Mixed({"math": 4, "code": 1, "ifeval": 3}))  # summing to 8: accepted


def test_a_resume_with_another_batch_size_is_said_under_weights_and_refused_under_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """pipeline.rollout_batch_size changed on resume: a weights mix went on with the new size (each domain's
    distinctness window) and nothing said so; a counts cycle restarted at its old slot in a cycle of another size."""
    weights = {"math": 2.0, "code": 1.0, "ifeval": 1.0}
    saved = DomainSampler(SLICES, weights=weights, counts={}, batch_size=8, seed=5)
    saved.next(8), saved.next(8)
    state = saved.state_dict()
    wider = DomainSampler(SLICES, weights=weights, counts={}, batch_size=16, seed=5)
    with caplog.at_level("INFO", logger="roll_core.data"):
        wider.load_state_dict(state)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "roll_core.data"]
    assert "pipeline.rollout_batch_size=16 (the checkpoint's was 8)" in line
    assert wider.draws == saved.draws and wider.samplers["math"].position == saved.samplers["math"].position
    caplog.clear()
    with caplog.at_level("INFO", logger="roll_core.data"):  # the same size: nothing to say
        DomainSampler(SLICES, weights=weights, counts={}, batch_size=8, seed=5).load_state_dict(state)
        older = {k: v for k, v in state.items() if k != "batch_size"}  # a checkpoint of before: size not known
        DomainSampler(SLICES, weights=weights, counts={}, batch_size=16, seed=5).load_state_dict(older)
    assert not [r for r in caplog.records if r.name == "roll_core.data"]
    counted = DomainSampler(SLICES, weights={}, counts={"math": 4, "code": 1, "ifeval": 3}, batch_size=8, seed=5)
    counted.next(3)
    doubled = DomainSampler(SLICES, weights={}, counts={"math": 8, "code": 2, "ifeval": 6}, batch_size=16, seed=5)
    refused = r"a cycle of 8 prompts per batch .*resume with pipeline\.rollout_batch_size=8"
    with pytest.raises(ConfigError, match=refused):
        doubled.load_state_dict(counted.state_dict())
