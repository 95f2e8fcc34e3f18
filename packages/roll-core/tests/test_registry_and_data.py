"""Plugin registry, prompt sampler, checkpoint manager, objectives' units: accumulating micro-batches weighted by
them gives the whole batch's loss and gradient."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from roll_algos.losses import AGG_MODES
from roll_core import registry
from roll_core.checkpoint import CheckpointManager
from roll_core.data import PromptSampler
from roll_core.errors import ConfigError
from roll_core.pipelines.objectives import PolicyObjective, ValueObjective, agg_units


def test_registry_lists_and_loads() -> None:
    assert {"grpo", "gae", "rloo"} <= set(registry.available("roll.algorithms"))
    assert "cpu" in registry.available("roll.platforms")
    assert callable(registry.load("roll.algorithms", "grpo"))
    assert registry.load("roll.algorithms", "grpo") is registry.load("roll.algorithms", "grpo")  # cached


def test_a_name_two_distributions_declare_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which entry point won depended on install order: algo.adv_estimator=grpo could run another package's
    estimator, silently. Loading such a name is an error naming both; other names load as before."""
    from importlib.metadata import EntryPoint

    real = registry.entry_points

    def with_a_clash(group: str) -> list[EntryPoint]:
        found = list(real(group=group))
        if group == "roll.algorithms":
            found.append(EntryPoint("grpo", "roll_clash.algorithms:my_grpo", group))
        return found

    monkeypatch.setattr(registry, "entry_points", with_a_clash)
    registry.clear_cache()
    try:
        with pytest.raises(registry.PluginLoadError, match=r"'grpo' in group 'roll.algorithms' is declared by .* and"):
            registry.load("roll.algorithms", "grpo")
        assert callable(registry.load("roll.algorithms", "rloo"))
    finally:
        monkeypatch.undo()
        registry.clear_cache()


@pytest.mark.parametrize(
    ("group", "value", "says"),
    [
        ("roll.trackers", "json:dumps", "loads to a function, not a class (with log, truncate, close)"),
        ("roll.trackers", "collections:OrderedDict", "loads to class OrderedDict, which lacks log, truncate, close"),
        ("roll.rewards", "collections:Counter", "loads to class Counter, which lacks score"),
        ("roll.algorithms", "math:pi", "loads to a float, not a callable"),
    ],
)
def test_an_entry_point_of_the_wrong_kind_is_refused_naming_it(
    group: str, value: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracker entry point naming a function failed at the run's first log with an AttributeError that named no
    plugin; now loading it says which plugin, what it loads to and what the group needs, and the config check (which
    loads `pipeline.trackers`) says it at composition."""
    from importlib.metadata import EntryPoint

    from roll_core.config import ConfigError, compose, to_object
    from roll_core.testing import fill_missing

    real = registry.entry_points

    def with_a_bad_one(group: str) -> list[EntryPoint]:
        found = list(real(group=group))
        return [*found, EntryPoint("bad", value, group)] if group == wanted else found

    wanted = group
    monkeypatch.setattr(registry, "entry_points", with_a_bad_one)
    registry.clear_cache()
    try:
        expected = rf"plugin 'bad' in group '{group}' \({value}\) {re.escape(says)}"
        with pytest.raises(registry.PluginLoadError, match=expected):
            registry.load(group, "bad")
        if group == "roll.trackers":
            cfg = compose(["pipeline.trackers=[jsonl,bad]"])
            fill_missing(cfg)
            with pytest.raises(ConfigError, match=r"pipeline.trackers=\['jsonl', 'bad'\]: plugin 'bad'.*loads to"):
                to_object(cfg)
        good = [n for n in registry.available(group) if n != "bad"]
        assert good and all(registry.load(group, n) is not None for n in good)  # the others still load
    finally:
        monkeypatch.undo()
        registry.clear_cache()


def test_registry_unknown_names() -> None:
    with pytest.raises(registry.PluginNotFoundError, match=r"no plugin 'grop'.*installed: .*grpo.*Did you mean 'grpo'"):
        registry.load("roll.algorithms", "grop")
    with pytest.raises(registry.PluginNotFoundError, match="unknown plugin group"):
        registry.available("roll.nothing")


def test_registry_reports_broken_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    broken = EntryPoint(name="broken", value="roll_no_such_module:Thing", group="roll.envs")
    monkeypatch.setattr(registry, "_entry_points", lambda group: {"broken": broken})
    registry.load.cache_clear()
    with pytest.raises(registry.PluginLoadError, match=r"plugin 'broken' in group 'roll.envs'.*ModuleNotFoundError"):
        registry.load("roll.envs", "broken")
    registry.load.cache_clear()


def test_sampler_epochs_and_resume() -> None:
    a = PromptSampler(5, seed=1)
    first = a.next(3) + a.next(4)  # crosses into epoch 1
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and a.epoch == 1
    b = PromptSampler(5, seed=1)
    b.next(3)
    state = b.state_dict()
    c = PromptSampler(5, seed=1)
    c.load_state_dict(state)
    assert c.next(4) == first[3:]
    with pytest.raises(ConfigError, match="training set of 5 prompts drawn with seed 1; this run has 6 prompts"):
        PromptSampler(6, seed=1).load_state_dict(state)


def test_a_training_set_edited_in_place_is_a_warning_on_resume(caplog: pytest.LogCaptureFixture) -> None:
    """Same number of prompts, other prompts (a data file edited in place): the sampler alone resumed without a
    word and its saved position drew other problems. The checkpoint now holds the training list's fingerprint; a
    resumed run with another list says so, and one with the same list says nothing."""
    import logging
    from types import SimpleNamespace

    from roll_core.data import data_fingerprint
    from roll_core.pipelines.collectors.prompts import PromptCollector

    rows = [SimpleNamespace(prompt=f"q{i}", answer=str(i)) for i in range(5)]
    edited = [*rows[:2], SimpleNamespace(prompt="q2 (fixed)", answer="2"), *rows[3:]]
    assert data_fingerprint(rows) == data_fingerprint(list(rows)) != data_fingerprint(edited)
    assert data_fingerprint(rows) != data_fingerprint(rows[::-1])  # the order is what a position means

    def collector(train_set: list) -> PromptCollector:
        c = PromptCollector.__new__(PromptCollector)  # the state-handling part only
        c.train_set, c.sampler, c._replay, c.reward_model = train_set, PromptSampler(5, seed=1), [], None
        c.reward_budget = SimpleNamespace(state_dict=dict, load_state_dict=lambda s: None)
        return c

    saved = collector(rows).state_dict()
    with caplog.at_level(logging.WARNING, logger="roll_core.pipelines.collectors.prompts"):
        collector(list(rows)).load_state_dict(saved)
        assert "differs" not in caplog.text
        collector(edited).load_state_dict(saved)
    assert "the training set differs from the one the checkpoint was saved with" in caplog.text


def test_sampler_progress_counts_epochs_drawn() -> None:
    """`data/epoch` of the RLVR collectors: epochs of the training set drawn, fractional; with domains the least
    drawn domain's; through the lock the same."""
    from roll_core.data import DomainSampler, LockedSampler

    s = PromptSampler(4, seed=0)
    assert s.progress() == 0.0
    s.next(2)
    assert s.progress() == 0.5
    s.next(4)
    assert s.progress() == 1.5 and LockedSampler(s).progress() == 1.5
    d = DomainSampler({"a": range(0, 4), "b": range(4, 12)}, weights={}, counts={"a": 2, "b": 2}, batch_size=4)
    d.next(8)  # 4 of a (one epoch), 4 of b (half of one)
    assert d.progress() == 0.5


def test_locked_sampler_never_lets_a_state_read_see_half_a_draw() -> None:
    """The asynchronous collector draws on its driver thread while the trainer saves the sampler's state: a state
    read during a draw waits for it (a torn read resumed a run an epoch late)."""
    import threading

    from roll_core.data import LockedSampler

    mid_draw, release = threading.Event(), threading.Event()

    class TwoFieldSampler:
        epoch, position = 0, 5

        def next(self, k: int) -> list[int]:
            self.epoch += 1
            mid_draw.set()
            release.wait(5)
            self.position = 0
            return [0] * k

        def state_dict(self) -> dict:
            return {"epoch": self.epoch, "position": self.position}

        def load_state_dict(self, state: dict) -> None:
            self.epoch, self.position = state["epoch"], state["position"]

    sampler = LockedSampler(TwoFieldSampler())
    drawer = threading.Thread(target=sampler.next, args=(1,))
    drawer.start()
    assert mid_draw.wait(5)
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.append(sampler.state_dict()))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not seen  # waits for the draw instead of reading half of it
    release.set()
    drawer.join(5)
    reader.join(5)
    assert seen == [{"epoch": 1, "position": 0}]
    real = LockedSampler(PromptSampler(6, seed=1))
    first = real.next(4)
    state = real.state_dict()
    other = LockedSampler(PromptSampler(6, seed=1))
    other.load_state_dict(state)
    assert other.next(5) == real.next(5) and len(set(first)) == 4


def test_checkpoint_manager_atomic_and_pruned(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        tmp = m.staging(step)
        (tmp / "weights").write_text(str(step))
        m.commit(tmp, step, {"sampler": {"epoch": 0}})
    assert [p.name for p in m.list()] == ["step_000002", "step_000003"]
    # an interrupted save leaves a .tmp folder that is never picked
    (m.staging(4) / "weights").write_text("partial")
    assert m.latest().name == "step_000003"
    assert json.loads((m.latest() / "state.json").read_text())["step"] == 3


def test_checkpoint_files_reach_the_disk_before_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file and folder of a checkpoint is fsync'ed before it is renamed into place (a rename can reach the
    disk before the data it names: a power cut would leave a complete-looking folder of empty files)."""
    import os

    synced: list[str] = []
    real_fsync, real_open = os.fsync, os.open
    names: dict[int, str] = {}

    def opening(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        names[fd] = str(path)
        return fd

    def fsync(fd: int) -> None:
        synced.append(names.get(fd, "?"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "fsync", fsync)
    m = CheckpointManager(tmp_path)
    tmp = m.staging(5)
    (tmp / "actor" / "model").mkdir(parents=True)
    (tmp / "actor" / "model" / "model.safetensors").write_bytes(b"weights")
    renamed_after: list[int] = []
    real_rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, t: (renamed_after.append(len(synced)), real_rename(self, t))[1])
    m.commit(tmp, 5, {})
    before = synced[: renamed_after[0]]
    for f in ("actor/model/model.safetensors", "state.json", "rng.pt", "actor/model", "actor", ""):
        assert str(tmp / f).rstrip("/") in before, (f, before)
    assert str(m.root) in synced[renamed_after[0] :]  # the rename itself


def test_checkpoint_saved_again_survives_a_crash_between_the_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving a step that exists (a run redoing steps after a rollback) never leaves the step without a checkpoint:
    a crash after the old folder moved aside leaves it findable, and the next save cleans it up."""
    m = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        tmp = m.staging(step)
        (tmp / "weights").write_text(f"old {step}")
        m.commit(tmp, step, {})
    tmp = m.staging(2)
    (tmp / "weights").write_text("new 2")
    real_rename = Path.rename

    def crash_on_second(self: Path, target: Path) -> Path:
        if self.name.endswith(".tmp"):
            raise KeyboardInterrupt("killed between the renames")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        m.commit(tmp, 2, {})
    monkeypatch.setattr(Path, "rename", real_rename)
    assert [p.name for p in m.list()] == ["step_000001", "step_000002.replaced"]
    assert (m.latest() / "weights").read_text() == "old 2"
    tmp = m.staging(2)
    (tmp / "weights").write_text("new 2")
    m.commit(tmp, 2, {})
    assert [p.name for p in m.list()] == ["step_000001", "step_000002"]
    assert (m.latest() / "weights").read_text() == "new 2"
    assert sorted(p.name for p in m.root.iterdir()) == ["step_000001", "step_000002"]


def test_a_prune_killed_halfway_never_leaves_a_listed_checkpoint_without_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pruned folder deleted in place and killed halfway (or with a file NFS keeps busy) kept its state.json: it was
    listed as complete, for the run report and `pipeline.resume_from`, with its weights gone."""
    import shutil

    m = CheckpointManager(tmp_path, keep_last=1)
    tmp = m.staging(1)
    (tmp / "weights").write_text("1")
    m.commit(tmp, 1, {})
    real_rmtree = shutil.rmtree

    def killed_halfway(path, *a, **k) -> None:
        if "step_000001" in str(path):
            (Path(path) / "weights").unlink()
            raise KeyboardInterrupt("killed while pruning")
        real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", killed_halfway)
    tmp = m.staging(2)
    (tmp / "weights").write_text("2")
    with pytest.raises(KeyboardInterrupt):
        m.commit(tmp, 2, {})
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert [p.name for p in m.list()] == ["step_000002"]
    tmp = m.staging(3)
    (tmp / "weights").write_text("3")
    m.commit(tmp, 3, {})  # the next save removes what the killed prune left
    assert sorted(p.name for p in m.root.iterdir()) == ["step_000003"]


def test_units_counted_per_aggregation() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert agg_units(mask, "token-mean") == 3
    assert agg_units(mask, "seq-mean-token-mean") == 2
    assert agg_units(mask, "seq-mean-token-sum") == 3
    assert agg_units(mask, "seq-mean-token-sum-norm") == 3


@pytest.mark.parametrize(
    ("objective", "agg"),
    # The value objective takes no norm_length, so it has no seq-mean-token-sum-norm.
    [("policy", a) for a in AGG_MODES] + [("value", a) for a in AGG_MODES if a != "seq-mean-token-sum-norm"],
)
def test_units_make_accumulation_exact(objective: str, agg: str) -> None:
    """What the engines do (roll_engines.train.hf `_accumulate`): each micro-batch's loss weighted by its units over
    the mini-batch's units. Summed over uneven micro-batches (one with an empty row, one with a row of one token),
    that is the whole mini-batch's loss, and so is its gradient; a plain mean of the micro-batch losses is not."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    b, t = mask.shape
    logits = torch.randn(b, t, 5, generator=gen, requires_grad=True)  # stands in for the model's parameters
    tokens = torch.randint(0, 5, (b, t), generator=gen)
    data = {
        "response_mask": mask.float(),
        "advantages": torch.randn(b, t, generator=gen),
        "old_logprobs": torch.randn(b, t, generator=gen).clamp(max=0) - 1.0,
        "ref_logprobs": torch.randn(b, t, generator=gen).clamp(max=0) - 1.0,
        "values": torch.randn(b, t, generator=gen),
        "returns": torch.randn(b, t, generator=gen),
    }
    if objective == "policy":
        fn = PolicyObjective(agg=agg, norm_length=t, kl_loss_coef=0.1, entropy_coef=0.01)
    else:
        fn = ValueObjective(agg=agg, clip=0.2)

    def loss_of(rows: slice) -> torch.Tensor:
        lp = torch.log_softmax(logits[rows], -1)
        outputs = {
            "logprobs": lp.gather(-1, tokens[rows, :, None])[..., 0],
            "entropy": -(lp.exp() * lp).sum(-1),
            "values": logits[rows, :, 0],
        }
        return fn(outputs, {k: v[rows] for k, v in data.items()})[0]

    whole = loss_of(slice(0, b))
    micros = [slice(0, 3), slice(3, 4), slice(4, 6)]
    total = fn.units(data)
    assert total == sum(fn.units({k: v[m] for k, v in data.items()}) for m in micros)
    accumulated = sum(loss_of(m) * fn.units({k: v[m] for k, v in data.items()}) / total for m in micros)
    torch.testing.assert_close(accumulated, whole, rtol=1e-6, atol=1e-7)
    (g_accumulated,) = torch.autograd.grad(accumulated, logits)
    (g_whole,) = torch.autograd.grad(whole, logits)
    assert g_whole.abs().sum() > 0
    torch.testing.assert_close(g_accumulated, g_whole, rtol=1e-5, atol=1e-7)
    naive = sum(loss_of(m) for m in micros) / len(micros)
    assert not torch.allclose(naive, whole), "the micro-batches are too even to tell weighting apart"


def test_policy_objective_adds_kl_and_entropy() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    micro = {
        "response_mask": torch.ones(1, 2),
        "advantages": torch.ones(1, 2),
        "ref_logprobs": torch.log(torch.tensor([[0.5, 0.5]])),
    }
    base = PolicyObjective()({"logprobs": logp}, micro)[0]
    with_kl, m = PolicyObjective(kl_loss_coef=0.5, kl_kind="k1")({"logprobs": logp}, micro)
    # k1 = [0, ln(0.5)] -> mean -0.3466; loss adds 0.5 * that
    assert float((with_kl - base).detach()) == pytest.approx(
        0.5 * (0 + torch.log(torch.tensor(0.5)).item()) / 2, abs=1e-6
    )
    ent, m = PolicyObjective(entropy_coef=0.1)({"logprobs": logp, "entropy": torch.ones(1, 2)}, micro)
    assert float((ent - base).detach()) == pytest.approx(-0.1) and float(m["actor/entropy"]) == 1.0
