"""The `megatron` training engine: Megatron-Core's GPTModel with tensor (and sequence), context, pipeline, data and
(MoE) expert parallelism.

One engine per worker process; the worker group's mesh (DP x PP x CP x TP, roll_core.cluster.mesh) hands every rank of
a model replica the same rows and collects results from the replica's last pipeline stage. Weights load from and
export to Hugging Face folders (roll_engines.train.megatron._convert) and stream out, at most a layer at a time, for
weight sync (_export); training uses Megatron's DistributedDataParallel, its optimizer (distributed optimizer
optional) and its pipeline schedules, with activation recomputation as config. On CPU the engine applies roll's
Megatron shims around every call (_cpu). Weights out and in, and checkpoint folders: the _weights mixin.

Contract (roll_core.interfaces.TrainEngine), with the same data layout and loss scaling as the `hf` engine: each
micro-batch loss is weighted by its aggregation units over the units of the whole mini-batch across data-parallel
ranks, so any split over micro-batches, ranks and stages gives the gradient of the unsplit batch.

Checkpoints: an HF folder for the weights and a Megatron distributed checkpoint (megatron.core.dist_checkpointing)
for the optimizer state; both are layout-independent, so a run resumes at another TP/PP/DP layout (with the same
`use_distributed_optimizer`, and for MoE expert parallelism on the same side of 1: Megatron gives experts an
optimizer of their own at EP > 1; the states' structures differ).

MoE (Qwen3-MoE, Qwen2-MoE with its gated shared expert; `expert_model_parallel_size`): experts sharded over
data-parallel ranks, their tokens exchanged by all-to-all in every forward, so every data-parallel rank runs as
many micro-batches (`_balanced` pads with rows that train nothing).

Sequence parallelism (`sequence_parallel`, TP > 1) and context parallelism (`context_parallel_size`, all-gather
attention on the local spec: roll_engines.train.megatron._context) pad every width to a multiple of what they split.

Routed-expert replay (`routing_replay`, MoE models; roll_engines.train.megatron._routing): every forward's routers use
the batch's `routed_experts` (the rollout engine's choices) mapped to Megatron's [s, b] token order, per micro-batch.

LoRA (`lora_rank > 0`, roll_engines.train.megatron._lora): adapters on the tensor-parallel linear layers; only they
train, the reference is the base with adapters disabled, weights export merged, checkpoints add a peft `adapter/`.

The critic role (algo=ppo): the GPTModel's output layer is a value head, exchanged with HF as a token classifier
(_critic). Packed sequences (`pack_sequences`, default on) use roll's shared-prompt packing
(roll_engines.train._packing) with its block mask given to Megatron's attention, not the THD format. The entropy
bonus trains through vocab-parallel entropies (_vocab), and the vocabulary projection runs on the positions that
predict response tokens only (_vocab.logits_at).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from roll_core.interfaces import LossFn
from roll_core.models import prepare_engine_process, resolve_model_path, torch_dtype
from roll_engines.structured import refuse_constrained_batch
from roll_engines.train._agree import agreed
from roll_engines.train._logits import (
    check_batch_gather_ids,
    check_temperature,
    check_token_ids,
    empty_outputs,
    gather_ids_of,
)
from roll_engines.train._micro import (
    MetricMeans,
    check_micro_batch_tokens,
    metric_weights,
    micro_batches,
    mini_batch_rows,
    mini_batch_units,
    padding_row,
    rank_counts,
)
from roll_engines.train._optim import lr_lambda
from roll_engines.train.megatron import _convert as C
from roll_engines.train.megatron import _critic as V
from roll_engines.train.megatron import _export as X
from roll_engines.train.megatron import _lora as L
from roll_engines.train.megatron._checkpoint import optimizer_state_bytes
from roll_engines.train.megatron._cpu import engine_shims
from roll_engines.train.megatron._import import import_megatron
from roll_engines.train.megatron._optimizer import build_optimizer, optimizer_step
from roll_engines.train.megatron._packed import model_inputs, prepare, rope_at
from roll_engines.train.megatron._parallel import end_parallel, init_parallel
from roll_engines.train.megatron._refusals import refuse_unsupported
from roll_engines.train.megatron._routing import MegatronRoutingReplay
from roll_engines.train.megatron._vocab import logits_at, response_logprobs, response_rows
from roll_engines.train.megatron._weights import MegatronWeightsAndCheckpoints


class MegatronTrainEngine(MegatronWeightsAndCheckpoints):
    """Megatron-Core training engine (actor, reference or critic) over a Llama/Qwen-family HF model."""

    #: Structured-output constraints are not replayed here (vocab-parallel logits): constrained batches are refused.
    structured_logprobs: ClassVar[bool] = False
    #: No vision tower is mapped to Megatron here: a vision-language model is refused when the roles are built.
    vision_models: ClassVar[bool] = False

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "megatron",
        role: str = "actor",
        dtype: str = "float32",
        device: str = "cpu",
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        decay_norms_and_biases: bool = False,
        betas: tuple[float, float] | list[float] = (0.9, 0.999),
        warmup_steps: int = 0,
        total_steps: int = 1,
        optimizer_steps_per_step: int = 1,  # the plan's per training step: a checkpoint records it (_settings)
        lr_schedule: str = "constant",
        max_grad_norm: float = 1.0,
        micro_batch_size: int = 4,
        micro_batch_tokens: int = 0,
        logprob_chunk_size: int = 8,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        use_distributed_optimizer: bool = True,
        recompute: str | None = None,
        trainable: bool = True,
        num_threads: int | None = None,
        seed: int = 0,
        param_dtype: str = "float32",
        pack_sequences: bool = True,
        dist_backend: str | None = None,
        world_size: int = 1,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | str = "all-linear",
        attn_implementation: str = "sdpa",  # every engine gets model.attn_implementation: Megatron has its own
        trust_remote_code: bool = False,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        routing_replay: bool = False,
        # Picture size bounds (model.image_*_pixels) reach only vision-language runs, which Megatron refuses when the
        # roles are built (`vision_models`): taken so the runtime contract holds, never used.
        image_min_pixels: int | None = None,
        image_max_pixels: int | None = None,
    ) -> None:
        from roll_engines.config import MEGATRON, check_overlap, check_routing_replay

        MEGATRON.require()  # one line naming the extra, not a ModuleNotFoundError from the first layer built
        import_megatron()  # before any other megatron import: without wandb's leftover temporary folders
        refuse_unsupported(
            role=role,
            trust_remote_code=trust_remote_code,
            dtype=dtype,
            param_dtype=param_dtype,
            trainable=trainable,
            lora_rank=lora_rank,
            lora_dropout=lora_dropout,
            micro_batch_tokens=micro_batch_tokens,
            pipeline_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
        )
        check_overlap(overlap_grad_reduce, overlap_param_gather, use_distributed_optimizer)
        check_routing_replay(routing_replay, recompute, pipeline_parallel_size)
        prepare_engine_process(device, num_threads)
        self.name, self.role, self.device = name, role, torch.device(device)
        self.trainable = trainable and role != "reference"
        self.micro_batch_size, self.logprob_chunk_size = micro_batch_size, logprob_chunk_size
        self.micro_batch_tokens = check_micro_batch_tokens(micro_batch_tokens)
        self.pack_sequences = pack_sequences
        self.max_grad_norm, self.base_lr = max_grad_norm, lr
        self._lr = lr_lambda(lr_schedule, warmup_steps, total_steps)
        self._step, self.optimizer_steps_per_step = 0, optimizer_steps_per_step  # the schedule's position, its plan
        self.path = resolve_model_path(model_path)
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(self.path)
        ep = expert_model_parallel_size
        cp = context_parallel_size
        C.check_supported(self.hf_config, tensor_parallel_size, pipeline_parallel_size, ep, sequence_parallel)
        # Context parallelism splits every sequence over the CP ranks, and sequence parallelism each slice over the
        # TP ranks: lengths are padded to a multiple of both.
        self._seq_multiple = (tensor_parallel_size if sequence_parallel else 1) * cp
        self.cp_size = cp
        self.balance_micro_batches = ep > 1  # expert all-to-alls in every forward: every DP rank runs as many
        # Master weights and optimizer state in param_dtype (fp32); Megatron computes in the compute dtype.
        self.compute_dtype = torch_dtype(dtype)
        with self._shims():
            self._owns_process_group = init_parallel(
                self.device, tensor_parallel_size, pipeline_parallel_size, dist_backend, seed, ep, cp
            )
            config = C.transformer_config(
                self.hf_config,
                tensor_parallel_size,
                pipeline_parallel_size,
                self.compute_dtype,
                recompute,
                ep,
                sequence_parallel,
                cp,
            )
            self.critic = role == "critic"  # a value head instead of the output layer (_critic)
            self.model = C.build_model(self.hf_config, config, self.critic)
            if self.critic:
                V.attach(self.model)
            self.model.to(self.device)
            self._seed = seed
            C.write_mapped(self.model, self._mapped(self.path))  # checked whole; errors name the folder
            self.lora = (lora_rank, lora_alpha, lora_target_modules) if lora_rank and self.trainable else None
            if self.lora:  # before DDP and the optimizer: they hold the trainable (adapter) parameters only
                L.apply_lora(self.model, lora_rank, lora_alpha, lora_target_modules, seed)
            # MoE layers compute with the batch's `routed_experts` (the rollout's choices; _routing).
            self.routing = MegatronRoutingReplay.of(self.model, self.hf_config, role) if routing_replay else None
            self.ddp, self.optimizer = self.model, None
            self.overlap = (overlap_grad_reduce, overlap_param_gather)
            if self.trainable:
                self.ddp, self.optimizer = build_optimizer(
                    self.model,
                    config,
                    lr,
                    weight_decay,
                    betas,
                    max_grad_norm,
                    use_distributed_optimizer,
                    self.compute_dtype,
                    self.overlap,
                    decay_norms_and_biases,
                )
            else:
                self.model.requires_grad_(False)

    @classmethod
    def conformance_engine(cls, model_path: str, **kwargs: Any) -> MegatronTrainEngine:
        """TP=PP=1 in this process over gloo, with Megatron's plain optimizer, for roll_core.testing.train_engine's
        suite. Without Megatron-Core this raises ImportError (the suite skips)."""
        # Megatron-Core's first import trips torch's own deprecation warnings (errors under a test run's
        # filterwarnings=error): import_megatron imports it quietly, as pytest.importorskip does. ImportError: the
        # suite skips.
        import_megatron()
        return cls(model_path, dist_backend="gloo", use_distributed_optimizer=False, **kwargs)

    # ---- set-up -------------------------------------------------------------------------------------------
    def _shims(self) -> contextlib.AbstractContextManager[None]:
        """What every Megatron call of this engine runs under (_cpu.engine_shims: roll's CPU shims on CPU)."""
        return engine_shims(self.device)

    _owns_process_group = False  # a group of one this engine started (cluster=local)

    def shutdown(self) -> None:
        """End the process group of one that this engine started (a local run's teardown; a worker group's
        process group is its process's and ends with it)."""
        if self._owns_process_group:
            end_parallel()
            self._owns_process_group = False

    # ---- parallel facts -----------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    def _dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return int(ps.get_data_parallel_rank())

    def _dp_reduce(self, t: Tensor) -> Tensor:
        """`t` summed over the data-parallel group (collective), on the CPU."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        t = t.to(self.device, copy=True)
        dist.all_reduce(t, group=ps.get_data_parallel_group())
        return t.cpu()

    def _tensors(self, batch: Mapping[str, Any], loss_fn: LossFn | None = None) -> dict[str, Tensor]:
        """The batch's tensors (a constrained batch refused), its token ids checked once, on the host, before any
        forward: `responses` and `input_ids` in [0, V) for the config's vocab_size V (_logits.check_token_ids), and
        so are `loss_fn`'s gather ids (_logits.check_batch_gather_ids; _vocab.vocab_parallel_gather refused them
        mid-forward). The vocabulary is padded to a multiple of TP: an id in the padding rows is no token (log-prob
        -inf, a zero embedding), and one past them was read as 0 by the cross entropy and embedded as zeros under
        TP. With routing replay its `routed_experts` are checked too (the whole batch: every mini- and micro-batch
        is rows of it). A refusal on any data-parallel rank is raised on every rank before any collective
        (_agree.agreed: a rank alone raising left the others waiting in theirs)."""
        from megatron.core import parallel_state as ps

        def check() -> dict[str, Tensor]:
            refuse_constrained_batch(batch, "megatron")
            tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
            vocab, who = int(self.hf_config.vocab_size), f"{self.role} engine {self.name!r}"
            what = f"the model's vocabulary (vocab_size={vocab}; Megatron pads it to a multiple of TP)"
            check_token_ids(tensors["responses"], vocab, who, "response", what)
            check_token_ids(tensors["input_ids"], vocab, who, "input_ids", what)
            if loss_fn is not None:
                check_batch_gather_ids(tensors, loss_fn, vocab, who, what)
            if self.routing is not None:
                self.routing.check(tensors)
            return tensors

        size = int(self.dp_size)
        return agreed(check, size, self.device, ps.get_data_parallel_group() if size > 1 else None)

    # ---- forward ------------------------------------------------------------------------------------------
    def _logprobs(
        self,
        logits: Tensor,
        micro: Mapping[str, Tensor],
        temperature: float,
        entropy: bool,
        topk: int = 0,
        gather_ids: Tensor | None = None,
    ) -> dict:
        """Log-probs (B, R) of the response tokens (and their entropies, top-k, log-probs at `gather_ids`) from
        vocab-parallel logits (_vocab); the critic's values (B, R) from its value head."""
        if self.critic:
            return V.response_values(logits, micro)
        vocab = self.hf_config.vocab_size
        return response_logprobs(logits, micro, micro["_rows"], temperature, entropy, vocab, topk, gather_ids)

    def _schedule(
        self,
        micros: list[dict],
        loss: Callable[[Tensor, dict], tuple[Tensor, dict]],
        forward_only: bool,
        force_all_reduce: bool = False,
    ) -> list[dict]:
        """Run Megatron's pipeline schedule over `micros`; returns the loss functions' dicts (last stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[dict], model: Any) -> tuple[Tensor, Callable]:
            micro = next(data_iterator)
            ids, pos, mask = model_inputs(micro, self.device)
            if self.routing is not None:  # before the CP slice: it slices the routing as it slices the inputs
                self._prepare_routing(micro, ids.shape[1])
            if self.cp_size > 1:  # this CP rank's slice of every sequence, at its own positions
                from roll_engines.train.megatron._context import gather_logits, local_slice

                ids, pos, mask = local_slice(ids, pos, mask)
            rows = contextlib.nullcontext()
            if self.model.post_process and not self.critic:  # the vocabulary projection of response tokens only
                sp = self.model.config.sequence_parallel
                plan = response_rows(micro, ids.shape[0], ids.shape[1], sp, ids.device)
                micro, rows = {**micro, "_rows": plan}, logits_at(self.model, plan)
            with rope_at(self.model, pos if "_packed" in micro or self.cp_size > 1 else None), rows:
                output = model(ids, pos, mask)
            if self.cp_size > 1 and self.model.post_process and self.critic:
                output = gather_logits(output)  # the whole sequence's values on every CP rank (one per position)
            # (An actor's logits stay per CP rank: response_logprobs scores each rank's slice and sums over CP.)
            return output, lambda out: loss(out, micro)

        micros = prepare(micros, self.pack_sequences, self._seq_multiple, self.hf_config.hidden_size, self.device)
        inputs = [m["_packed"].input_ids if "_packed" in m else m["input_ids"] for m in micros]
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micros),
                model=[self.ddp],
                num_microbatches=len(micros),
                seq_length=inputs[0].shape[1],
                micro_batch_size=max(x.shape[0] for x in inputs),
                forward_only=forward_only,
                force_all_reduce=force_all_reduce,
            )
        finally:
            if self.routing is not None:
                self.routing.clear()

    def _prepare_routing(self, micro: Mapping[str, Tensor], width: int) -> None:
        """Hand the routers `micro`'s replayed experts in Megatron's token order for this rank's CP and (under
        sequence parallelism) TP slice of the sequence (_routing.megatron_token_order)."""
        from megatron.core import parallel_state as ps

        cp = (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
        sp = (1, 0)
        if self.model.config.sequence_parallel:
            sp = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
        self.routing.prepare(micro, width, cp, sp)

    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: Mapping[str, Tensor],
        temperature: float = 1.0,
        with_entropy: bool = False,
        base: bool = False,
        topk: int = 0,
    ) -> dict[str, Tensor]:
        """Log-probs (B, R) on the last pipeline stage (zeros elsewhere: the group keeps the last stage's).
        `base=True` scores with the LoRA adapters disabled: the reference policy. `topk=K` adds "topk_ids" and
        "topk_logprobs" (B, R, K), merged over the TP shards of the vocabulary (_vocab.vocab_parallel_topk).
        `temperature` below GREEDY_TEMPERATURE (0 included) is a ValueError (_logits.check_temperature)."""
        from megatron.core import parallel_state as ps

        check_temperature(temperature)
        if topk and self.critic:
            raise ValueError("topk scores a policy's vocabulary: the critic has none")
        if base and not self.lora:
            raise ValueError("base=True scores the model without its LoRA adapters: this engine has none")
        tensors = self._tensors(batch)
        n, r = tensors["input_ids"].shape[0], tensors["responses"].shape[1]
        micros, _ = self._balanced(micro_batches(tensors, self.logprob_chunk_size), tensors)

        def loss(out: Tensor, micro: dict) -> tuple[Tensor, dict]:
            got = self._logprobs(out, micro, temperature, with_entropy, topk)
            return out.sum() * 0, {k: v.cpu() for k, v in got.items()}

        self.model.eval()
        disabled = L.adapters_disabled(self.model) if base else contextlib.nullcontext()
        with self._shims(), disabled:
            parts = self._schedule(micros, loss, forward_only=True)
        keys = ["values"] if self.critic else ["logprobs", "entropy"] if with_entropy else ["logprobs"]
        if not ps.is_pipeline_last_stage():  # zeros of the last stage's shapes and dtypes
            return {k: torch.zeros((n, *v.shape[1:]), dtype=v.dtype) for k, v in empty_outputs(keys, r, topk).items()}
        keys += ["topk_ids", "topk_logprobs"] if topk else []
        return {k: torch.cat([p[k] for p in parts])[:n] for k in keys}

    def compute_values(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The critic's values (B, R) at the response positions (last pipeline stage; zeros elsewhere)."""
        if not self.critic:
            raise ValueError(f"compute_values needs the critic role, not {self.role!r}")
        return self.compute_logprobs(batch)

    def _balanced(self, micros: list[dict], batch: Mapping[str, Tensor]) -> tuple[list[dict], int]:
        """`micros` (each numbered by an "_index" tensor) followed by rows that train nothing (`padding_row`), so
        that a replica with no rows still runs the schedule and, with expert parallelism (whose all-to-alls run in
        every forward), every data-parallel rank runs as many micro-batches; returns (micro-batches, real ones)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        real, n = len(micros), max(len(micros), 1)
        if self.balance_micro_batches:
            t = torch.tensor([n], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
            n = int(t.item())
        micros = micros + [padding_row(batch) for _ in range(n - real)]
        return [{**m, "_index": torch.tensor(i)} for i, m in enumerate(micros)], real

    # ---- training -----------------------------------------------------------------------------------------
    def _backward(
        self, mini: dict[str, Tensor], loss_fn: LossFn, temperature: float, force_all_reduce: bool = False
    ) -> tuple[list, float]:
        """Forward/backward of one mini-batch through the schedule; gradients of the unsplit batch (see module
        docstring); returns ((metric, value, micro-batch units) triples, the mini-batch's units over data-parallel
        ranks). `force_all_reduce`:
        whole gradients on every rank even under the distributed optimizer (whose reduction is a reduce-scatter)."""
        micros = micro_batches(mini, self.micro_batch_size, self.micro_batch_tokens, self.pack_sequences)
        total = mini_batch_units(loss_fn, micros, self._dp_reduce)  # 0: no trainable token on any rank
        if total == 0:
            # No schedule, no metrics: every pass would be wasted (a zero loss) and its metrics count nothing. The
            # units are summed over the data-parallel ranks, and the TP/PP/CP ranks of a replica hold its rows:
            # every rank skips alike, so no collective goes unpaired. (The gradient buffers stay zero.)
            return [], total
        micros, real = self._balanced(micros, mini)
        metrics: list[tuple[str, float, float]] = []

        def loss(out: Tensor, micro: dict) -> tuple[Tensor, dict]:
            pad = int(micro["_index"]) >= real  # a padding micro-batch: trains nothing, reports nothing
            gather_ids = gather_ids_of(loss_fn, micro)
            outputs = self._logprobs(out, micro, temperature, loss_fn.needs_entropy, gather_ids=gather_ids)
            value, m = loss_fn(outputs, {k: v.to(self.device) for k, v in micro.items() if k != "_rows"})
            units = 0.0 if pad else loss_fn.units(micro)
            # DDP averages over data-parallel ranks and the schedule divides by the micro-batch count: undo both.
            # (Under CP, DDP averages over DP x CP too, and the schedule multiplies the loss by CP, as every CP rank
            # holds a share of the tokens; here every CP rank computes this same whole loss, the gradient of its own
            # tokens, so the two cancel.)
            scale = units / total * self.dp_size * len(micros) if total > 0 else 0.0
            if not pad:
                metrics.extend(metric_weights(loss_fn, micro, m, float(units)))
            return value * scale, {}

        self.model.train()
        # With overlap_grad_reduce the reductions start in backward hooks, which read this flag, not the
        # schedule's argument (that reaches only the non-overlapped path in finalize_model_grads).
        self.ddp.force_all_reduce = force_all_reduce
        try:
            with self._shims():
                self._schedule(micros, loss, forward_only=False, force_all_reduce=force_all_reduce)
        finally:
            self.ddp.force_all_reduce = False
        return metrics, total

    def train_step(
        self,
        batch: Mapping[str, Tensor],
        loss_fn: LossFn,
        *,
        mini_batches: int = 1,
        epochs: int = 1,
        temperature: float = 1.0,
        shuffle_seed: int | None = None,
    ) -> dict[str, float]:
        if not self.trainable or self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine is not trainable")
        check_temperature(temperature)
        tensors = self._tensors(batch, loss_fn)
        n = tensors["input_ids"].shape[0]
        gen = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
        means = MetricMeans()
        t0 = time.perf_counter()
        if self.routing is not None:  # the step reports its own forwards' routing, not earlier old-logprob ones
            self.routing.changed_fraction()
        skipped = steps = empty = 0
        counts = rank_counts(n, self._dp_rank(), int(self.dp_size), self._dp_reduce)
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if gen is not None else torch.arange(n)
            # mini-batches of the sizes one process cuts, over all data-parallel ranks (as the hf/fsdp2 engines)
            for rows in mini_batch_rows(order, counts, self._dp_rank(), mini_batches):
                self.ddp.zero_grad_buffer()
                self.optimizer.zero_grad()
                pairs, total = self._backward({k: v[rows] for k, v in tensors.items()}, loss_fn, temperature)
                for k, v, w in pairs:
                    means.add(k, v, w)
                if total == 0:  # no trainable token on any data-parallel rank: no step, schedule unchanged
                    empty += 1
                    continue
                lr = self.base_lr * self._lr(self._step)  # what this step applies
                norm, ok = self._step_optimizer()
                if ok:
                    means.add("grad_norm", norm)
                    means.add("lr", lr)
                skipped += int(not ok)
                steps += int(ok)  # a skipped step is not an optimizer step
        out = means.means()
        out["nonfinite_steps"], out["optimizer_steps"] = float(skipped), float(steps)
        out["empty_mini_batches"] = float(empty)
        out.setdefault("lr", self.base_lr * self._lr(self._step))  # the steps' mean rate, as hf's; none: the next's
        if self.routing is not None:  # (position, MoE layer) pairs whose replayed experts differ from the trainer's own
            out["routing_replay_changed_fraction"] = self.routing.changed_fraction()
        out["train_seconds"] = time.perf_counter() - t0
        # Adam's state on this rank (its shard of it with the distributed optimizer; LoRA shrinks it to the adapters).
        out["optimizer_state_mb"] = optimizer_state_bytes(self.optimizer) / 2**20
        return out

    def _step_optimizer(self) -> tuple[float, bool]:
        """(grad norm, stepped): Megatron's optimizer skips a step with a non-finite gradient; the LR schedule
        then does not advance either."""
        with self._shims():
            norm, ok = optimizer_step(self.optimizer, self.base_lr * self._lr(self._step), self.ddp)
        if ok:
            self._step += 1
        return norm, ok

    def compute_gradients(
        self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, Tensor]:
        """Full gradients in HF names of one mini-batch, without a step (data-parallel reduced; collective). With
        LoRA: the adapter's gradients in peft's names (a fused layer's shared A gradient under each projection)."""
        check_temperature(temperature)
        self.ddp.zero_grad_buffer()
        if self.optimizer is not None:
            # Megatron's plain optimizer leaves each param.grad aliasing its main_grad after a step: autograd would
            # accumulate into that alias and the DDP hook add it again (wrong gradients after any train_step).
            self.optimizer.zero_grad()
        # The distributed optimizer's reduction is a reduce-scatter: each rank's gradients are whole only in the
        # shard it updates. Here every rank needs them whole, so this backward's reduction is an all-reduce.
        tensors = self._tensors(batch, loss_fn)
        self._backward(tensors, loss_fn, temperature, force_all_reduce=True)
        if self.lora:
            with self._shims():
                grads = X.all_stages(L.adapter_tensors(self.model, self.hf_config, grads=True))
        else:
            grads = dict(self._export(grads=True, dtype=torch.float32))
        self.ddp.zero_grad_buffer()
        return grads
