"""The DPO objective (`roll.objectives` `dpo`): preference optimisation of pair batches (DPO, IPO, hinge, SimPO;
RPO's NLL on the chosen responses) through any train engine, with the exact gradient of the preference loss.

Batch (the `dpo` collector's, roll_core.posttrain.source layout): 2N rows, pair i's chosen at row 2i and its
rejected at 2i+1 (`is_chosen` (2N,) bool says so and is checked), and `row_id` (2N,) long, each row's stable id in
the run's data (the reference cache's key). Log-probs are at temperature 1 (the policy's own distribution).

Reference: each row's summed response log-prob under the reference role, or the actor's base with LoRA adapters
off (`roles.reference_is_base`), computed ONCE per row id and cached for the run, so later epochs over the data
score nothing (`dpo/reference_rows` counts the rows scored in a step). SimPO needs none. The cache is not
checkpointed: a resumed run recomputes it, to the same numbers (the reference never changes).

Update: the step's pairs are shuffled (seed, step) into mini-batches of whole pairs (`roles.mini_batches`: see
`mini_batches_of`), `algo.ppo_epochs` passes; for each mini-batch:
1. the policy's summed log-probs c_i, r_i of its pairs (compute_logprobs, no gradient);
2. row weights w = dL/dc_i, dL/dr_i of L = mean_i loss_i (roll_algos.preference.preference_row_weights); RPO adds
   sft_weight x NLL with NLL = -(sum of the chosen rows' token log-probs) / T_c (T_c: the mini-batch's chosen
   tokens), so each chosen row's weight gets -sft_weight / T_c;
3. ONE optimizer step on the surrogate S = sum_rows w_row x sum_t mask_t logp_t, whose gradient at these weights
   is grad L: actor_train.train(mini_batch, RowWeightedLogprob, mini_batches=1, epochs=1).

Exact accumulation, the arithmetic: every engine scales a micro-batch's loss by units(micro) / U x D, U the
mini-batch's units summed over its D data-parallel ranks (D is undone by the ranks' gradient averaging; Megatron
also multiplies by its micro-batch count, undone by its schedule's division). `RowWeightedLogprob.units` counts a
micro-batch's real rows (`dpo_row` is 1 on each row; a padding row the engine adds holds 0), so U = the mini-batch's
rows = `RowWeightedLogprob.rows`; the micro-batch's loss is rows / units(micro) x (its part of S). The accumulated
gradient is then sum over micro-batches of units/U x U/units x grad(part of S) = grad S, whatever the split of rows
over micro-batches (row counts or token budgets) and ranks: nothing is averaged.

Metrics (pairs-weighted means over the step's mini-batches, with the pre-update policy of each): dpo/preference_loss,
dpo/reward_accuracy, dpo/reward_margin, dpo/rewards_chosen, dpo/rewards_rejected, dpo/chosen_logp,
dpo/rejected_logp (mean summed log-probs); dpo/nll, the token mean over all the step's chosen trained tokens (the
chosen rows' summed NLL over their token count, every mini-batch and epoch together: not a mean of the mini-batches'
own token means, which weighs a token of a short mini-batch more), and dpo/loss = dpo/preference_loss + sft_weight x
dpo/nll (as eval/dpo_loss); the actor's train metrics under actor/ (`merge_pass_metrics`: optimizer steps and
non-finite steps summed over the step, `grad_norm` and `lr` means over the optimizer steps taken, a skipped pass
weighing nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from roll_algos.preference import preference_row_weights
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.interfaces.training import is_max_metric, largest
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import RoleNeeds
from roll_core.pipelines.wiring import Roles
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

#: Batch keys the objective adds to each mini-batch for its loss.
WEIGHT_KEY, ROW_KEY = "dpo_weight", "dpo_row"
#: Train metrics that add up over the step's mini-batches (see `merge_pass_metrics` for the others).
_SUMMED = (
    "nonfinite_steps",
    "optimizer_steps",
    "scaler_skipped_steps",
    "train_seconds",
    "forward_tokens",
    "micro_batches",
)
#: Train metrics that are means over a pass's optimizer steps taken (a skipped pass reports no step's value).
_PER_STEP = ("grad_norm", "lr")


@dataclass
class RowWeightedLogprob:
    """The surrogate loss of one mini-batch: sum over rows of `dpo_weight` x the row's summed response log-prob,
    exact under any micro-batch split (see the module docstring for the arithmetic). Plain numbers only, so it
    pickles to Ray workers."""

    #: Real rows of the whole mini-batch (over every data-parallel rank): the engines' U.
    rows: float
    needs_entropy: bool = False

    def units(self, micro: Mapping[str, Tensor]) -> float:
        """Real rows of the micro-batch (engine padding rows hold 0 in `dpo_row`)."""
        return float(micro[ROW_KEY].sum())

    def __call__(self, outputs: dict[str, Tensor], micro: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """rows / units x sum_b w_b sum_t mask_bt logp_bt; outputs["logprobs"] (b, R), micro["dpo_weight"] (b,)."""
        logp, mask = outputs["logprobs"], micro["response_mask"].bool()
        # where(), not a product: positions outside the response may hold anything (packed forwards leave 0).
        per_row = torch.where(mask, logp, torch.zeros_like(logp)).sum(-1)
        part = (micro[WEIGHT_KEY].to(per_row.dtype) * per_row).sum()
        units = self.units(micro)
        return part * (self.rows / max(units, 1.0)), {}


def check_pair_batch(batch: Batch) -> int:
    """The number of pairs N of a preference batch (2N rows: chosen at even rows, rejected at odd ones, `row_id`);
    a ValueError naming what is wrong otherwise."""
    for key in ("is_chosen", "row_id", "response_mask"):
        if key not in batch:
            raise ValueError(
                f"the dpo objective needs {key!r} in the batch (the dpo collector's pairs); it has {batch.keys()}"
            )
    n = len(batch)
    chosen = batch["is_chosen"].bool()
    expected = torch.arange(n) % 2 == 0
    if n == 0 or n % 2 or not torch.equal(chosen, expected):
        raise ValueError(
            f"a preference batch holds pairs: chosen at even rows, rejected at odd ones; got {n} rows "
            f"with is_chosen={chosen.int().tolist()[:8]}..."
        )
    if bool((batch["response_mask"].sum(-1) == 0).any()):
        raise ValueError("a preference row has no response token to score (empty loss mask)")
    return n // 2


def mini_batches_of(roles: Roles, pairs: int) -> int:
    """Optimizer steps per pass over a step's `pairs` pairs: `roles.mini_batches` (algo.num_mini_batches, or
    rollout_batch_size x group_size rows / algo.mini_batch_size: algo=dpo's group_size 2 makes those the pairs'
    rows; the LR schedule counts the same steps), at most `pairs` (a mini-batch holds whole pairs)."""
    return max(1, min(roles.mini_batches, pairs))


class DPOObjective:
    """Preference update of a pair batch (see the module docstring)."""

    def __init__(self, cfg: RLVRConfig, roles: Roles) -> None:
        if roles.actor_train is None:
            raise ConfigError("the dpo objective trains the actor: the run has none")
        self.cfg, self.roles, self.dpo = cfg, roles, cfg.dpo
        self.ref_group = None
        if self.dpo.uses_reference:
            self.ref_group = roles.reference or (roles.actor_train if roles.reference_is_base else None)
            if self.ref_group is None:
                raise ConfigError(f"dpo.loss={self.dpo.loss} compares with a reference policy, and none was built")
        #: row_id -> the reference's summed response log-prob (the run's cache; see the module docstring).
        self.ref_cache: dict[int, float] = {}
        #: Rows the reference scored in this process (each row once).
        self.reference_rows = 0

    # ---- reference ----------------------------------------------------------------------------------------
    def reference_logps(self, batch: Batch) -> tuple[Tensor, int]:
        """(2N,) summed reference log-probs of the batch's rows, scoring only rows not in the cache; and how many
        rows were scored now."""
        ids = batch["row_id"].tolist()
        missing = list(dict.fromkeys(i for i in ids if i not in self.ref_cache))
        if missing:
            first = {rid: pos for pos, rid in reversed(list(enumerate(ids)))}
            sub = batch.index([first[rid] for rid in missing])
            logp = self.ref_group.compute_logprobs(sub, 1.0, base=self.roles.reference_is_base)["logprobs"]
            sums = summed(logp, sub["response_mask"])
            if not bool(torch.isfinite(sums).all()):
                raise FloatingPointError("the reference policy gave non-finite log-probs: check the model and dtype")
            self.ref_cache.update(zip(missing, sums.tolist(), strict=True))
            self.reference_rows += len(missing)
        return torch.tensor([self.ref_cache[i] for i in ids], dtype=torch.float32), len(missing)

    # ---- the update ---------------------------------------------------------------------------------------
    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        """Train the actor on the collected pairs; metrics go to `out` (see the module docstring)."""
        batch = collected.batch
        actor = self.roles.actor_train
        assert actor is not None
        n_pairs = check_pair_batch(batch)
        ref = None
        if self.ref_group is not None:
            with out.timer("reference"):
                ref, scored = self.reference_logps(batch)
            out["dpo/reference_rows"] = float(scored)
        n_mini = mini_batches_of(self.roles, n_pairs)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.pipeline.seed, Purpose.SHUFFLE, step))
        dpo_sums: dict[str, float] = {}
        nll_sum = chosen_tokens = 0.0  # the step's chosen NLL and tokens (dpo/nll: a token mean, not a pair mean)
        train_passes: list[dict[str, float]] = []
        for _ in range(self.cfg.algo.ppo_epochs):
            order = torch.randperm(n_pairs, generator=gen)
            for pairs in torch.tensor_split(order, n_mini):
                rows = torch.stack([2 * pairs, 2 * pairs + 1], dim=1).flatten()
                with out.timer("policy_logprobs"):
                    mini, loss_fn, metrics = self.surrogate(batch.index(rows), None if ref is None else ref[rows])
                tokens = float(mini["response_mask"][0::2].sum())
                nll_sum, chosen_tokens = nll_sum + metrics.pop("nll") * tokens, chosen_tokens + tokens
                del metrics["loss"]  # (the step's is put together below from its terms)
                for k, v in metrics.items():
                    dpo_sums[k] = dpo_sums.get(k, 0.0) + v * len(pairs)
                with out.timer("train_actor"):
                    got = actor.train(
                        mini,
                        loss_fn,
                        mini_batches=1,
                        epochs=1,
                        temperature=1.0,
                        shuffle_seed=derive_seed(self.cfg.pipeline.seed, Purpose.SHUFFLE, step, len(train_passes)),
                    )
                train_passes.append(got)
        epochs = self.cfg.algo.ppo_epochs
        out.update({f"dpo/{k}": v / (n_pairs * epochs) for k, v in dpo_sums.items()})
        out["dpo/nll"] = nll_sum / chosen_tokens  # (check_pair_batch: every row has a response token)
        out["dpo/loss"] = out["dpo/preference_loss"] + self.dpo.sft_weight * out["dpo/nll"]
        for k, v in merge_pass_metrics(train_passes).items():
            out[k if "/" in k else f"actor/{k}"] = v
        tokens = float(batch["response_mask"].sum())
        out["perf/response_tokens"] = tokens
        out["perf/train_tokens_per_s"] = tokens * epochs / max(out.timers.get("train_actor", 0.0), 1e-9)

    def surrogate(self, mini: Batch, ref: Tensor | None) -> tuple[Batch, RowWeightedLogprob, dict[str, float]]:
        """One optimizer step's inputs for a mini-batch of whole pairs (2n rows, interleaved) and its reference
        log-probs (2n,) (None: simpo): the mini-batch with `dpo_weight` and `dpo_row` added, the loss whose
        gradient is the preference loss's at the current weights, and the mini-batch's metrics (pre-update)."""
        assert self.roles.actor_train is not None
        logp = self.roles.actor_train.compute_logprobs(mini, 1.0)["logprobs"]
        weights, metrics = self.row_weights(mini, logp, ref)
        mini[WEIGHT_KEY] = weights
        mini[ROW_KEY] = torch.ones(len(mini), dtype=torch.float32)
        return mini, RowWeightedLogprob(rows=float(len(mini))), metrics

    def row_weights(self, mini: Batch, logp: Tensor, ref: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        """(2n,) surrogate weights of a mini-batch's rows (pairs interleaved) from the policy's log-probs (2n, R)
        and the reference's summed ones (2n,) (None: simpo), and its metrics (means over its pairs)."""
        d = self.dpo
        mask = mini["response_mask"]
        seq = summed(logp, mask)
        lengths = mask.sum(-1).to(torch.float32)
        w_c, w_r, _, m = preference_row_weights(**pair_arguments(d, seq, ref, lengths))
        weights = torch.stack([w_c, w_r], dim=1).flatten().to(torch.float32)
        chosen_tokens = float(lengths[0::2].sum())
        nll = -float(seq[0::2].sum()) / chosen_tokens
        if d.sft_weight:
            weights[0::2] -= d.sft_weight / chosen_tokens
        metrics = {k: float(v) for k, v in m.items()}
        metrics["preference_loss"] = metrics.pop("loss")
        metrics["nll"] = nll
        metrics["loss"] = metrics["preference_loss"] + d.sft_weight * nll
        metrics["chosen_logp"] = float(seq[0::2].mean())
        metrics["rejected_logp"] = float(seq[1::2].mean())
        return weights, metrics

    def state_dict(self) -> dict[str, Any]:
        return {}  # the reference cache is recomputed on resume (the module docstring says why)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def merge_pass_metrics(passes: list[dict[str, float]]) -> dict[str, float]:
    """One step's train metrics from its passes' (one `train` call, one optimizer step each): counts and times
    (`_SUMMED`) add up; `grad_norm` and `lr` are means over the optimizer steps taken (each pass weighted by its
    `optimizer_steps`: a pass skipped for a non-finite gradient has no norm and applied no rate; with no step taken
    `lr` is the last pass's, the rate the next step will apply, and `grad_norm` is absent); a maximum (`*_max`) is
    the largest; any other metric is the mean over the passes that report it."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    for got in passes:
        for k, v in got.items():
            w = float(got.get("optimizer_steps", 1.0)) if k in _PER_STEP else 1.0
            sums[k] = sums.get(k, 0.0) + v * w
            weights[k] = weights.get(k, 0.0) + w
            values.setdefault(k, []).append(v)
    out: dict[str, float] = {}
    for k, vs in values.items():
        if k in _SUMMED:
            out[k] = sum(vs)
        elif is_max_metric(k):
            out[k] = largest(vs)
        elif weights[k] > 0:
            out[k] = sums[k] / weights[k]
        elif k == "lr":
            out[k] = vs[-1]
    return out


def pair_arguments(d: Any, seq: Tensor, ref: Tensor | None, lengths: Tensor) -> dict[str, Any]:
    """roll_algos.preference's arguments for interleaved pair rows (chosen at even rows): summed policy log-probs
    `seq` (2n,), the reference's (2n,) or None (simpo), response lengths (2n,), and the `dpo` config `d`."""
    return {
        "chosen_logp": seq[0::2],
        "rejected_logp": seq[1::2],
        "ref_chosen": None if ref is None else ref[0::2],
        "ref_rejected": None if ref is None else ref[1::2],
        "variant": d.loss,
        "beta": d.beta,
        "label_smoothing": d.label_smoothing,
        "simpo_gamma": d.simpo_gamma if d.loss == "simpo" else 0.0,
        "chosen_len": lengths[0::2],
        "rejected_len": lengths[1::2],
    }


def summed(logp: Tensor, mask: Tensor) -> Tensor:
    """(B,) sum of each row's log-probs (B, R) over its loss-masked response tokens, in fp32."""
    return torch.where(mask.bool(), logp.float(), torch.zeros((), dtype=torch.float32)).sum(-1)


def check_dpo_algo(cfg: RLVRConfig) -> None:
    """ConfigError for `algo` settings DPO would ignore or take differently from the LR schedule's step count."""
    from roll_core.pipelines.wiring import mini_batches

    algo, pairs = cfg.algo, cfg.pipeline.rollout_batch_size
    if algo.num_mini_batches > pairs:
        raise ConfigError(
            f"algo.num_mini_batches={algo.num_mini_batches} exceeds the {pairs} pairs of a step "
            f"(pipeline.rollout_batch_size): a mini-batch holds whole pairs"
        )
    if algo.mini_batch_size and algo.group_size != 2:
        # wiring.mini_batches reads mini_batch_size against rollout_batch_size x group_size rows: a pair's 2 rows
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} with algo.group_size={algo.group_size}: a DPO step holds "
            "2 rows per pair (pipeline.rollout_batch_size pairs): use algo=dpo or set algo.group_size=2"
        )
    if mini_batches(cfg) > pairs:  # the schedule would count steps DPO never takes (it cannot split a pair)
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} makes {mini_batches(cfg)} mini-batches of a step's {pairs} "
            "pairs: a mini-batch holds whole pairs (2 rows each): set algo.mini_batch_size >= 2"
        )
    if algo.use_reference or algo.entropy_coef:
        raise ConfigError(
            "algo.kl_coef / algo.kl_target / algo.entropy_coef do not apply to DPO (its reference term is "
            "dpo.beta; no entropy bonus): use algo=dpo"
        )


class _DPO:
    """`roll.objectives` `dpo`: the actor, and a reference unless the loss is reference-free."""

    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        check_dpo_algo(cfg)
        return RoleNeeds(train=True, reference=cfg.dpo.uses_reference)

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> DPOObjective:
        return DPOObjective(cfg, roles)


dpo_objective = _DPO()
