"""The `hf` training engine: one process, any `AutoModelForCausalLM` (or a value model for the critic), or a
vision-language model (`AutoModelForImageTextToText`) fed the batch's `mm_inputs` (roll_engines.train._vision).

Data layout (roll_core.protocol): `input_ids`/`attention_mask`/`position_ids` are (B, P+R) with the prompt
left-padded to P and the response right-padded to R; `responses` and `response_mask` are (B, R). The logits
at positions P-1 .. P+R-2 predict the response tokens, so only the last R+1 logits are computed.

Contract:
- `compute_logprobs` / `compute_values` run without gradients in chunks of `logprob_chunk_size` rows.
- `compute_logprobs(..., topk=K)` adds each response position's top-K log-probs and their ids (a distillation
  teacher's targets); a loss with `gather_ids_key` gets `gathered_logprobs`, the log-probs at the (b, R, K) ids
  its micro-batch holds under that key, differentiable (roll_engines.train._logits).
- `train_step(batch, loss_fn, ...)` splits the batch into `mini_batches` optimizer steps per epoch (over all
  data-parallel ranks, of the sizes one process cuts: roll_engines.train._micro.mini_batch_rows) and each into
  micro-batches of `micro_batch_size` rows (rows, whatever their lengths), or with `micro_batch_tokens > 0` of at
  most that many attended tokens (roll_engines.train._micro), for gradient accumulation. Each micro-batch loss is
  scaled by `loss_fn.units(micro) / units of its whole mini-batch (over all data-parallel ranks)` times the
  data-parallel size, so any split of rows over micro-batches and ranks gives the gradient of the unsplit batch.
- `pack_sequences` (default on) runs each micro-batch / chunk packed (roll_engines.train._packing): a prompt
  shared by several rows is computed once, responses follow it without padding under a block attention mask.
  Rows are first grouped by prompt inside each mini-batch (and the scoring batch), so micro-batches share
  prompts; the rows of each mini-batch, hence the gradient, stay the same, and so do the step's metrics (token
  means weighted by tokens, sequence means by rows: roll_engines.train._micro.metric_weights). Sliding-window
  layers get the block mask cut to their window (_packed_masks); models that cannot take the packed masks use the
  padded forward (logged once). Outputs at response positions outside the attention mask are 0 when packed.
- Structured outputs: a batch may carry `structured` (roll_core.interfaces.inference.STRUCTURED_KEY, a (B, K) uint8
  tensor from `structured_rows`): the JSON schema / regex each row was sampled under. The log-probs (and
  entropies) of a constrained row are then those of the constrained distribution the sampler drew from: at each
  response position the logits (after temperature) are masked to the tokens the constraint allowed after the
  response prefix (roll_engines.structured.replay_mask), so the PPO ratio compares the same policy on both sides.
  Micro-batches holding a constrained row run the padded forward (the mask needs each position's full logits). A
  response token the constraint never allowed ends its row's masking there (counted in
  `structured_rejected_rows`, logged): such a row was not sampled under its constraint.
- `routing_replay=True` (MoE models): every forward's MoE layers use the batch's `routed_experts` (roll_core.routing,
  the rollout engine's expert choices) instead of their routers' top-k (roll_engines.train._routing).
- Never sees a Hydra config: the worker passes plain values.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from roll_core.interfaces import LossFn
from roll_core.interfaces.inference import STRUCTURED_KEY
from roll_core.models import prepare_engine_process, resolve_model_path
from roll_engines._onednn_linear import use_onednn_linears
from roll_engines.train import _vision as V  # vision-language models: pictures travel with their rows
from roll_engines.train._agree import agreed
from roll_engines.train._dropout import disable_dropout
from roll_engines.train._hf_attention import HFAttentionCredit
from roll_engines.train._hf_checkpoint import HFWeightsAndCheckpoints, check_loaded
from roll_engines.train._logits import (
    check_batch_ids,
    check_temperature,
    check_topk,
    empty_outputs,
    entropy_request,
    gather_ids_of,
    response_outputs,
)
from roll_engines.train._lora import apply_lora, base_model, check_adapter_sync, is_lora
from roll_engines.train._micro import (
    MetricMeans,
    check_micro_batch_tokens,
    metric_weights,
    micro_rows,
    mini_batch_rows,
    mini_batch_units,
    rank_counts,
)
from roll_engines.train._micro import padding_row as _padding_row
from roll_engines.train._optim import adamw_kernel, lr_lambda, optimizer_state_mb, param_groups, stepped_params
from roll_engines.train._packing import pack, packed_forward, prompt_order, unsupported_reason
from roll_engines.train._precision import engine_dtypes, mirror_autocast
from roll_engines.train._routing import RoutingReplay
from roll_hw.cpu import fp32_linear_library

log = logging.getLogger(__name__)

# The optimizer helpers' and check_loaded's old home (roll_engines.train._optim, ._hf_checkpoint).
__all__ = ["HFTrainEngine", "adamw_kernel", "check_loaded", "lr_lambda"]


class HFTrainEngine(HFWeightsAndCheckpoints, HFAttentionCredit):
    """A transformers model with AdamW, an LR schedule, chunked log-probs and gradient accumulation."""

    #: Log-probs replay a batch's structured-output constraints (`structured`); engines without it refuse them.
    structured_logprobs: ClassVar[bool] = True
    #: Trains vision-language models from batches with `mm_inputs` (roll_engines.train._vision).
    vision_models: ClassVar[bool] = True
    #: With LoRA, `iter_adapter` exports the adapter alone (infer_engine.lora_sync=adapter).
    adapter_sync: ClassVar[bool] = True
    #: Mixed precision by autocast (fsdp2: its policy casts every parameter): a frozen model mirrors it (_load).
    autocasts: ClassVar[bool] = True

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "hf",
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
        gradient_checkpointing: bool = False,
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        trainable: bool = True,
        world_size: int = 1,
        num_threads: int | None = None,
        seed: int = 0,
        param_dtype: str = "float32",
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | str = "all-linear",
        pack_sequences: bool = True,
        routing_replay: bool = False,
        # The run's picture size bounds (model.image_*_pixels): the checkpoint's saved image processor carries them.
        image_min_pixels: int | None = None,
        image_max_pixels: int | None = None,
    ) -> None:
        if role not in ("actor", "critic", "reference"):
            raise ValueError(f"role must be actor, critic or reference, got {role!r}")
        self.trainable = trainable and role != "reference"
        prepare_engine_process(device, num_threads)
        self.name, self.role, self.device = name, role, torch.device(device)
        self.micro_batch_size, self.logprob_chunk_size = micro_batch_size, logprob_chunk_size
        self.micro_batch_tokens = check_micro_batch_tokens(micro_batch_tokens)
        self.max_grad_norm, self.optimizer_steps_per_step = max_grad_norm, optimizer_steps_per_step
        self.path = resolve_model_path(model_path)
        self._trust_remote_code = trust_remote_code
        self._tokenizer: Any = None  # loaded on the first constrained batch (structured outputs)
        # Rows whose response holds a token their constraint never allowed (masking stopped there).
        self.structured_rejected_rows = 0
        # Mixed precision (roll_engines.train._precision): `dtype` (model.dtype) is the compute dtype, trained
        # parameters (and AdamW's state) stay in `param_dtype` (fp32); a frozen model computes as the actor would.
        self.compute_dtype, self.dtype = engine_dtypes(dtype, param_dtype, self.trainable, self.autocasts)
        self.autocast = self.compute_dtype != self.dtype  # FSDP2 casts in its own mixed-precision policy
        # fp16 compute needs loss scaling (its gradients underflow); bf16 has fp32's exponent range.
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.trainable and self.compute_dtype == torch.float16 else None
        )
        self._loss_finite = True  # every micro-batch loss of the mini-batch being accumulated (fp16: see above)
        self.scaler_streak = 0  # optimizer steps in a row the scaler skipped for an overflow, across train_step calls
        torch.manual_seed(seed)  # the critic's new value head is initialised from this seed
        self.vision = V.Vision.of(self.path, image_min_pixels, image_max_pixels)  # None for a text model
        # With LoRA only the adapters train: the frozen base needs no master copy (a bf16 base held in fp32 took
        # twice its memory) and is held in the compute dtype like a frozen reference; the adapters take param_dtype.
        lora = lora_rank > 0 and self.trainable
        self.base_dtype = self.compute_dtype if lora else self.dtype
        self.model = self._load(attn_implementation, trust_remote_code)
        if lora:
            if lora_dropout:  # (the config refuses it too) see _load: a training forward must equal the scoring's
                raise ValueError("LoRA trains without dropout here: set train_engine.lora_dropout=0")
            if role != "actor":
                raise ValueError(f"LoRA trains the policy only (role {role!r}): set lora_rank=0 for the {role}")
            # Only the adapters train; the base with adapters disabled doubles as the reference policy.
            self.model = apply_lora(self.model, lora_rank, lora_alpha, lora_dropout, lora_target_modules, self.dtype)
        if gradient_checkpointing and trainable:
            # transformers >= 5 renamed the switch; older releases only have the gradient_ name.
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.device.type == "cpu" and fp32_linear_library() == "onednn":
            # fp32 linears through oneDNN, both passes (roll_engines._onednn_linear): on AMD CPUs MKL runs AVX2.
            use_onednn_linears(self.model)
        self.model = self._wrap(self.model)
        # MoE layers compute with the batch's `routed_experts` (the rollout's choices; roll_engines.train._routing).
        self.routing = RoutingReplay.of(self.model, role) if routing_replay else None
        self.pack_sequences = pack_sequences
        reason = unsupported_reason(self.model) if pack_sequences else None
        if reason is not None:
            log.warning("pack_sequences: %s; using the padded forward", reason)
            self.pack_sequences = False
        # Weighs padding against attention when a packed micro-batch is split into rows (_packing._place).
        self.pack_hidden_size = V.hidden_size(self.model.config)
        # Positions fed to the model by every forward so far (padding included): what packing saves.
        self.forward_tokens = 0
        # Training forward/backward passes so far (padding micro-batches included): what a token budget sets.
        self.micro_batches_run = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if self.trainable:
            self.model.train()
            # No weight decay on biases and norms (roll_engines.train._optim.param_groups), unless asked.
            groups = param_groups(self.model, weight_decay, decay_norms_and_biases)
            trained = [p for g in groups for p in g["params"]]
            self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **adamw_kernel(trained))
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lr_lambda(lr_schedule, warmup_steps, total_steps)
            )
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    # ---- construction hooks (FSDP2 overrides) -------------------------------------------------------------
    def _load(self, attn_implementation: str, trust_remote_code: bool) -> torch.nn.Module:
        kwargs = dict(
            dtype=self.base_dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
        if self.role == "critic":
            kwargs["num_labels"] = 1
        model = self._instantiate(V.model_class(self.vision, self.role), kwargs)
        # Training forwards keep no KV cache; checkpoints write the model's own setting back (_hf_checkpoint).
        self.loaded_use_cache = getattr(model.config, "use_cache", None)  # (None: a VLM's keeps it in text_config)
        model.config.use_cache = False
        # No dropout anywhere (as peers do): the log-probs and values a step trains on must be the ones the
        # scoring passes computed in eval mode (a token-classification head brings dropout 0.1 by default; an
        # attention layer's rate is a plain float: roll_engines.train._dropout).
        disable_dropout(model)
        if self.autocast:  # (__init__) MoE experts computed in bf16 as linears; a frozen model: cast weights narrowed
            mirror_autocast(model, self.compute_dtype, frozen=not self.trainable)
        return self._place(model)

    def _instantiate(self, model_class: Any, kwargs: dict[str, Any]) -> torch.nn.Module:
        """The transformers model of `self.path`, weights read (the fsdp2 engine builds it on the meta device on
        ranks other than 0, which then read no weights; `_load`'s settings after this apply to both)."""
        return model_class.from_pretrained(self.path, **kwargs)

    def _place(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put the loaded model on the engine's device (sharded engines defer this to their sharding)."""
        return model.to(self.device)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    def _all_reduce_sum(self, t: Tensor) -> Tensor:
        return t

    def _all_reduce_max(self, n: int) -> int:
        return n

    # ---- forward ------------------------------------------------------------------------------------------
    @property
    def lora(self) -> bool:
        return is_lora(self.model)

    def check_adapter_sync(self) -> None:
        """ConfigError now (TrainWorker.set_weight_format: before the first rollout) for what `iter_adapter` refuses."""
        check_adapter_sync(self)

    def _forward(
        self,
        micro: Mapping[str, Tensor],
        temperature: float,
        with_entropy: bool,
        topk: int = 0,
        gather_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Log-probs (b, R) (and entropies (b, R), top-k (b, R, K), log-probs at `gather_ids` (b, R, K')) of the
        responses, or critic values (b, R), of one micro-batch (roll_engines.train._logits)."""
        structured = micro.get(STRUCTURED_KEY)
        constrained = structured is not None and self.role != "critic" and bool(structured.any())
        # Pictures (merged in row order) and mrope positions (3, b, L) of a vision-language micro-batch.
        pics = self.vision.micro(base_model(self.model), micro) if self.vision is not None else None
        positions = micro["position_ids"] if pics is None or pics.positions is None else pics.positions
        packed = (
            pack(
                micro["input_ids"], micro["attention_mask"], positions, micro["responses"], self.pack_hidden_size, pics
            )
            if self.pack_sequences and not constrained
            else None
        )
        if self.routing is not None:
            self.routing.prepare(micro, packed)
        if packed is not None:
            self.forward_tokens += packed.tokens
            autocast = torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast)
            return packed_forward(
                self.model,
                packed.to(self.device),
                critic=self.role == "critic",
                temperature=temperature,
                with_entropy=with_entropy,
                autocast=autocast,
                topk=topk,
                gather_ids=gather_ids,
            )
        ids = micro["input_ids"].to(self.device)
        self.forward_tokens += ids.numel()
        resp = micro["responses"].to(self.device)
        r = resp.shape[1]
        kwargs = dict(
            input_ids=ids,
            attention_mask=micro["attention_mask"].to(self.device),
            position_ids=positions.to(self.device),
            **{k: v.to(self.device) for k, v in (pics.tensors if pics is not None else {}).items()},
        )
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            if self.role == "critic":
                scores = self.model(**kwargs).logits  # (b, P+R, 1)
                return {"values": scores[:, -r - 1 : -1, 0].float()}
            logits = self.model(**kwargs, logits_to_keep=r + 1).logits[:, :-1]  # (b, R, V)
        logits = logits.float()  # temperature and log-softmax in fp32 whatever the compute dtype
        if temperature != 1.0:
            logits = logits / temperature
        if constrained:
            logits = self._constrain(logits, micro)
        return response_outputs(logits, resp, with_entropy=with_entropy, topk=topk, gather_ids=gather_ids)

    def _constrain(self, logits: Tensor, micro: Mapping[str, Tensor]) -> Tensor:
        """(b, R, V) logits masked as the sampler masked them, row by row (roll_engines.structured)."""
        from roll_engines.structured import constrain_logits

        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self._trust_remote_code)
        logits, rejected = constrain_logits(
            logits, micro[STRUCTURED_KEY], micro["responses"], micro.get("response_mask"), self._tokenizer
        )
        if rejected:
            self.structured_rejected_rows += rejected
            log.warning(
                "structured outputs: %d row(s) hold a response token outside their constraint; their log-probs are "
                "unconstrained from that token on (%d such rows so far)",
                rejected,
                self.structured_rejected_rows,
            )
        return logits

    @torch.no_grad()
    def compute_logprobs(
        self,
        batch: Mapping[str, Tensor],
        temperature: float = 1.0,
        with_entropy: bool = False,
        base: bool = False,
        topk: int = 0,
    ) -> dict[str, Tensor]:
        """Log-probs (B, R) of the response tokens (and entropies (B, R) if asked), in row chunks.

        `base=True` scores with LoRA adapters disabled: the frozen base model, i.e. the reference policy.
        `topk=K > 0` adds "topk_ids" (B, R, K) long and "topk_logprobs" (B, R, K) fp32: the top-K of
        log_softmax(logits / temperature) at each response position, sorted descending.
        `temperature` below GREEDY_TEMPERATURE (0 included) is a ValueError (`check_temperature`).
        """
        check_temperature(temperature)
        if self.role == "critic" and topk:
            raise ValueError("topk scores a policy's vocabulary: the critic has none")
        if base and self.lora:
            with self.model.disable_adapter():
                return self._chunked(batch, temperature, with_entropy, topk)
        if base:
            raise ValueError("base=True scores the model without its LoRA adapters: this engine has none")
        return self._chunked(batch, temperature, with_entropy, topk)

    @torch.no_grad()
    def compute_values(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Critic values (B, R) of the states before each response token."""
        return self._chunked(batch, 1.0, False)

    def _chunked(
        self, batch: Mapping[str, Tensor], temperature: float, with_entropy: bool, topk: int = 0
    ) -> dict[str, Tensor]:
        check_topk(topk, int(V.vocab_size(self.model.config) or topk))
        tensors = self._checked(batch)
        was_training = self.model.training
        self.model.eval()  # no dropout in scoring passes
        n = tensors["input_ids"].shape[0]
        order = self._prompt_order(tensors)
        if order is not None:  # chunks of rows that share prompts; outputs are put back in batch order below
            tensors = V.take(tensors, order)
        chunks = [V.take(tensors, slice(s, s + self.logprob_chunk_size)) for s in range(0, n, self.logprob_chunk_size)]
        parts: dict[str, list[Tensor]] = {}
        try:  # a failed pass must not leave the policy in eval mode (training would run without checkpointing)
            # Sharded forwards are collective: every rank runs as many chunks as the busiest one (padding rows).
            for i in range(self._all_reduce_max(len(chunks))):
                chunk = chunks[i] if i < len(chunks) else _padding_row(tensors)
                out = self._forward(chunk, temperature, with_entropy, topk)
                if i < len(chunks):
                    for k, v in out.items():
                        parts.setdefault(k, []).append(v.cpu())
        finally:
            self.model.train(was_training)
        if not parts:  # a rank with no rows
            r = tensors["responses"].shape[1]
            keys = ["values"] if self.role == "critic" else ["logprobs", "entropy"] if with_entropy else ["logprobs"]
            return empty_outputs(keys, r, topk)
        out = {k: torch.cat(v) for k, v in parts.items()}
        if order is not None:
            out = {k: v[torch.argsort(order)] for k, v in out.items()}
        return out

    def _checked(self, batch: Mapping[str, Tensor], loss_fn: LossFn | None = None) -> dict[str, Any]:
        """The batch's tensors (_vision.checked_batch), its token ids (and `loss_fn`'s gather ids) checked once
        against the vocabulary, its replayed routing against the model (_routing.check_routing); a refusal on any
        data-parallel rank is raised on every rank before any collective (_agree.agreed)."""

        def check() -> dict[str, Any]:
            tensors = V.checked_batch(batch, self.vision, self.path)
            check_batch_ids(tensors, base_model(self.model), f"{self.role} engine {self.name!r}", loss_fn)
            if self.routing is not None:
                self.routing.check(tensors)
            return tensors

        return agreed(check, self.dp_size, self.device)

    def _prompt_order(self, tensors: Mapping[str, Any]) -> Tensor | None:
        """Row permutation (B,) grouping rows that share a prompt (ids and pictures), when packing; None keeps the
        order."""
        if not self.pack_sequences or tensors["input_ids"].shape[0] < 2:
            return None
        r = tensors["responses"].shape[1]
        ids, am, pos = tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"]
        return prompt_order(ids, am, pos, r, V.picture_keys(tensors))

    # ---- training -----------------------------------------------------------------------------------------
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
        """`epochs` passes of `mini_batches` optimizer steps over this rank's rows; returns averaged metrics."""
        if not self.trainable or self.optimizer is None:
            raise RuntimeError(f"the {self.role} engine is not trainable")
        check_temperature(temperature)
        tensors = self._checked(batch, loss_fn)
        n = tensors["input_ids"].shape[0]
        means = MetricMeans()
        gen = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
        t0, tokens0, micros0 = time.perf_counter(), self.forward_tokens, self.micro_batches_run
        if self.routing is not None:  # the step reports its own forwards' routing, not earlier old-logprob ones
            self.routing.changed_fraction()
        skipped = steps = scaler_skips = empty = 0
        longest = 0  # the longest streak an overflow of this call reached (streaks carried in count on)
        counts = rank_counts(n, self.dp_rank, self.dp_size, self._all_reduce_sum)
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if gen is not None else torch.arange(n)
            # Mini-batches of the sizes one process cuts, over all ranks (_micro.mini_batch_rows). A rank's part of
            # one may be empty (fewer rows than mini-batches): it still runs every collective; a mini-batch without
            # a trainable token on any rank takes no optimizer step (_micro.mini_batch_units), counted as empty.
            for mb_rows in mini_batch_rows(order, counts, self.dp_rank, mini_batches):
                self.optimizer.zero_grad(set_to_none=True)
                metrics, total = self._accumulate(V.take(tensors, mb_rows), loss_fn, temperature, tensors, True)
                for k, v, w in metrics:
                    means.add(k, v, w)
                if total == 0:
                    empty, self._loss_finite = empty + 1, True  # (no step: the next mini-batch starts clean)
                    continue
                lr = float(self.optimizer.param_groups[0]["lr"])  # what this step applies (the schedule's now)
                norm, stepped, overflow = self._clip_and_step()
                if stepped:
                    means.add("grad_norm", norm)
                    means.add("lr", lr)
                skipped += int(not stepped and not overflow)
                scaler_skips += int(overflow)
                if overflow:
                    self.scaler_streak += 1
                    longest = max(longest, self.scaler_streak)
                elif stepped:
                    self.scaler_streak = 0
                steps += int(stepped)
        out = means.means()
        # Optimizer steps taken, and those skipped for a non-finite loss or gradient (weights, moments and LR
        # schedule untouched): a skipped step is not an optimizer step. fp16's loss scaler overflowing (its first
        # steps do, by design, while it finds its scale) is the scaler's business, not a blow-up of the run's.
        out["nonfinite_steps"], out["optimizer_steps"] = float(skipped), float(steps)
        out["empty_mini_batches"] = float(empty)  # no trainable token on any rank: no step, schedule unchanged
        if self.scaler is not None:
            out["scaler_skipped_steps"], out["loss_scale"] = float(scaler_skips), float(self.scaler.get_scale())
            # Each skip halves the scale: a long streak is a gradient that overflows fp16 at any scale, which would
            # skip every step for ever; the pipeline stops on it (pipeline.max_loss_scale_skips).
            out["scaler_skip_streak_max"] = float(longest)
        # `lr`: the mean rate the step's optimizer steps applied (the schedule moves between them); a step that took
        # none reports the rate the next one will apply. (It was the schedule's value after the step: with a warm-up
        # of 4, a step that trained at lr/4 logged lr/2.)
        out.setdefault("lr", float(self.optimizer.param_groups[0]["lr"]))
        out["train_seconds"] = time.perf_counter() - t0
        out["forward_tokens"] = self.forward_tokens - tokens0  # positions computed (padding included)
        out["micro_batches"] = float(self.micro_batches_run - micros0)  # forward/backward passes, padding included
        if self.routing is not None:  # (position, MoE layer) pairs whose replayed experts differ from the trainer's own
            out["routing_replay_changed_fraction"] = self.routing.changed_fraction()
        # AdamW's state on this rank (fp32 moments of every trained parameter; LoRA shrinks it to the adapters).
        out["optimizer_state_mb"] = optimizer_state_mb(self.optimizer)
        return out

    def _accumulate(
        self, mini: dict, loss_fn: LossFn, temperature: float, template: dict | None = None, skip: bool = False
    ) -> tuple[list[tuple[str, float, float]], float]:
        """Backward of one mini-batch in micro-batches, each scaled so the sum is the whole mini-batch's gradient.

        Every data-parallel rank runs the same number of forward/backward passes (sharded engines' collectives
        must pair up): a rank with fewer micro-batches adds padding rows whose loss weight is 0; one without a
        trainable token runs its passes (FSDP's collectives) while another rank has some (masked tokens add no
        gradient). `skip` (train_step): with none on any rank (units 0: summed over the ranks, so all skip
        alike) no pass runs and no metric counts. Returns (metric, value, units) of the real micro-batches and the
        mini-batch's units over all ranks.
        """
        order = self._prompt_order(mini)
        if order is not None:  # micro-batches of rows that share prompts (the mini-batch's rows are unchanged)
            mini = V.take(mini, order)
        rows = micro_rows(mini, self.micro_batch_size, self.micro_batch_tokens, grouped=order is not None)
        micros = [V.take(mini, r) for r in rows]
        total = mini_batch_units(loss_fn, micros, self._all_reduce_sum)  # 0: no trainable token on any rank
        out = []
        if total == 0 and skip:  # (its passes were wasted, and their metrics of nothing counted in the means)
            return out, total
        for i in range(self._all_reduce_max(len(micros))):
            real = i < len(micros)
            micro = micros[i] if real else _padding_row(template if template is not None else mini)
            outputs = self._forward(micro, temperature, entropy_request(loss_fn), 0, gather_ids_of(loss_fn, micro))
            self.micro_batches_run += 1
            loss, metrics = loss_fn(outputs, {k: v.to(self.device) for k, v in V.tensors_of(micro).items()})
            scale = loss_fn.units(micro) / total * self.dp_size if real and total > 0 else 0.0
            scaled = loss * scale
            if self.scaler is not None:
                self._loss_finite = self._loss_finite and bool(torch.isfinite(loss.detach()))
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
            if real:
                out += metric_weights(loss_fn, micro, metrics, float(loss_fn.units(micro)))
        return out, total

    def compute_gradients(
        self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float = 1.0
    ) -> dict[str, Tensor]:
        """Gradients of `loss_fn` over this rank's rows as one mini-batch, without an optimizer step (checks).
        Under fp16's loss scaler they are unscaled (the backward runs on the scaled loss: they came back 2^16 x)."""
        check_temperature(temperature)
        self.model.zero_grad(set_to_none=True)
        self._accumulate(self._checked(batch, loss_fn), loss_fn, temperature)
        self._loss_finite = True  # (no step follows: the next train_step starts clean)
        grads = self.gradients()
        if self.scaler is not None:
            inv = 1.0 / self.scaler.get_scale()  # a power of two: exact
            grads = {k: g * inv for k, g in grads.items()}
        self.model.zero_grad(set_to_none=True)
        return grads

    def gradients(self) -> dict[str, Tensor]:
        """Current full gradients by parameter name (CPU copies)."""
        return {name: p.grad.detach().cpu().clone() for name, p in self.model.named_parameters() if p.grad is not None}

    def _clip_and_step(self) -> tuple[float, bool, bool]:
        """Clip and apply the accumulated gradient; (total norm, whether the step was taken, whether it was fp16's
        loss scaler that overflowed). A non-finite norm (NaN/inf loss or gradient) skips the step, and the LR
        schedule does not advance for a skipped step. With a scaler, a non-finite norm from finite losses on every
        rank is the scaled gradient overflowing: the scaler lowers its scale and the next step tries again."""
        loss_finite, self._loss_finite = self._loss_finite, True  # (for the next mini-batch)
        params = stepped_params(self.optimizer)  # (zeros where the backward missed one, as fsdp2/megatron hold)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradient, not the scaled one
        if self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stepped = math.isfinite(norm)
        if self.scaler is not None:  # skips the step on inf/nan (then lowers the scale)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif stepped:
            self.optimizer.step()
        if not stepped:  # a non-finite gradient would poison the weights and moments
            self.optimizer.zero_grad(set_to_none=True)
            # (every rank sees the same norm, so every rank joins this reduction)
            overflow = self.scaler is not None and self._all_reduce_max(int(not loss_finite)) == 0
            if overflow:
                log.info("%s: fp16 loss scale overflowed; step skipped, scale lowered", self.role)
            else:
                log.warning("%s: non-finite gradient norm (%s): optimizer step skipped", self.role, norm)
            return norm, False, overflow
        self.scheduler.step()
        return norm, True, False
