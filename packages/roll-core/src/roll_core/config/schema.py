"""Structured-config schemas owned by roll-core: algorithm, model, hardware, cluster, pipeline and the root.

Contract: each schema is a dataclass registered in Hydra's ConfigStore by `register_configs()`; the YAML under
`roll_core/conf` extends these schemas, so an unknown key or a wrong type fails at composition with the key's name.
Invariants live in `__post_init__` and say how to fix the value. Engine and environment schemas live in the
packages that implement them (roll-engines, roll-envs) and register through their own `roll.configs` entry
points; the root types the engine groups by their shared bases (`TrainEngineConfig`, `InferEngineConfig`), which
any installed engine's schema extends, and the env group as `Any`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from roll_core.config.algo import AlgoConfig, algo_choices
from roll_core.config.checks import one_of, positive, positive_or_null
from roll_core.config.engines import (
    DTYPES,
    InferEngineConfig,
    TrainEngineConfig,
    _platform_is_accelerator,
    refuse_sleeping_engines,
    resolve_sleep_level,
    warn_ignored_lora_keys,
    warn_low_group_temperature,
)
from roll_core.config.generation import GenerationConfig, check_stop_tokens
from roll_core.config.posttrain import DistillConfig, DPOConfig, RolloutConfig, SFTConfig
from roll_core.config.reward_model import RewardModelConfig
from roll_core.config.tracking import TrackingConfig
from roll_core.posttrain.config import DataConfig

# With the schemas below; AlgoConfig lives in roll_core.config.algo, the engine bases in roll_core.config.engines.
__all__ = [
    "DTYPES",
    "AlgoConfig",
    "InferEngineConfig",
    "TrainEngineConfig",
    "algo_choices",
    "resolve_sleep_level",
]


@dataclass
class ModelConfig:
    """Which model to post-train; engines load it with transformers."""

    # Display name.
    name: str = MISSING
    # HF folder or hub id; "builtin:<name>" resolves through roll_engines' model provisioning (GGUF presets).
    path: str = MISSING
    # Tokenizer folder or id; null uses `path`.
    tokenizer: str | None = None
    # Weights dtype: auto | float32 | bfloat16 | float16 (auto: bf16 where the platform runs it fast, else fp32).
    dtype: str = "float32"
    # Passed to transformers' from_pretrained.
    trust_remote_code: bool = False
    # attn_implementation for transformers (sdpa, eager, flash_attention_2).
    attn_implementation: str = "sdpa"
    # Maximum prompt tokens; longer prompts are skipped and counted.
    max_prompt_length: int = 256
    # Maximum generated tokens per sample.
    max_response_length: int = 128
    # The family's published sampling defaults; infer_engine.temperature/top_p/top_k default to them
    # (roll_core.config.generation). Presets set them from the model card.
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # End-of-turn tokens every infer engine stops on besides the checkpoint's eos, e.g. ['<|eot_id|>'].
    stop_tokens: list[str] = field(default_factory=list)
    # Passed to every chat-template rendering of the policy's prompts, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Vision-language models with dynamic resolution (Qwen-VL): the least area in pixels a picture is resized to (a
    # picture takes area / 28^2 tokens, Qwen3-VL area / 32^2); null keeps the model folder's image processor's own.
    # The prompt builder, vLLM and the checkpoint's saved processor all use it (roll_core.multimodal.processor).
    image_min_pixels: int | None = None
    # The largest area in pixels a picture is resized to (caps its tokens at area / 28^2), same rules; null keeps
    # the folder's own (Qwen2.5-VL's: 12845056 pixels, ~16k tokens a picture).
    image_max_pixels: int | None = None

    def __post_init__(self) -> None:
        check_stop_tokens(self.stop_tokens)
        one_of("model.dtype", self.dtype, DTYPES)
        positive("model.max_prompt_length", self.max_prompt_length)
        positive("model.max_response_length", self.max_response_length)
        positive_or_null("model.image_min_pixels", self.image_min_pixels)
        positive_or_null("model.image_max_pixels", self.image_max_pixels)
        low, high = self.image_min_pixels, self.image_max_pixels
        if low is not None and high is not None and low > high:
            raise ValueError(f"model.image_min_pixels={low} is above model.image_max_pixels={high}")


@dataclass
class HwConfig:
    """Which hardware platform to run on."""

    # Platform name (cpu, cuda, rocm, npu, or a plugin's); auto detects. ROLL_PLATFORM overrides auto.
    platform: str = "auto"

    def __post_init__(self) -> None:
        if self.platform != "auto":
            from roll_hw import platform_names

            names = platform_names()
            if self.platform not in names:
                raise ValueError(f"hw.platform={self.platform!r} is not installed; installed: {', '.join(names)}")


@dataclass
class ClusterConfig:
    """Where workers run: in-process (local), a Ray instance started here, or an existing Ray cluster."""

    # local: every role in this process (debuggable, no Ray) | ray: Ray actors.
    backend: str = "local"
    # Ray address: null starts a local instance; "auto" or "ray://host:port" joins an existing cluster.
    address: str | None = None
    # CPUs for a Ray instance started here (null: all cores).
    num_cpus: int | None = None
    # Custom resources for a Ray instance started here, e.g. {GPU: 2} for tests.
    resources: dict[str, float] = field(default_factory=dict)
    # colocated: roles time-share the same devices | disaggregated: each role gets its own devices.
    placement: str = "colocated"
    # Fraction of a CPU each Ray worker reserves (roles are cheap to schedule; CPU threads are set separately).
    cpus_per_worker: float = 0.5
    # Ray namespace for this run's actors.
    namespace: str = "roll"
    # Keep Ray's token authentication on a local instance roll starts (RAY_AUTH_MODE in the environment wins).
    ray_token_auth: bool = True
    # Seconds to wait for a role's placement group, and then for its workers to start, before failing with what
    # the cluster lacks.
    placement_timeout_s: float = 600.0
    # Sweeps: jobs of one multirun that may run at once on the Ray cluster (0: no bound; others queue).
    max_concurrent: int = 1
    # Placement-group strategy: PACK (fill a node first, may span nodes) | SPREAD | STRICT_PACK | STRICT_SPREAD.
    strategy: str = "PACK"
    # Seconds a call to a Ray worker may take, counted from its submission, before it fails with an error naming
    # role, method and timeout (a restartable role's stuck worker is restarted instead); 0: no limit. The local
    # backend runs calls in this process and cannot time them out.
    call_timeout_s: float = 3600.0
    # Per-role overrides of call_timeout_s, e.g. {reward: 600, actor_infer: 1800}; 0: no limit for that role.
    call_timeouts: dict[str, float] = field(default_factory=dict)
    # Worker restarts allowed per restartable role (actor_infer, reward) per run: a worker that died or hung is
    # re-created in its placement bundle, an inference engine gets the trainer's latest weights (a full sync),
    # and the failed call is retried on it (counted in faults/restarts). 0: a dead worker ends the run.
    max_restarts: int = 3
    # On Ray, check before training that every node whose trainer ranks write checkpoint shards into the run folder
    # sees the driver's folder (a marker file; roll_core.cluster.shared_fs). false: for per-node folders the user
    # gathers into one before resuming.
    check_shared_fs: bool = True

    def __post_init__(self) -> None:
        one_of("cluster.backend", self.backend, ("local", "ray"))
        one_of("cluster.placement", self.placement, ("colocated", "disaggregated"))
        if self.backend == "local" and self.address is not None:
            raise ValueError("cluster.address is set but cluster.backend=local: use cluster=ray to join a cluster")
        # Ray refused a negative count with a traceback from its raylet, and 0 meant all cores (null's meaning).
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"cluster.num_cpus={self.num_cpus} must be >= 1 (or null: all cores)")
        for name, amount in self.resources.items():
            positive(f"cluster.resources.{name}", amount, allow_zero=True)
        # Here, not only where Ray starts: `--cfg job` then refuses them too (it printed them as fine).
        reserved = sorted(set(self.resources) & {"CPU", "memory", "object_store_memory"})
        if reserved:
            raise ValueError(
                f"cluster.resources.{reserved[0]}: Ray counts {reserved[0]} itself, not as a custom resource"
                + (": set cluster.num_cpus" if reserved[0] == "CPU" else "")
            )
        gpus = self.resources.get("GPU", 0.0)
        if gpus != int(gpus):  # Ray takes GPUs as a count of its own (num_gpus)
            raise ValueError(f"cluster.resources.GPU={gpus:g}: a Ray instance holds a whole number of GPUs")
        positive("cluster.cpus_per_worker", self.cpus_per_worker, allow_zero=True)
        positive("cluster.placement_timeout_s", self.placement_timeout_s)
        positive("cluster.max_concurrent", self.max_concurrent, allow_zero=True)
        one_of("cluster.strategy", self.strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
        positive("cluster.call_timeout_s", self.call_timeout_s, allow_zero=True)
        for role, t in self.call_timeouts.items():
            _check_role(role)
            positive(f"cluster.call_timeouts.{role}", t, allow_zero=True)
        positive("cluster.max_restarts", self.max_restarts, allow_zero=True)

    def timeout_for(self, role: str) -> float | None:
        """The call timeout of `role` in seconds (None: no limit)."""
        t = self.call_timeouts.get(role, self.call_timeout_s)
        return float(t) if t else None


#: Roles a run's worker groups are named by (cluster.call_timeouts keys), besides critic_<n> and teacher_<name>.
ROLE_NAMES = ("actor_train", "actor_infer", "reference", "critic", "reward", "reward_model", "env")


def _check_role(role: str) -> None:
    """A misspelt role (`rewards`) would leave the real one at the default timeout, silently."""
    import difflib
    import re

    if role in ROLE_NAMES or re.fullmatch(r"critic_\d+|teacher_\w+", role):
        return
    close = difflib.get_close_matches(role, ROLE_NAMES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(
        f"cluster.call_timeouts.{role}: no role is named {role!r}{hint}; roles: {', '.join(ROLE_NAMES)}, "
        "critic_<n>, teacher_<name>"
    )


@dataclass
class PipelineConfig:
    """Run control of the RLVR pipeline."""

    # Pipeline kind: rlvr (single-turn prompts, a reward role) | agentic (multi-turn episodes with an env group
    # such as env=sokoban).
    name: str = "rlvr"
    # Training steps (one rollout batch each).
    max_steps: int = 20
    # Prompts per step; each is sampled algo.group_size times.
    rollout_batch_size: int = 8
    # Evaluate held-out accuracy every N steps (0: never; the first and last steps are always evaluated if > 0).
    eval_every: int = 5
    # Held-out prompts per evaluation.
    eval_size: int = 64
    # Save a checkpoint every N steps (0: only at the end).
    save_every: int = 0
    # Checkpoints to keep (older ones are deleted after a new one is complete).
    keep_last: int = 2
    # Global seed (data order, sampling, init of new heads).
    seed: int = 42
    # Output folder; null: Hydra's run folder (or ./outputs/<timestamp> without Hydra).
    output_dir: str | None = None
    # Continue from the latest checkpoint in output_dir, or else from the latest run of this experiment next to it
    # (each launch gets a fresh Hydra folder); the log names the run and step.
    resume: bool = False
    # Continue this run folder (or checkpoint folder .../checkpoints/step_N) instead; null: see `resume`.
    resume_from: str | None = None
    # A fault roll cannot repair in place (a trainer rank died or hung, or a role ran out of cluster.max_restarts)
    # restarts the whole run from its latest checkpoint this many times (the steps since it are redone; counted in
    # faults/run_restarts). Without a checkpoint yet the fault ends the run (pipeline.save_every=N). 0: never.
    max_run_restarts: int = 2
    # Show a progress bar on a terminal; elsewhere (a log file: nohup, Slurm, a Ray job), and when false, each step is
    # one log line with the same fields instead.
    progress: bool = True
    # Metrics sinks besides metrics.jsonl, all written at once (`roll.trackers` entry points: tensorboard, wandb, jsonl,
    # plugins); [] or [jsonl]: only the run folder's files. Each one's options: the `tracking` node.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    # Sampling temperature of held-out evaluation (0: greedy); null: the inference engine's temperature.
    eval_temperature: float | None = None
    # Reward worker processes (reward scoring is CPU work; more workers overlap it).
    reward_workers: int = 1
    # Seconds one response may take to score before it is cut off, scored reward_error_score and counted in
    # reward/timeouts (applies when a batch failed and is rescored row by row; roll_core.cluster.reward_guard).
    reward_timeout_s: float = 30.0
    # Seconds one reward worker's whole batch may take before it is rescored row by row (that pass stops after 3 row
    # timeouts in a row, and after this plus 3 x reward_timeout_s: a reward that always hangs is not waited on row by
    # row).
    reward_batch_timeout_s: float = 300.0
    # Score of a response whose reward raised (reward/errors), hung (reward/timeouts) or was NaN/inf
    # (reward/nonfinite); the run goes on.
    reward_error_score: float = 0.0
    # process: the reward runs in a forked child of its worker, so a hang can be cut off | inline: in the worker
    # itself (rewards that need a CUDA context made before a fork); errors and NaN are handled, hangs are not.
    reward_isolation: str = "process"
    # Stop the run after this many consecutive steps whose loss or gradient was NaN/inf (each such optimizer step
    # is skipped, the LR schedule does not advance; counted in actor/nonfinite_steps). 0: never stop.
    max_nonfinite_steps: int = 3
    # Stop the run after this many optimizer steps in a row that fp16's loss scaler skipped for an overflowing
    # gradient (model.dtype=float16; counted in actor/scaler_skipped_steps). Each skip halves the scale: 32 in a row
    # take it from 2^16 to 2^-16, a gradient no fp16 scale holds (every later step would be skipped). 0: never stop.
    max_loss_scale_skips: int = 32
    # Stop the run after this many consecutive steps whose reward failed on every row (raised, timed out or NaN/inf:
    # nothing to learn from; counted in reward/failed_rows, totals in the run summary). 0: never stop.
    max_reward_failure_steps: int = 3
    # Stop the run after this many consecutive steps that trained nothing: the collector returned no batch (every
    # episode dropped or aborted, every prompt group filtered out, ...; each such step is warned about with its
    # reason and counted in data/empty_steps, the total in the run summary's empty_steps). Steps without a batch by
    # design (pipeline=rollout) never count. 0: never stop.
    max_empty_steps: int = 5
    # Asynchronous training: rollout runs up to this many batches ahead of the trainer, and no trained sample is
    # older than this many weight versions (0: the synchronous loop). Needs a continuous-batching engine that
    # stays awake (infer_engine.sleep_level=0); off-policy correction: algo.off_policy_correction.
    async_ratio: int = 0
    # With async_ratio > 0: at each weight sync, running requests are aborted and resumed under the new weights
    # with their generated prefix (and its behaviour log-probs) kept.
    partial_rollout: bool = False
    # With async_ratio > 0 (pipeline=rlvr): extra groups kept in flight so a batch never waits for the longest
    # responses; the slowest ones are carried into later batches (tail batching), and groups that become older than
    # the bound are dropped (wasted tokens, a bias toward short responses; 0 keeps start order: nothing dropped).
    tail_groups: int = 0
    # With async_ratio > 0: seconds the trainer waits for a batch before the run fails with an error naming what
    # still runs (a hung inference engine).
    async_batch_timeout_s: float = 3600.0
    # With async_ratio > 0: seconds a request the rollout aborted (partial rollout at a weight sync, a stale group's)
    # may take to bring its partial result (pipeline=agent: a request whose episode's session closed, then given up
    # and its agent answered 410). Past it, or when reading the result raises, the request is lost
    # (async/unanswered_aborts, async/failed_aborts, warned) and its sample or turn resumes with its earlier prefix:
    # a sync goes on instead of waiting on an engine that does not answer.
    async_abort_timeout_s: float = 60.0
    # Every pipeline, sync or async (roll_core.idle_aborts): the engine's own aborts of one request in a row, none
    # with a token, after which it is refused (SGLang aborts a prompt longer than its KV cache holds); fewer are
    # preemptions and it resumes. Refused: RLVR's async rollout fails; a sync RLVR row is left out (training: with
    # its group; evaluation, roll-eval: counted wrong; pipeline=rollout: not written); an agentic turn ends its
    # episode untrained; an agent endpoint's turn gets HTTP 503. Default: roll_core.idle_aborts.MAX_IDLE_ABORTS.
    max_idle_aborts: int = 8
    # With async_ratio > 0 (pipeline=agentic) and partial_rollout=false: seconds a weight sync waits for the running
    # turns to finish before the run fails naming them (with partial rollout they are aborted instead).
    agentic_sync_wait_s: float = 600.0

    def __post_init__(self) -> None:
        from roll_core import registry  # the installed collectors: rlvr, agentic, plugins

        one_of("pipeline.name", self.name, tuple(registry.available("roll.collectors")))
        for tracker in self.trackers:
            try:  # registry.load's error lists the installed trackers and suggests a close name
                registry.load("roll.trackers", tracker)
                continue
            except registry.PluginError as exc:
                problem = str(exc)
            # Raised outside the handler: a chained cause would repeat the message in the config error.
            raise ValueError(f"pipeline.trackers={list(self.trackers)!r}: {problem}")
        twice = sorted({t for t in self.trackers if list(self.trackers).count(t) > 1})
        if twice:  # (the tracker refuses it too, but only once the run has built its task and tokenizer)
            raise ValueError(f"pipeline.trackers={list(self.trackers)!r} names {', '.join(twice)} twice")
        positive("pipeline.async_ratio", self.async_ratio, allow_zero=True)
        positive("pipeline.max_nonfinite_steps", self.max_nonfinite_steps, allow_zero=True)
        positive("pipeline.max_loss_scale_skips", self.max_loss_scale_skips, allow_zero=True)
        positive("pipeline.max_reward_failure_steps", self.max_reward_failure_steps, allow_zero=True)
        positive("pipeline.max_empty_steps", self.max_empty_steps, allow_zero=True)
        positive("pipeline.max_run_restarts", self.max_run_restarts, allow_zero=True)
        positive("pipeline.tail_groups", self.tail_groups, allow_zero=True)
        positive("pipeline.async_batch_timeout_s", self.async_batch_timeout_s)
        positive("pipeline.async_abort_timeout_s", self.async_abort_timeout_s)
        if self.max_idle_aborts < 1:  # (an integer: the merge refuses 2.5, nan, true)
            raise ValueError(
                f"pipeline.max_idle_aborts={self.max_idle_aborts} must be >= 1 (the engine's aborts of a sample in a "
                "row, none with a token, before it counts as refused)"
            )
        positive("pipeline.agentic_sync_wait_s", self.agentic_sync_wait_s)
        if self.async_ratio == 0 and (self.partial_rollout or self.tail_groups):
            raise ValueError(
                "pipeline.partial_rollout and pipeline.tail_groups need asynchronous training: set "
                "pipeline.async_ratio >= 1 (samples carried across a weight update are one version old)"
            )
        positive("pipeline.max_steps", self.max_steps)
        positive("pipeline.rollout_batch_size", self.rollout_batch_size)
        positive("pipeline.eval_every", self.eval_every, allow_zero=True)
        # A negative size would slice the held-out list from its end (eval_size=-1 drops one problem, silently).
        positive("pipeline.eval_size", self.eval_size, allow_zero=True)
        if self.eval_temperature is not None:
            positive("pipeline.eval_temperature", self.eval_temperature, allow_zero=True)
        positive("pipeline.save_every", self.save_every, allow_zero=True)
        positive("pipeline.keep_last", self.keep_last)
        positive("pipeline.reward_workers", self.reward_workers)
        positive("pipeline.reward_timeout_s", self.reward_timeout_s)
        if not math.isfinite(self.reward_error_score):  # refused by the reward workers otherwise, at their start
            raise ValueError(f"pipeline.reward_error_score={self.reward_error_score} must be a finite number")
        positive("pipeline.reward_batch_timeout_s", self.reward_batch_timeout_s)
        one_of("pipeline.reward_isolation", self.reward_isolation, ("process", "inline"))

    def reward_guard(self) -> dict[str, Any]:
        """Keyword arguments of roll_core.cluster.reward_guard.GuardedReward."""
        return {
            "timeout_s": self.reward_timeout_s,
            "batch_timeout_s": self.reward_batch_timeout_s,
            "error_score": self.reward_error_score,
            "isolation": self.reward_isolation,
        }


@dataclass
class RLVRConfig:
    """Root of an RLVR run. Engine groups are typed by their shared bases and env as `Any`: the schemas that fill
    them come from their packages."""

    defaults: list[Any] = field(default_factory=list)
    # Experiment name (used in output paths and trackers).
    experiment: str = "rlvr"
    model: ModelConfig = MISSING
    algo: AlgoConfig = MISSING
    train_engine: TrainEngineConfig = MISSING
    infer_engine: InferEngineConfig = MISSING
    env: Any = MISSING
    hw: HwConfig = field(default_factory=HwConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # A reward model scoring (prompt, response) rows (roll_core.config.reward_model); none by default.
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # Post-training beside RL (roll_core.config.posttrain), each read only by its pipeline; `data`: the row files
    # of the file-fed ones (sft, dpo, distill_offline; roll_core.posttrain.config).
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Tracker options (roll_core.config.tracking): run name, sweep group, each backend's settings; which backends
    # run is pipeline.trackers.
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        """Invariants across groups (each group checks its own): caught at composition, not steps into a run."""
        algo, model, pipe = self.algo, self.model, self.pipeline
        if not (isinstance(algo, AlgoConfig) and isinstance(model, ModelConfig) and isinstance(pipe, PipelineConfig)):
            return  # a partial config (schema defaults, tools that build pieces): nothing to compare yet
        if isinstance(self.infer_engine, InferEngineConfig) and isinstance(self.cluster, ClusterConfig):
            # Defaults that depend on placement and device (sleep_level, SGLang's memory fraction) are fixed here,
            # so every reader of the typed config (pipelines, the saved config.yaml) sees the value used.
            self.infer_engine.resolve_run_defaults(
                colocated=self.cluster.placement == "colocated",
                accelerator=lambda: _platform_is_accelerator(self.hw),
                async_rollout=pipe.async_ratio > 0,
            )
            # Settled now (a null level resolved to 0 for an asynchronous run): refused before any engine is built.
            refuse_sleeping_engines(pipe.async_ratio, self.infer_engine.sleep_level)
            warn_low_group_temperature(self.infer_engine.temperature, algo.adv_estimator, algo.group_size, pipe.name)
        warn_ignored_lora_keys(self.train_engine)  # lora_* keys set while lora_rank=0: full fine-tuning ignores them
        if isinstance(self.data, DataConfig) and model.chat_template_kwargs:
            # Rows are rendered as the model's prompts are (qwen3_nothink's enable_thinking=false): SFT otherwise
            # taught the model to write the empty think block that its evaluation prompts already end with.
            # data's own keys win.
            self.data.chat_template_kwargs = {**model.chat_template_kwargs, **self.data.chat_template_kwargs}
        rm = self.reward_model
        if (
            isinstance(rm, RewardModelConfig)
            and rm.enabled
            and rm.placement == "colocated"
            and isinstance(self.cluster, ClusterConfig)
            and self.cluster.placement != "colocated"
        ):
            # (roll_core.cluster.launch refuses it too, once the other roles' models are loaded: here it is before)
            raise ValueError(
                f"reward_model.placement=colocated time-shares the trainer's devices, but cluster.placement="
                f"{self.cluster.placement} gives each role whole devices of its own: use reward_model.placement="
                "disaggregated (or null, which follows cluster.placement), or cluster.placement=colocated"
            )
        if getattr(self.train_engine, "routing_replay", False):
            if not getattr(self.infer_engine, "return_routing", False):
                raise ValueError(
                    "train_engine.routing_replay=true replays the experts the rollout engine chose: set "
                    "infer_engine.return_routing=true (infer_engine=hf records them; infer_engine=vllm on CUDA GPUs)"
                )
            if pipe.name in ("agentic", "agent"):
                # Multi-turn trajectories are assembled from turns without the engine's routing: the first train
                # step would fail after a whole rollout.
                raise ValueError(
                    f"train_engine.routing_replay=true with pipeline={pipe.name}: multi-turn trajectories do not carry "
                    "the rollout engine's routing yet; replay works with the single-turn pipeline (pipeline=rlvr)"
                )
            if pipe.async_ratio > 0:
                raise ValueError(
                    "train_engine.routing_replay=true needs the synchronous pipeline (pipeline.async_ratio=0): "
                    "asynchronous rollouts do not carry the engine's routing"
                )
        if getattr(self.train_engine, "param_dtype", "float32") == "bfloat16" and model.dtype == "float32":
            # hf would autocast to fp32, which torch's CPU and CUDA autocast refuse (it then ran all in bf16).
            raise ValueError(
                "train_engine.param_dtype=bfloat16 with model.dtype=float32: master weights narrower than the "
                "compute dtype; set model.dtype=bfloat16 (pure bf16) or train_engine.param_dtype=float32"
            )
        ie = self.infer_engine
        if (
            algo.off_policy_correction is not None
            and isinstance(ie, InferEngineConfig)
            and (ie.top_p < 1 or ie.top_k > 0)
        ):
            # The engines report the truncated distribution's log-probs, the trainer the full softmax's: every
            # ratio is the kept mass (< 1), so geo_mask masked every sequence and the others down-weighted
            # high-entropy tokens, whatever the weights' agreement.
            raise ValueError(
                f"algo.off_policy_correction={algo.off_policy_correction} with truncated sampling "
                f"(infer_engine.top_p={ie.top_p}, top_k={ie.top_k}, from the model preset's defaults): the "
                "rollout's log-probs are the truncated distribution's, the trainer's the full one's, so every "
                "ratio measures the truncation; sample the full distribution for corrections: "
                "infer_engine.top_p=1 infer_engine.top_k=0"
            )
        if pipe.partial_rollout and isinstance(ie, InferEngineConfig) and (ie.structured or ie.stop):
            # A resumed response is submitted as a new request over prompt + prefix: the engine restarts the
            # grammar (a constrained response came out as a prefix plus a whole new match) and checks stop strings
            # on the continuation alone (one split across the resume point was never seen).
            what = "infer_engine.structured" if ie.structured else "infer_engine.stop"
            raise ValueError(
                f"pipeline.partial_rollout=true cannot resume a response under {what}: the engine would restart "
                "the constraint (or miss a stop string split across the resume point). Use "
                "pipeline.partial_rollout=false (in-flight requests finish under the old weights), or stop_tokens "
                "instead of stop strings"
            )
        if getattr(self.train_engine, "name", None) == "megatron" and model.dtype == "float16":
            # refused at composition too (the engine refuses it): megatron-core's fp16 loss scaling is not driven
            raise ValueError(
                "train_engine=megatron with model.dtype=float16 is not supported: use model.dtype=bfloat16 "
                "(or train_engine=hf / fsdp2 for float16)"
            )
        if algo.attention_credit and getattr(self.train_engine, "name", None) == "megatron":
            raise ValueError(
                f"algo.attention_credit={algo.attention_credit} reads the actor's attention maps, which "
                "train_engine=megatron does not expose: use train_engine=hf or fsdp2, or algo.attention_credit=null"
            )
        if algo.overlong_buffer > model.max_response_length:
            # The DAPO penalty would reach -1 before the response starts: every sample is punished alike.
            raise ValueError(
                f"algo.overlong_buffer={algo.overlong_buffer} exceeds model.max_response_length="
                f"{model.max_response_length}: lower the buffer (a quarter of the response limit is usual) or 0"
            )
        rows = pipe.rollout_batch_size * algo.group_size
        if algo.mini_batch_size and (algo.mini_batch_size > rows or rows % algo.mini_batch_size):
            # rows // mini_batch_size steps would be taken, of other sizes than asked (one step of all the rows for a
            # mini-batch larger than the batch: the PPO ratio is then 1 and clipping never acts)
            raise ValueError(
                f"algo.mini_batch_size={algo.mini_batch_size} does not divide the {rows} samples of a rollout batch "
                f"(pipeline.rollout_batch_size={pipe.rollout_batch_size} x algo.group_size={algo.group_size}): use "
                "a divisor of it, or algo.num_mini_batches"
            )
        if algo.num_mini_batches > rows:
            # More optimizer steps than samples: the extra steps would train on empty mini-batches.
            raise ValueError(
                f"algo.num_mini_batches={algo.num_mini_batches} exceeds the {rows} samples of a rollout batch "
                f"(pipeline.rollout_batch_size={pipe.rollout_batch_size} x algo.group_size={algo.group_size}): "
                "lower it"
            )


def logical_cpus() -> int:
    """Logical CPUs for a Ray instance started here (`${roll_logical_cpus:}`): the CPUs this process may use
    (roll_hw.cpu.usable_cpu_count: its affinity mask capped at its cgroup CPU quota), at least 4. Why not
    `os.cpu_count()`: that is the host's, so a pod limited to 2 CPUs on a 64-core node advertised 64 and Ray
    scheduled 64 CPUs' worth of tasks onto 2. The floor of 4 lets every role's fractional share fit on a small
    machine; torch threads are set per worker (`default_num_threads`), independently of Ray's accounting."""
    from roll_hw.cpu import usable_cpu_count

    return max(usable_cpu_count(), 4)


def register_configs() -> None:
    """Store roll-core's schemas in Hydra's ConfigStore and put its packaged YAML (`roll_core/conf`: the primary
    config and the core groups) on roll's config search path (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from roll_core.config.search_path import PRIMARY_PACKAGE, add_config_package

    add_config_package(PRIMARY_PACKAGE)

    if not OmegaConf.has_resolver("roll_logical_cpus"):
        OmegaConf.register_new_resolver("roll_logical_cpus", logical_cpus)
    cs = ConfigStore.instance()
    cs.store(name="rlvr_schema", node=RLVRConfig)
    cs.store(group="algo", name="algo_schema", node=AlgoConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="hw", name="hw_schema", node=HwConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="pipeline", name="pipeline_schema", node=PipelineConfig)
    cs.store(group="reward_model", name="reward_model_schema", node=RewardModelConfig)
