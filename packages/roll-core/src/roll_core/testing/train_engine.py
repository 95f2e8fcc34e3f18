"""Conformance suite of `roll_core.interfaces.TrainEngine`: every training engine passes it.

Checks on the built-in tiny model, against plain transformers: log-probs of left-padded batches equal a
teacher-forced transformers forward; gradient accumulation over micro-batches is exact; a step with positive
advantages raises the sampled tokens' log-probs; `iter_weights` yields every parameter once under its HF name
with full shapes; a checkpoint written after training loads with plain transformers, and loading it into a fresh
engine restores the trained weights and the optimizer (the next step equals the uninterrupted run's).
Critic role (`role="critic"`): `compute_values` gives finite (B, R) values, each response token's the value of the
state before it (transformers' token classifier with the engine's weights, run on the unpadded row), that padding
after the response (mask 0) does not change, and a value-loss step moves them towards the returns. Base-model log-probs
(`compute_logprobs(..., base=True)`, the reference policy of a LoRA run, `lora_rank=4`): equal to the log-probs
before any training, unchanged by training while the adapted policy moves away from them; an engine without LoRA
refuses `base=True` with a ValueError. Top-k scoring (`compute_logprobs(..., topk=K)`, a distillation teacher's
targets) equals torch.topk of transformers' full log-softmax; a loss declaring `gather_ids_key` receives
`gathered_logprobs`, the log-softmax at its (b, R, K) ids, equal to transformers' and with the same gradients as
that loss computed through transformers (temperature 0.7 throughout). An engine without a critic role or without
LoRA says so on its suite subclass (`no_critic` / `no_lora`: the reason) and those checks skip with it.

roll's tests run it over every installed `roll.train_engines` entry point (packages/roll-engines/tests/
test_train_conformance.py), so an installed out-of-tree engine is checked as well. Engines are built with
`build_conformance_engine(engine_class, model_path, **kwargs)`, where `kwargs` are the suite's `lr`,
`micro_batch_size` and `role`: the class's optional classmethod hook `conformance_engine(model_path, **kwargs)`
when it defines one, else its constructor. The hook returns one small in-process engine (one rank, CPU, fp32) and
may set up what that needs, e.g. a torch.distributed group of one (the suite destroys a group that appeared during
a test)::

    class MyTrainEngine:
        @classmethod
        def conformance_engine(cls, model_path: str, **kwargs: Any) -> MyTrainEngine:
            if not my_backend_available():  # the suite skips the engine with this reason
                raise roll_core.testing.CannotRunHere("my engine needs my backend")
            return cls(model_path, backend="local", **kwargs)

ImportError or `CannotRunHere` from the hook or the constructor skips the engine with the message as the reason.
To run the suite on one engine by hand, subclass it and set `engine_class` (or override `build_engine`)::

    from roll_core.testing.train_engine import TrainEngineTestSuite

    class TestMyTrainEngine(TrainEngineTestSuite):
        engine_class = MyTrainEngine
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from roll_core.interfaces import TrainEngine
from roll_core.testing import CannotRunHere, teacher_forced_logprobs
from roll_core.testing.batches import PROMPTS, toy_batch

__all__ = ["PROMPTS", "GatherLoss", "TrainEngineTestSuite", "build_conformance_engine", "toy_batch"]

#: Temperature of the top-k and gather checks (not 1, so an engine that forgets it fails).
TEMPERATURE = 0.7

#: Name of the optional classmethod hook `(model_path, **kwargs) -> engine` on a train engine class.
HOOK = "conformance_engine"


class GatherLoss:
    """A loss over `gathered_logprobs` (the engine's log-probs at the micro-batch's "teacher_ids" (b, R, K)):
    -sum_k w_k * logp(id_k), averaged over response tokens (a forward-KL distillation loss with weights
    "teacher_w"). Records, per micro-batch, its "row" indices and the gathered log-probs (detached, CPU)."""

    needs_entropy = False
    gather_ids_key = "teacher_ids"

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def units(self, micro: Any) -> float:
        return float(micro["response_mask"].sum())

    def __call__(self, outputs: dict[str, torch.Tensor], micro: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        got = outputs["gathered_logprobs"]
        mask = micro["response_mask"].to(got.device).float()
        real = micro["response_mask"].sum(-1).cpu() > 0  # padding rows (an engine's filler) score nothing
        self.seen.append((micro["row"].cpu()[real], got.detach().cpu()[real]))
        per_token = -(got * micro["teacher_w"].to(got.device)).sum(-1)  # (b, R)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"distill_loss": loss.detach()}


def gather_batch(batch: dict[str, torch.Tensor], k: int = 3, seed: int = 5) -> dict[str, torch.Tensor]:
    """`batch` plus random "teacher_ids" (B, R, k) within the vocabulary of its tokens, weights "teacher_w"
    (B, R, k) and each row's index "row" (B,)."""
    g = torch.Generator().manual_seed(seed)
    b, r = batch["responses"].shape
    vocab = int(batch["input_ids"].max()) + 1
    return {
        **batch,
        "teacher_ids": torch.randint(0, vocab, (b, r, k), generator=g),
        "teacher_w": torch.rand((b, r, k), generator=g),
        "row": torch.arange(b),
    }


def reference_log_softmax(model: Any, batch: dict[str, torch.Tensor], temperature: float) -> list[torch.Tensor]:
    """Per row, log_softmax(logits / temperature) (n_i, V) at the positions predicting its n_i response tokens,
    from a forward of `model` (transformers) on the row's attended prompt and response tokens alone."""
    out = []
    for ids, start, n in _rows_alone(batch):
        logits = model(ids).logits[0, start : start + n].float()
        out.append(torch.log_softmax(logits / temperature, -1))
    return out


def reference_values(model: Any, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per row, the values (n_i,) of its n_i response tokens from `model` (a transformers one-label token
    classifier) run on the row's attended prompt and response tokens alone: token t's value is the score at the
    position before it (the state prompt + response[:t]; the first token's is the prompt's last position's)."""
    return [model(ids).logits[0, start : start + n, 0].float() for ids, start, n in _rows_alone(batch)]


def _rows_alone(batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """Per row: its attended prompt and its n response tokens alone, (1, len) ids, the position predicting (or, for
    values, the state before) the first response token, and n."""
    rows = []
    p = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for i in range(batch["input_ids"].shape[0]):
        prompt = batch["input_ids"][i, :p][batch["attention_mask"][i, :p].bool()]
        n = int(batch["response_mask"][i].sum())
        rows.append((torch.cat([prompt, batch["responses"][i, :n]])[None], len(prompt) - 1, n))
    return rows


def build_conformance_engine(engine_class: type, model_path: str, **kwargs: Any) -> TrainEngine:
    """`engine_class.conformance_engine(model_path, **kwargs)` if the class defines it, else
    `engine_class(model_path, **kwargs)`; skips the calling test when the engine cannot be built here."""
    build = getattr(engine_class, HOOK, engine_class)
    try:
        return build(model_path, **kwargs)
    except (ImportError, CannotRunHere) as exc:
        pytest.skip(f"train engine {engine_class.__qualname__} cannot run here: {type(exc).__name__}: {exc}")


class TrainEngineTestSuite:
    """Shared tests; subclasses set `engine_class` or implement `build_engine`."""

    model: ClassVar[str] = "builtin:tiny"
    #: Tolerance of log-probs against transformers in fp32.
    logprob_atol: ClassVar[float] = 1e-5
    #: The engine under test (built with `build_conformance_engine`).
    engine_class: ClassVar[type | None] = None
    #: Why the engine has no critic role (`compute_values`), or None: the critic checks run.
    no_critic: ClassVar[str | None] = None
    #: Why the engine cannot train LoRA adapters (`lora_rank`, `compute_logprobs(base=True)`), or None.
    no_lora: ClassVar[str | None] = None

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any) -> TrainEngine:
        if cls.engine_class is None:
            raise NotImplementedError("subclasses set engine_class or return an engine for model_path")
        return build_conformance_engine(cls.engine_class, model_path, **kwargs)

    @pytest.fixture(autouse=True)
    def _release_process_group(self):
        """Destroy a torch.distributed group that an engine (or its hook) created during the test."""
        import torch.distributed as dist

        had_group = dist.is_available() and dist.is_initialized()
        yield
        if not had_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        import os

        from roll_core.models import resolve_model_path

        os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
        return resolve_model_path(cls.model)

    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, model_path: str) -> dict[str, torch.Tensor]:
        return toy_batch(model_path)

    @staticmethod
    def _tensors(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(batch)

    def test_satisfies_protocol(self, model_path: str) -> None:
        eng = self.build_engine(model_path, lr=1e-3)
        assert isinstance(eng, TrainEngine)
        assert eng.role == "actor" and eng.dp_size >= 1 and 0 <= eng.dp_rank < eng.dp_size

    def test_logprobs_equal_transformers(self, model_path: str, batch: dict[str, torch.Tensor]) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        eng = self.build_engine(model_path, lr=1e-3, role="reference")
        out = eng.compute_logprobs(self._tensors(batch), temperature=0.7, with_entropy=True)
        mask = batch["response_mask"]
        assert out["logprobs"].shape == out["entropy"].shape == mask.shape
        for i, prompt in enumerate(PROMPTS[j // 2] for j in range(len(mask))):
            n = int(mask[i].sum())
            tokens = batch["responses"][i, :n].tolist()
            ref = teacher_forced_logprobs(model_path, list(tok(prompt)["input_ids"]), tokens, 0.7)
            assert out["logprobs"][i, :n].tolist() == pytest.approx(ref, abs=self.logprob_atol)

    def test_gradient_accumulation_is_exact(self, model_path: str, batch: dict[str, torch.Tensor]) -> None:
        from roll_core.pipelines.objectives import PolicyObjective

        objective = PolicyObjective(agg="token-mean")
        whole = self.build_engine(model_path, lr=1e-3, micro_batch_size=6).compute_gradients(
            self._tensors(batch), objective
        )
        split = self.build_engine(model_path, lr=1e-3, micro_batch_size=4).compute_gradients(
            self._tensors(batch), objective
        )
        assert whole.keys() == split.keys() and any(g.abs().sum() > 0 for g in whole.values())
        for name in whole:
            torch.testing.assert_close(whole[name], split[name], atol=1e-6, rtol=1e-4, msg=name)

    def test_step_follows_the_advantage(self, model_path: str, batch: dict[str, torch.Tensor]) -> None:
        from roll_core.pipelines.objectives import PolicyObjective

        tensors = self._tensors(batch)
        tensors["advantages"] = batch["response_mask"].float()  # every sampled token was good
        eng = self.build_engine(model_path, lr=1e-2, micro_batch_size=2)
        before = eng.compute_logprobs(tensors)["logprobs"]
        metrics = eng.train_step(tensors, PolicyObjective())
        after = eng.compute_logprobs(tensors)["logprobs"]
        m = batch["response_mask"].bool()
        assert metrics["grad_norm"] > 0 and after[m].sum() > before[m].sum()

    def test_a_non_finite_gradient_skips_the_step_and_touches_nothing(
        self, model_path: str, batch: dict[str, torch.Tensor]
    ) -> None:
        """One NaN advantage on a trained token: the step is counted as skipped, no weight changes (Megatron's
        fp32/bf16 optimizer applied the NaN gradient: every weight NaN for good), and the next clean step trains."""
        from roll_core.pipelines.objectives import PolicyObjective

        tensors = self._tensors(batch)
        tensors["advantages"] = batch["response_mask"].float()
        bad = {k: v.clone() for k, v in tensors.items()}
        row, col = (batch["response_mask"] > 0).nonzero()[0].tolist()
        bad["advantages"][row, col] = float("nan")
        eng = self.build_engine(model_path, lr=1e-2, micro_batch_size=2)
        before = {k: v.detach().clone() for k, v in eng.iter_weights()}
        metrics = eng.train_step(bad, PolicyObjective())
        after = dict(eng.iter_weights())
        assert metrics["nonfinite_steps"] == 1.0 and metrics["optimizer_steps"] == 0.0, metrics
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, f"a skipped step changed {changed[:3]}"
        clean = eng.train_step(tensors, PolicyObjective())
        assert clean["optimizer_steps"] >= 1.0 and math.isfinite(clean["grad_norm"])
        assert all(bool(torch.isfinite(v).all()) for _, v in eng.iter_weights())

    def test_iter_weights_are_the_hf_parameters(self, model_path: str) -> None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        expected = {k: tuple(v.shape) for k, v in hf.named_parameters()}
        got = [(k, tuple(v.shape)) for k, v in self.build_engine(model_path, lr=1e-3).iter_weights()]
        names = [k for k, _ in got]
        assert len(names) == len(set(names)), "every tensor once"
        assert {k: s for k, s in got if k in expected} == expected

    def test_checkpoint_round_trip_restores_trained_state(
        self, model_path: str, batch: dict[str, torch.Tensor], tmp_path: Path
    ) -> None:
        from transformers import AutoModelForCausalLM

        from roll_core.pipelines.objectives import PolicyObjective

        tensors, objective = self._tensors(batch), PolicyObjective()
        eng = self.build_engine(model_path, lr=1e-2, micro_batch_size=3)
        eng.train_step(tensors, objective)
        eng.save(tmp_path / "ckpt", model_path)
        trained = {k: v.clone() for k, v in eng.iter_weights()}
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model", dtype=torch.float32)
        for k, v in plain.named_parameters():
            torch.testing.assert_close(v.detach(), trained[k], msg=k)
        fresh = self.build_engine(model_path, lr=1e-2, micro_batch_size=3)
        initial = dict(fresh.iter_weights())
        assert any(not torch.equal(initial[k], trained[k]) for k in trained), "training changed nothing"
        fresh.load(tmp_path / "ckpt")
        for k, v in fresh.iter_weights():
            torch.testing.assert_close(v, trained[k], msg=k)
        # The optimizer state came back too: the next step is the same on both engines.
        eng.train_step(tensors, objective)
        fresh.train_step(tensors, objective)
        a, b = dict(eng.iter_weights()), dict(fresh.iter_weights())
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)

    def test_compute_values_of_a_critic(self, model_path: str) -> None:
        from roll_core.pipelines.objectives import ValueObjective
        from roll_core.testing.batches import critic_batch

        if self.no_critic:
            pytest.skip(f"no critic role: {self.no_critic}")
        batch = critic_batch(model_path)
        mask = batch["response_mask"].bool()
        # lr 1e-3: AdamW's first step moves every weight by ~lr, and at 1e-2 the tiny critic overshoots.
        eng = self.build_engine(model_path, lr=1e-3, micro_batch_size=3, role="critic")
        assert isinstance(eng, TrainEngine) and eng.role == "critic"
        values = eng.compute_values(self._tensors(batch))["values"]
        assert values.shape == mask.shape, f"values {tuple(values.shape)} for a (B, R) = {tuple(mask.shape)} batch"
        assert torch.isfinite(values).all()
        # The value of a response token is read at the state before it: tokens after the response (mask 0)
        # come later in the sequence and must not change it.
        repadded = self._tensors(batch)
        junk = torch.full_like(batch["responses"], 5)
        repadded["responses"] = torch.where(mask, batch["responses"], junk)
        p = batch["input_ids"].shape[1] - mask.shape[1]
        repadded["input_ids"] = batch["input_ids"].clone()
        repadded["input_ids"][:, p:] = repadded["responses"]
        again = eng.compute_values(repadded)["values"]
        torch.testing.assert_close(again[mask], values[mask], atol=1e-5, rtol=1e-4)
        # A value-loss step moves the values towards the returns (the squared error it minimises falls).
        error = ((values - batch["returns"]) ** 2)[mask].mean()
        metrics = eng.train_step(self._tensors(batch), ValueObjective(clip=None))
        after = eng.compute_values(self._tensors(batch))["values"]
        assert metrics["grad_norm"] > 0
        after_error = ((after - batch["returns"]) ** 2)[mask].mean()
        assert after_error < 0.95 * error, f"a value-loss step took the squared error from {error} to {after_error}"

    def test_critic_values_are_the_states_before_each_response_token(self, model_path: str) -> None:
        """Each response token's value is V(prompt + response[:t]), as transformers' token classifier with the
        engine's weights scores it on the unpadded row (the contract GAE reads; a value read one position late,
        V after the token, passes every other critic check)."""
        from transformers import AutoModelForTokenClassification

        from roll_core.testing.batches import critic_batch

        if self.no_critic:
            pytest.skip(f"no critic role: {self.no_critic}")
        batch = critic_batch(model_path)
        mask = batch["response_mask"]
        eng = self.build_engine(model_path, lr=1e-3, micro_batch_size=3, role="critic")
        values = eng.compute_values(self._tensors(batch))["values"]
        ref = AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32).eval()
        ref.load_state_dict(dict(eng.iter_weights()), strict=True)  # the engine's head (new, seeded) and body
        with torch.no_grad():
            want = reference_values(ref, batch)
        assert float(torch.cat(want).std()) > 1e-3, "the values do not differ by token: the check has no teeth"
        for i, w in enumerate(want):
            n = int(mask[i].sum())
            torch.testing.assert_close(values[i, :n].float(), w, atol=self.logprob_atol, rtol=0, msg=f"row {i}")

    def test_base_logprobs_are_the_model_before_its_lora_adapters(
        self, model_path: str, batch: dict[str, torch.Tensor]
    ) -> None:
        from roll_core.pipelines.objectives import PolicyObjective

        if self.no_lora:
            pytest.skip(f"no LoRA: {self.no_lora}")
        plain = self.build_engine(model_path, lr=1e-3, role="reference")
        with pytest.raises(ValueError, match="LoRA"):
            plain.compute_logprobs(self._tensors(batch), base=True)
        reference = plain.compute_logprobs(self._tensors(batch))["logprobs"]
        tensors = self._tensors(batch)
        tensors["advantages"] = batch["response_mask"].float()
        m = batch["response_mask"].bool()
        eng = self.build_engine(model_path, lr=5e-2, micro_batch_size=3, lora_rank=4, lora_alpha=16.0)
        base = eng.compute_logprobs(tensors, base=True)["logprobs"]
        adapted = eng.compute_logprobs(tensors)["logprobs"]
        torch.testing.assert_close(base[m], reference[m], atol=self.logprob_atol, rtol=0)
        # Adapters start as the identity (B = 0): before training the adapted policy is the base model.
        torch.testing.assert_close(adapted[m], reference[m], atol=self.logprob_atol, rtol=0)
        eng.train_step(tensors, PolicyObjective())
        base_after = eng.compute_logprobs(tensors, base=True)["logprobs"]
        adapted_after = eng.compute_logprobs(tensors)["logprobs"]
        torch.testing.assert_close(base_after[m], reference[m], atol=self.logprob_atol, rtol=0)
        assert adapted_after[m].sum() > base_after[m].sum(), "training the adapters did not move the policy"

    def test_topk_logprobs_equal_transformers(self, model_path: str, batch: dict[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM

        k = 5
        eng = self.build_engine(model_path, lr=1e-3, role="reference")
        out = eng.compute_logprobs(self._tensors(batch), temperature=TEMPERATURE, topk=k)
        b, r = batch["responses"].shape
        assert out["topk_ids"].shape == out["topk_logprobs"].shape == (b, r, k)
        assert out["topk_ids"].dtype == torch.long and out["topk_logprobs"].dtype == torch.float32
        plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        with torch.no_grad():
            full = reference_log_softmax(plain, batch, TEMPERATURE)
        for i, logp in enumerate(full):
            n = logp.shape[0]
            want = torch.topk(logp, k, dim=-1)
            torch.testing.assert_close(out["topk_logprobs"][i, :n], want.values, atol=self.logprob_atol, rtol=0)
            # Ids agree wherever the k-th and (k+1)-th values are apart (ties may order either way).
            assert torch.equal(out["topk_ids"][i, :n].sort(-1).values, want.indices.sort(-1).values), i
            # The sampled token's log-prob is still returned, and is the full log-softmax's.
            sampled = logp.gather(-1, batch["responses"][i, :n, None])[:, 0]
            torch.testing.assert_close(out["logprobs"][i, :n], sampled, atol=self.logprob_atol, rtol=0)

    def test_gathered_logprobs_and_their_gradients_equal_transformers(
        self, model_path: str, batch: dict[str, torch.Tensor]
    ) -> None:
        from transformers import AutoModelForCausalLM

        tensors = gather_batch(self._tensors(batch))
        loss = GatherLoss()
        # Micro-batches of 4 rows: a split (exact accumulation) and, on packing engines, a shared prompt.
        grads = self.build_engine(model_path, lr=1e-3, micro_batch_size=4).compute_gradients(
            tensors, loss, temperature=TEMPERATURE
        )
        plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        full = reference_log_softmax(plain, tensors, TEMPERATURE)
        seen = {int(row): got[j] for rows, got in loss.seen for j, row in enumerate(rows)}
        assert sorted(seen) == list(range(len(full))), "every row scored once"
        total = (
            -sum(
                (logp.gather(-1, tensors["teacher_ids"][i, : len(logp)]) * tensors["teacher_w"][i, : len(logp)]).sum()
                for i, logp in enumerate(full)
            )
            / tensors["response_mask"].sum()
        )
        for i, logp in enumerate(full):
            n = logp.shape[0]
            want = logp.gather(-1, tensors["teacher_ids"][i, :n]).detach()
            torch.testing.assert_close(seen[i][:n], want, atol=self.logprob_atol, rtol=0, msg=f"row {i}")
        total.backward()
        expected = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
        common = [name for name in grads if name in expected]
        assert common and any(expected[n].abs().sum() > 0 for n in common)
        for name in common:
            torch.testing.assert_close(grads[name], expected[name], atol=1e-6, rtol=1e-4, msg=name)
