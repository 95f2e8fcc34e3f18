"""The shared bases of the engine config groups: `TrainEngineConfig` and `InferEngineConfig`.

Contract: every training or inference engine's schema (roll_engines.config, out-of-tree plugins) extends one of
these dataclasses; the root config (roll_core.config.schema.RLVRConfig) types `train_engine`/`infer_engine` by them,
so the pipeline reads these fields typed whatever engine is installed. `__post_init__` refuses bad values with the
key's name, and a train engine's `check_model` a model it cannot train, before the cluster starts;
`resolve_sleep_level` fills the run-dependent default of `infer_engine.sleep_level`, and `refuse_sleeping_engines`
refuses a level above 0 in an asynchronous run; `warn_low_group_temperature` warns about near-greedy sampling with
a group-relative estimator (every group's advantages zero), `warn_ignored_lora_keys` about LoRA keys set while
`lora_rank=0` (full fine-tuning ignores them).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from roll_core.config.checks import one_of, positive

# Weight dtypes a model or an engine may name (model.dtype, infer_engine.dtype).
DTYPES = ("auto", "float32", "bfloat16", "float16")

#: A sampling temperature below this, with a group-relative estimator (GRPO, RLOO, ...), is warned about: the
#: responses of a prompt then come out (nearly) all the same, their rewards equal, their advantages zero, and the
#: run learns (nearly) nothing. A warning, not an error: a sharp model may still differ at this temperature.
GROUP_TEMPERATURE_WARN = 0.05
#: Pipelines whose training does not use the estimator's advantages (roll.collectors names).
_NOT_RL_PIPELINES = ("sft", "dpo", "distill", "distill_offline", "rollout")


@dataclass
class TrainEngineConfig:
    """Keys every training engine shares: workers, micro-batching, master-weight dtype, LoRA. Engines extend this
    schema (roll_engines.config) with their own knobs; the pipeline reads these fields, typed, and passes the
    config's keys (less roll_core.cluster.engine_worker.WORKER_KEYS) with the run's keys (roll_core.interfaces.
    TrainEngineRuntime) to the engine's constructor. Model-parallel sizes are engine knobs (only sharded engines
    have them); the pipeline reads them through `parallel_sizes()`."""

    _target_: str = MISSING
    name: str = MISSING
    # Worker processes (ranks) of each training role; the data-parallel size is world_size / model-parallel size.
    world_size: int = 1
    # Rows per forward/backward (gradient accumulation splits mini-batches into these), whatever their lengths.
    micro_batch_size: int = 4
    # Token budget per micro-batch (verl's dynamic batch size): 0 cuts micro_batch_size rows; N > 0 cuts micro-batches
    # of at most N attended tokens (attention_mask sum; a longer row alone; a prompt's rows together when packing),
    # so short rows share a pass and long ones do not run out of memory. Gradients are the same either way.
    micro_batch_tokens: int = 0
    # Rows per no-grad forward when scoring log-probs / values.
    logprob_chunk_size: int = 8
    # Run micro-batches packed: a prompt shared by several rows (a GRPO group) computed once, responses follow it
    # without padding under a block attention mask (same log-probs and gradients up to float summation order);
    # models that cannot take a 4D mask (e.g. flash_attention_2) fall back to the padded forward.
    pack_sequences: bool = True
    # torch threads per worker process; null: all cores.
    num_threads: int | None = None
    # dtype of the trained parameters and optimizer state (master weights); model.dtype is the compute dtype.
    param_dtype: str = "float32"
    # LoRA rank of the policy's adapters; 0 trains every weight (the other lora_* keys are then ignored: warned about
    # when set off their defaults). With LoRA the reference policy is the base model with adapters disabled (no
    # second copy) and weight sync sends merged weights.
    lora_rank: int = 0
    # LoRA scaling numerator (the update is alpha / rank * B @ A).
    lora_alpha: float = 16.0
    # Must stay 0 with LoRA: a training forward must compute the log-probs its scoring passes did (the PPO ratio
    # of unchanged weights is exactly 1), and dropout noise would move it (the engines run every dropout at 0).
    lora_dropout: float = 0.0
    # Modules that get adapters: "all-linear" (every linear layer except the output head) or the engine's names.
    lora_target_modules: Any = "all-linear"

    def __post_init__(self) -> None:
        positive(f"train_engine.world_size ({self.name})", self.world_size)
        if self.micro_batch_size < 1 or self.logprob_chunk_size < 1:
            raise ValueError("train_engine.micro_batch_size and logprob_chunk_size must be >= 1")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"train_engine.micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0: off)")
        if self.lora_rank < 0 or (self.lora_rank and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0)):
            raise ValueError("train_engine.lora_rank must be >= 0 and lora_alpha a finite number > 0")
        if not 0 <= self.lora_dropout < 1:  # NaN fails too
            raise ValueError(f"train_engine.lora_dropout={self.lora_dropout} must be in [0, 1)")
        if self.lora_rank and self.lora_dropout:
            raise ValueError(
                f"train_engine.lora_dropout={self.lora_dropout}: roll trains LoRA without dropout (the log-probs a "
                "step trains on must be those its scoring passes computed; dropout noise moves the PPO ratio of "
                "unchanged weights off 1): set train_engine.lora_dropout=0"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"train_engine.num_threads={self.num_threads} must be >= 1 (or null: all cores)")

    def check_model(self, model_path: str) -> None:
        """Raise ConfigError for a model this engine cannot train, judged from the local model folder `model_path`'s
        config.json alone (no weights). The pipeline calls it for every model a training-side role will load, before
        the cluster starts or any worker spawns (roll_core.pipelines.wiring.check_train_models); a model that is not
        a local folder (a hub id) is not read there, and the engine checks it when it loads. The default refuses
        nothing: engines that train any transformers model keep it."""

    def parallel_sizes(self) -> dict[str, int]:
        """Model-parallel sizes of one replica (`tp`, `pp`, `cp`; roll_core.cluster.mesh.Mesh.for_world): data is
        split by data-parallel rank only. 1 each for engines that do not shard the model; sharded engines
        override it from their own knobs."""
        return {"tp": 1, "pp": 1, "cp": 1}


@dataclass
class InferEngineConfig:
    """Keys every inference engine shares: sampling, workers, weight sync, sleep. Engines extend this schema
    (roll_engines.config) with their own knobs; keys in roll_core.cluster.engine_worker.WORKER_KEYS configure the worker
    and are not passed to the engine."""

    _target_: str = MISSING
    name: str = MISSING
    # Engine workers (data-parallel replicas); each may span several devices (tensor_parallel_size).
    world_size: int = 1
    # Sampling temperature (>= GREEDY_TEMPERATURE, 1e-5, for RL: the trainer's log-probs divide by it).
    temperature: float = 1.0
    # Nucleus sampling mass; 1 disables. Log-probs are then those of the truncated distribution.
    top_p: float = 1.0
    # Top-k sampling; 0 disables.
    top_k: int = 0
    # Extra stop strings (EOS always stops); the completing token is kept.
    stop: list[str] = field(default_factory=list)
    # Structured outputs: every rollout constrained by {json_schema: <schema>} or {regex: <pattern>} (hf, vLLM,
    # SGLang); the trainer recomputes log-probs of the same constrained distribution (hf, fsdp2 train engines).
    # {}: unconstrained. Launch: +infer_engine.structured.regex='[0-9]+'
    structured: dict[str, Any] = field(default_factory=dict)
    # Most sequences decoded together; requests beyond it wait for a free slot (vLLM max_num_seqs, SGLang
    # max_running_requests). null: the engine's own choice (engines that need a number set their default).
    max_num_seqs: int | None = None
    # Context limit (prompt + response tokens; vLLM max_model_len, SGLang context_length); null: the model's.
    max_model_len: int | None = None
    # Weight sync: auto | inprocess | object_store | dist | cuda_ipc (roll_core.cluster.weight_sync).
    sync_transport: str = "auto"
    # Weight sync bucket size in MiB (one flattened buffer per bucket; 32 measured faster than 256 on CPU).
    sync_bucket_mb: float = 32.0
    # Seconds a `dist` weight sync's collective group waits for a member (rendezvous, every broadcast) before it
    # fails the sync, on the trainer and the engines alike (gloo, NCCL and HCCL). A trainer or engine that died
    # mid-sync is noticed after this long; raise it only where one bucket can take longer to move.
    sync_timeout_s: float = 600.0
    # Colocated engines sleep while the trainer runs: 0 never, 1 free the KV cache (offload weights on devices),
    # 2 also discard weights (the next sync sends all of them). null: resolve_sleep_level decides from the run
    # (1 when colocated on an accelerator and synchronous, else 0).
    sleep_level: int | None = 0
    # Python executable of the engine's own virtual environment (Ray runtime_env py_executable); null: this one.
    python: str | None = None
    # Concurrent calls one engine actor serves (request API); null: the requests a step can have in flight on it,
    # plus room for aborts and weight syncs, at least 64 (roll_core.pipelines.wiring.request_concurrency).
    max_concurrency: int | None = None
    # Weights dtype of the inference engine: null (model.dtype) | auto | float32 | bfloat16 | float16. Training
    # keeps its own dtypes (model.dtype compute, train_engine.param_dtype master weights); synced weights are cast.
    dtype: str | None = None
    # LoRA runs (train_engine.lora_rank > 0): what a weight sync sends. merged: W + scaling * B @ A under the base's
    # names (every engine). adapter: the adapter alone, served by the engine as a LoRA adapter on the base it loaded
    # once (infer_engine=vllm; bench/RESULTS.md compares the two).
    lora_sync: str = "merged"

    def __post_init__(self) -> None:
        positive(f"infer_engine.world_size ({self.name})", self.world_size)
        if self.max_concurrency is not None and self.max_concurrency < 1:  # 0 became the default 64, silently
            raise ValueError(f"infer_engine.max_concurrency={self.max_concurrency} must be >= 1 (or null: a default)")
        if self.dtype is not None:
            one_of("infer_engine.dtype", self.dtype, DTYPES)
        from roll_core.interfaces.inference import GREEDY_TEMPERATURE

        # The trainer divides logits by this temperature: one below GREEDY_TEMPERATURE is greedy in the engines
        # (whose log-probs are then log_softmax(logits)) yet would be a huge divisor in the trainer.
        if not (math.isfinite(self.temperature) and self.temperature >= GREEDY_TEMPERATURE):
            raise ValueError(
                f"infer_engine.temperature={self.temperature} must be > 0 for RL sampling, at least "
                f"{GREEDY_TEMPERATURE} (below it engines decode greedily; greedy decoding is for evaluation: "
                "pipeline.eval_temperature)"
            )
        if any(not s for s in self.stop):  # matched nowhere (the hf engine dropped it), yet refused partial_rollout
            raise ValueError(
                f"infer_engine.stop={list(self.stop)!r} holds an empty string, which is no stop string: remove it "
                "(EOS always stops; infer_engine.stop=[] for none)"
            )
        if self.structured:
            from roll_core.interfaces.inference import StructuredOutput

            try:
                StructuredOutput.from_dict(dict(self.structured))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"infer_engine.structured: {exc}") from exc
        if not 0 < self.top_p <= 1:
            raise ValueError(f"infer_engine.top_p={self.top_p} must be in (0, 1]")
        positive("infer_engine.top_k", self.top_k, allow_zero=True)
        from roll_core.cluster.weight_sync import TRANSPORTS

        one_of("infer_engine.sync_transport", self.sync_transport, TRANSPORTS)
        one_of("infer_engine.lora_sync", self.lora_sync, ("merged", "adapter"))
        positive("infer_engine.sync_bucket_mb", self.sync_bucket_mb)
        positive("infer_engine.sync_timeout_s", self.sync_timeout_s)
        if self.sleep_level is not None:  # null: resolved with the run (resolve_sleep_level)
            one_of("infer_engine.sleep_level", self.sleep_level, (0, 1, 2))
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"infer_engine.max_num_seqs={self.max_num_seqs} must be >= 1 (or null: the engine's)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"infer_engine.max_model_len={self.max_model_len} must be >= 1 (or null: the model's)")

    def devices_per_worker(self) -> int:
        """Devices one engine worker spans (its placement bundle): 1, or the engine's tensor-parallel size."""
        return 1

    def resolve_run_defaults(self, *, colocated: bool, accelerator: Callable[[], bool], async_rollout: bool) -> None:
        """Fill the null defaults that depend on the run (placement, device, async) in place; engines extend it.

        Args:
            colocated: the engine shares its devices with the trainer (cluster.placement=colocated).
            accelerator: whether the engine runs on an accelerator (called only when a default needs it).
            async_rollout: pipeline.async_ratio > 0 (engines generate while the trainer trains).
        """
        self.sleep_level = resolve_sleep_level(
            self.sleep_level, colocated=colocated, accelerator=accelerator, async_rollout=async_rollout
        )


#: LoRA keys that only `train_engine.lora_rank > 0` reads (`warn_ignored_lora_keys`).
LORA_KEYS = ("lora_alpha", "lora_dropout", "lora_target_modules")


def warn_ignored_lora_keys(train_engine: Any) -> list[str]:
    """Log one warning (and return the keys) when `LORA_KEYS` are set off their engine's defaults while
    `train_engine.lora_rank=0`: the run fine-tunes every weight and ignores them, so a run meant to train adapters
    on those targets trained the full model without a word. A warning, not an error: a sweep over lora_rank=0,8
    sharing its targets is legitimate. Called by the root config once per composition (not in `__post_init__`: the
    wiring copies the policy's config with lora_rank=0 for the reference and critic)."""
    if not isinstance(train_engine, TrainEngineConfig) or train_engine.lora_rank:
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(train_engine) if f.name in LORA_KEYS}
    ignored = [
        k
        for k in LORA_KEYS
        if defaults.get(k, dataclasses.MISSING) is not dataclasses.MISSING and getattr(train_engine, k) != defaults[k]
    ]
    if ignored:
        logging.getLogger(__name__).warning(
            "train_engine.lora_rank=0 fine-tunes every weight: %s %s ignored; set train_engine.lora_rank > 0 to "
            "train LoRA adapters",
            ", ".join(f"train_engine.{k}={getattr(train_engine, k)!r}" for k in ignored),
            "is" if len(ignored) == 1 else "are",
        )
    return ignored


def warn_low_group_temperature(temperature: float, estimator: str, group_size: int, pipeline: str) -> bool:
    """Log a warning (and return True) when RL sampling at `temperature` (infer_engine.temperature) is below
    GROUP_TEMPERATURE_WARN while a group-relative estimator (`estimator`, roll_core.config.algo.GROUP_ESTIMATORS)
    compares `group_size` > 1 responses per prompt: near-greedy samples of one prompt are identical, so every
    group's advantages are zero. Only exactly-greedy temperatures are refused (InferEngineConfig)."""
    from roll_core.config.algo import GROUP_ESTIMATORS

    if pipeline in _NOT_RL_PIPELINES or estimator not in GROUP_ESTIMATORS or group_size < 2:
        return False
    if temperature >= GROUP_TEMPERATURE_WARN:
        return False
    logging.getLogger(__name__).warning(
        "infer_engine.temperature=%g with algo.adv_estimator=%s (group_size=%d): below %g the %d responses of a "
        "prompt come out nearly identical, so their rewards are equal and their group-relative advantages zero (no "
        "learning signal); sample at a higher temperature (e.g. 0.6-1.0)",
        temperature,
        estimator,
        group_size,
        GROUP_TEMPERATURE_WARN,
        group_size,
    )
    return True


def resolve_sleep_level(
    value: int | None, *, colocated: bool, accelerator: bool | Callable[[], bool], async_rollout: bool
) -> int:
    """`infer_engine.sleep_level`, with null resolved: 1 when the engine shares an accelerator with the trainer in
    a synchronous run (its KV cache and weights would otherwise hold device memory the trainer needs), else 0
    (disaggregated engines own their devices; on CPU there is nothing to free; an asynchronous run keeps the
    engines generating while the trainer trains). An explicit value is kept."""
    if value is not None:
        return int(value)
    if not colocated or async_rollout:
        return 0
    return int(bool(accelerator() if callable(accelerator) else accelerator))


def refuse_sleeping_engines(async_ratio: int, sleep_level: int | None) -> None:
    """ConfigError for engines that sleep while the trainer trains (infer_engine.sleep_level > 0) in an asynchronous
    run (pipeline.async_ratio > 0), which keeps them generating meanwhile. A null level is left alone:
    resolve_sleep_level makes it 0 for an asynchronous run."""
    if async_ratio and sleep_level:
        from roll_core.errors import ConfigError

        raise ConfigError(
            f"pipeline.async_ratio={async_ratio} keeps the engines generating while the trainer trains: "
            f"set infer_engine.sleep_level=0 (it is {sleep_level})"
        )


def _platform_is_accelerator(hw: Any) -> bool:
    """True when the run's platform (hw.platform, or the one detected here for auto) drives a device."""
    from roll_hw import get_platform_class, resolve_platform

    name = getattr(hw, "platform", "auto")
    platform = resolve_platform() if name in (None, "auto") else get_platform_class(name)
    return platform.device_type != "cpu"
