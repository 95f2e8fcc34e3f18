"""Where a run's roles are wired: every worker group of the training side, built from the typed config.

`build_roles(cfg, cluster, model_path, needs)` is the one place that turns `train_engine`, `infer_engine`, `model`
and `algo` into worker groups: the trainable actor, the inference engines, the reference policy, the critic(s) and
the teachers, as the pipeline's objective needs them (`RoleNeeds`: a rollout-only run has no actor). A
collector adds the roles that feed it (reward workers, environment workers) through the same cluster; nothing
else builds a group. May assume `cfg` passed its schema checks; must not start generation or training.
`check_train_models(cfg, needs)`, called before the cluster starts, has the train engine refuse a model it cannot
train from its config.json.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.cluster.launch import Cluster, resolve_python
from roll_core.cluster.mesh import Mesh
from roll_core.cluster.roles import InferGroup, TrainGroup
from roll_core.config.build import as_dict
from roll_core.config.generation import stop_token_ids
from roll_core.config.lora_sync import adapter_rank
from roll_core.config.schema import RLVRConfig, TrainEngineConfig
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams, UnsupportedSamplingError
from roll_core.interfaces.runtime import InferEngineRuntime, TrainEngineRuntime
from roll_core.pipelines.objectives import RoleNeeds

log = logging.getLogger(__name__)


@dataclass
class Roles:
    """The worker groups of a run's training side (reference and critic only when the algorithm needs them)."""

    #: None in rollout-only runs (nothing trains).
    actor_train: TrainGroup | None
    actor_infer: InferGroup
    reference: TrainGroup | None
    critic: TrainGroup | None
    #: With LoRA the reference policy is the actor's base with adapters disabled: no second model.
    reference_is_base: bool
    #: Rollout sampling; the trainer's log-probs use its temperature.
    sampling: SamplingParams
    #: Optimizer steps of one RL step: ppo_epochs x mini-batches.
    mini_batches: int
    #: Frozen teachers by name (distillation), each scoring tokens with `compute_logprobs`.
    teachers: dict[str, TrainGroup] = field(default_factory=dict)
    #: Every critic (algo.num_critics; AsyPPO's mini-critics), `critic` first; [] without a critic.
    critics: list[TrainGroup] = field(default_factory=list)


def sampling_params(cfg: RLVRConfig, tokenizer: Any = None) -> SamplingParams:
    """The rollout's sampling settings (infer_engine's temperature, top-p/k, stops; the model's response limit and
    stop tokens, looked up in `tokenizer`, loaded from model.tokenizer / model.path when not given)."""
    ie, model = cfg.infer_engine, cfg.model
    stop_ids: tuple[int, ...] = ()
    if model.stop_tokens:
        if tokenizer is None:
            from transformers import AutoTokenizer

            from roll_core.models import resolve_model_path

            tokenizer = AutoTokenizer.from_pretrained(
                model.tokenizer or resolve_model_path(model.path), trust_remote_code=model.trust_remote_code
            )
        stop_ids = stop_token_ids(tokenizer, model.stop_tokens)
    return SamplingParams(
        temperature=float(ie.temperature),
        top_p=float(ie.top_p),
        top_k=int(ie.top_k),
        stop=tuple(ie.stop),
        stop_token_ids=stop_ids,
        max_new_tokens=model.max_response_length,
        structured=dict(ie.structured) or None,
    )


def request_concurrency(cfg: RLVRConfig) -> int:
    """Calls one inference actor serves at once when infer_engine.max_concurrency is null: the requests a step can
    have in flight on it ((async_ratio + 1) x rollout_batch_size x group_size over the ranks: the asynchronous
    driver's budget, a step's episodes) plus room for the control calls beside them (abort, weight sync), and at
    least 64. A request holds its call until generated: with a fixed 64, the rest waited in the actor's queue
    (the engine batched 64 sequences at most) and an abort or a weight sync waited behind them."""
    p = cfg.pipeline
    in_flight = (max(p.async_ratio, 0) + 1) * p.rollout_batch_size * cfg.algo.group_size
    return max(64, -(-in_flight // max(cfg.infer_engine.world_size, 1)) + 16)


def mini_batches(cfg: RLVRConfig) -> int:
    """Mini-batches per epoch of an update: algo.num_mini_batches, or rows / algo.mini_batch_size, or 1."""
    algo = cfg.algo
    if algo.num_mini_batches:
        return algo.num_mini_batches
    rows = cfg.pipeline.rollout_batch_size * algo.group_size
    return max(1, rows // algo.mini_batch_size) if algo.mini_batch_size else 1


def optimizer_schedule(cfg: RLVRConfig) -> dict[str, Any]:
    """The train engines' optimizer schedule settings; a warm-up longer than the run is logged (the learning rate
    would never reach algo.lr)."""
    algo = cfg.algo
    per_step = algo.ppo_epochs * mini_batches(cfg)
    total_steps = cfg.pipeline.max_steps * per_step
    if algo.warmup_steps > total_steps:
        log.warning(
            "algo.warmup_steps=%d is longer than the run's %d optimizer steps (pipeline.max_steps x "
            "algo.ppo_epochs x mini-batches): the learning rate never reaches algo.lr (it peaks at %.1f%% of it)",
            algo.warmup_steps,
            total_steps,
            100.0 * total_steps / algo.warmup_steps,
        )
    return {
        "weight_decay": algo.weight_decay,
        "warmup_steps": algo.warmup_steps,
        "total_steps": total_steps,
        "optimizer_steps_per_step": per_step,  # (a resume with another number re-bases the schedule's count)
        "lr_schedule": algo.lr_schedule,
        "max_grad_norm": algo.max_grad_norm,
    }


def _refuse_vision(te: TrainEngineConfig, model_path: str) -> None:
    """A vision-language model on a train engine that cannot feed it pictures is a config error, raised before
    any worker starts (the engine itself would only refuse once its actors had loaded the model)."""
    from hydra.utils import get_object

    from roll_core.multimodal.processor import is_vision_model

    if getattr(get_object(te._target_), "vision_models", True) or not is_vision_model(model_path):
        return
    raise ConfigError(
        f"train_engine={te.name} cannot train the vision-language model at model.path={model_path}: use "
        "train_engine=hf or train_engine=fsdp2 (they feed pictures to the vision tower)"
    )


def check_train_models(cfg: RLVRConfig, needs: RoleNeeds) -> None:
    """Every model a training-side role of `cfg` will load (the actor's and reference's `model.path`, the critics'
    `algo.critic_model_path`, the teachers': as `build_roles` builds them for `needs`) checked by the train engine's
    config (`TrainEngineConfig.check_model`: config.json only, no weights), before the cluster starts. The engines
    checked the same in their set-up only: on Ray a model they cannot train was refused after Ray had started and the
    workers had spawned. A model whose config.json is not on this machine (a hub id not downloaded here) is left to
    the engine, which checks it when it loads; the ConfigError names the key that gave the model."""
    if type(cfg.train_engine).check_model is TrainEngineConfig.check_model:
        return  # the default refuses nothing: no builtin to build, no cache to search for it (hf, fsdp2)
    algo, model = cfg.algo, cfg.model
    models: dict[str, str] = {}  # model -> the key naming it (the first that does)
    if needs.train or needs.reference:
        models.setdefault(model.path, "model.path")
    if needs.critic:
        models.setdefault(algo.critic_model_path or model.path, "algo.critic_model_path")
    for name, path in needs.teachers.items():
        models.setdefault(path, _teacher_key(name))
    for path, key in models.items():
        folder = _local_model_folder(path)
        if folder is None:
            continue  # a hub id not downloaded here: the engine checks the model it downloads
        try:
            cfg.train_engine.check_model(str(folder))
        except ConfigError as exc:
            raise ConfigError(f"{key}={path}: {exc}") from exc


def _teacher_key(name: str) -> str:
    """The config key that gives teacher `name` its model (distill.teacher_paths names them): `default` is
    distill.teacher, `domain_<d>` distill.teachers.<d>; another objective's teacher by its name."""
    if name == "default":
        return "distill.teacher"
    if name.startswith("domain_"):
        return f"distill.teachers.{name.removeprefix('domain_')}"
    return f"teacher {name}'s model"


def _local_model_folder(path: str) -> Path | None:
    """The folder holding `path`'s config.json on this machine: a builtin (built once, cached), a model folder, or a
    hub id's snapshot in the local Hugging Face cache; None for anything else (no download, no network probe)."""
    from roll_core.models import resolve_model_path

    if path.startswith("builtin:"):
        return Path(resolve_model_path(path))
    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # an id the hub library refuses (or a folder that is no model): the build says why
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def build_roles(cfg: RLVRConfig, cluster: Cluster, model_path: str, needs: RoleNeeds | None = None) -> Roles:
    """Every training-side worker group of `cfg` on `cluster` that `needs` asks for (RL's roles when None)."""
    from roll_core.models import resolve_model_path

    algo, model, pipe = cfg.algo, cfg.model, cfg.pipeline
    if needs is None:
        needs = RoleNeeds(train=True, reference=algo.use_reference, critic=algo.use_critic)
    te, ie = cfg.train_engine, cfg.infer_engine
    _check_colocated_layout(cfg, needs)  # before any role starts: a mismatch found later wasted their model loads
    _refuse_vision(te, model_path)
    if ie.structured and needs.train:  # the trainer must score the same constrained distribution the rollout sampled
        from hydra.utils import get_object

        if not getattr(get_object(te._target_), "structured_logprobs", False):
            raise ConfigError(
                f"infer_engine.structured needs a train engine that recomputes constrained log-probs (hf, fsdp2); "
                f"train_engine={te.name} cannot: the PPO ratio would compare two different policies"
            )
    # infer_engine.lora_sync=adapter: the engines serve the trainer's adapter of this rank (0: merged weights).
    rank = adapter_rank(te, ie) if needs.train else 0
    lora = {"lora_rank": rank} if rank else {}
    n_mini = mini_batches(cfg)
    # Each worker resolves its device and `dtype=auto` on its own node (roll_core.devices.resolve_device).
    placement = {"platform": cluster.platform.name, "device": "auto"}
    common = {
        "model_path": model_path,
        "attn_implementation": model.attn_implementation,
        "trust_remote_code": model.trust_remote_code,
        "seed": pipe.seed,
        **placement,
    }
    schedule = optimizer_schedule(cfg)
    # Picture size bounds (model.image_*_pixels) for the engines that resize pictures or save an image processor:
    # only those set, so an engine that takes no pictures never sees the keys.
    from roll_core.multimodal.processor import engine_pixels

    pixels = engine_pixels(model, model_path)
    # Sharded trainers (Megatron) span TP x CP x PP ranks per replica: data splits by data-parallel rank only.
    mesh = Mesh.for_world(te.world_size, **te.parallel_sizes())

    def train_group(role: str, runtime: TrainEngineRuntime, engine: TrainEngineConfig = te) -> TrainGroup:
        # Workers build the engine from its config's keys and the runtime (roll_core.interfaces.runtime).
        return cluster.group(TrainGroup, role, te.world_size, mesh=mesh, engine=as_dict(engine), runtime=runtime)

    actor_train = (
        train_group(
            "actor_train",
            TrainEngineRuntime(**common, dtype=model.dtype, role="actor", lr=algo.lr, **schedule, **pixels),
        )
        if needs.train
        else None
    )
    actor_infer = cluster.group(
        InferGroup,
        "actor_infer",
        ie.world_size,
        devices_per_worker=ie.devices_per_worker(),
        python=resolve_python(ie.python, ie.name),
        max_concurrency=ie.max_concurrency or request_concurrency(cfg),
        engine=as_dict(ie),
        runtime=InferEngineRuntime(
            **common, dtype=ie.dtype or model.dtype, max_new_tokens=model.max_response_length, **lora, **pixels
        ),
    )
    sampling = sampling_params(cfg)
    _check_infer_engine(cfg, actor_infer, sampling)
    reference_is_base = bool(te.lora_rank) and needs.reference and needs.train
    reference = None
    if needs.reference and not reference_is_base:
        reference = train_group(
            "reference", TrainEngineRuntime(**common, dtype=model.dtype, role="reference", trainable=False)
        )
    _check_colocated_share(cfg, needs, reference_built=needs.reference and not reference_is_base)
    critics = []
    if needs.critic:
        # algo.critic_model_path: AsyPPO's mini-critics may be smaller models than the policy (same tokenizer).
        critic_common = {**common, "model_path": resolve_model_path(algo.critic_model_path or model_path)}
        if algo.critic_model_path:
            tokenizer = resolve_model_path(model.tokenizer) if model.tokenizer else model_path
            _check_critic_vocabulary(critic_common["model_path"], tokenizer, model.trust_remote_code)
        critics = [
            train_group(
                "critic" if m == 0 else f"critic_{m}",
                TrainEngineRuntime(**critic_common, dtype=model.dtype, role="critic", lr=algo.critic_lr, **schedule),
                # LoRA adapts the policy only: the critic trains every weight of its own copy.
                engine=dataclasses.replace(te, lora_rank=0),
            )
            for m in range(algo.num_critics)
        ]
    critic = critics[0] if critics else None
    teachers = {
        name: cluster.group(
            TrainGroup,
            f"teacher_{name}",
            te.world_size,
            mesh=mesh,
            # A teacher only scores tokens: its own copy of the engine, never adapters.
            engine=as_dict(dataclasses.replace(te, lora_rank=0)),
            runtime=TrainEngineRuntime(
                **{**common, "model_path": resolve_model_path(path)},
                dtype=model.dtype,
                role="reference",
                trainable=False,
            ),
        )
        for name, path in needs.teachers.items()
    }
    return Roles(actor_train, actor_infer, reference, critic, reference_is_base, sampling, n_mini, teachers, critics)


def _check_colocated_layout(cfg: RLVRConfig, needs: RoleNeeds) -> None:
    """On Ray, colocated device roles share the placement group the first of them makes (roll_core.cluster.launch):
    one single-device bundle per rank of actor_train (of actor_infer where nothing trains). An inference engine
    spanning several devices per worker, or a later role with more ranks (actor_infer, reward_model), was refused
    only when its turn came, after the roles before it had started and loaded their models: here, before any."""
    if cfg.cluster.backend != "ray" or cfg.cluster.placement != "colocated":
        return
    te, ie, rm = cfg.train_engine, cfg.infer_engine, cfg.reward_model
    if ie.devices_per_worker() > 1:
        raise ConfigError(
            f"infer_engine={ie.name} spans {ie.devices_per_worker()} devices per worker (tensor_parallel_size), but "
            "cluster.placement=colocated gives every rank one device bundle: use cluster.placement=disaggregated, "
            "or infer_engine.tensor_parallel_size=1"
        )
    first, size = (
        ("train_engine.world_size", te.world_size) if needs.train else ("infer_engine.world_size", ie.world_size)
    )
    later = [("infer_engine.world_size", ie.world_size)] if needs.train else []
    if rm is not None and rm.enabled and (rm.placement or cfg.cluster.placement) == "colocated":
        later.append(("reward_model.world_size", rm.world_size))
    for key, n in later:
        if n > size:
            raise ConfigError(
                f"{key}={n}, but cluster.placement=colocated shares the {size} device bundle(s) of {first}={size} "
                f"among the device roles: set {key} <= {size} (or raise {first}), or use "
                "cluster.placement=disaggregated"
            )


def _check_colocated_share(cfg: RLVRConfig, needs: RoleNeeds, *, reference_built: bool) -> None:
    """On Ray, colocated device roles each reserve 1 / len(DEVICE_ROLES) of every device bundle, so at most that
    many fit: AsyPPO's further critics and distillation's teachers (one role each) take slots of their own, a
    ConfigError here rather than a placement that never comes (the sixth actor waited forever)."""
    from roll_core.cluster.launch import DEVICE_ROLES

    if cfg.cluster.backend != "ray" or cfg.cluster.placement != "colocated":
        return
    rm = cfg.reward_model
    rm_here = rm is not None and rm.enabled and (rm.placement or cfg.cluster.placement) == "colocated"
    roles = [
        *(["actor_train"] if needs.train else []),
        "actor_infer",
        *(["reference"] if reference_built else []),
        *(["critic" if m == 0 else f"critic_{m}" for m in range(cfg.algo.num_critics)] if needs.critic else []),
        *(["reward_model"] if rm_here else []),
        *(f"teacher_{name}" for name in needs.teachers),
    ]
    if len(roles) > len(DEVICE_ROLES):
        raise ConfigError(
            f"cluster.placement=colocated fits {len(DEVICE_ROLES)} device roles per device, this run has "
            f"{len(roles)} ({', '.join(roles)}): use cluster.placement=disaggregated, or fewer algo.num_critics or "
            "distill.teachers"
        )


def _check_critic_vocabulary(critic_path: str, tokenizer_path: str, trust_remote_code: bool) -> None:
    """The critics read the policy's token ids: a critic model whose embedding has fewer rows than the policy's
    tokenizer has tokens was made for another tokenizer; a ConfigError before any worker starts. (Larger is fine:
    checkpoints of one family pad their embeddings differently, e.g. Qwen2.5-7B's 152064 rows, 0.5B's 151936.)"""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(critic_path, trust_remote_code=trust_remote_code)
    rows = getattr(cfg.get_text_config(), "vocab_size", None)
    tokens = len(AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code))
    if rows is not None and rows < tokens:
        raise ConfigError(
            f"algo.critic_model_path={critic_path} embeds {rows} tokens, the policy's tokenizer has {tokens}: the "
            "critics read the policy's token ids, so use a model with the policy's tokenizer (e.g. a smaller model "
            "of the same family)"
        )


#: Pipelines whose sequences are episodes: their length is the task's max_context_length (model.max_prompt_length
#: and max_response_length are not read).
EPISODE_PIPELINES = ("agentic", "agent")


def _check_infer_engine(cfg: RLVRConfig, infer: InferGroup, sampling: SamplingParams) -> None:
    """Refuse sampling the engine cannot honour, and warn when a sequence may exceed its context: prompt + response,
    or for pipeline=agentic / agent the task's max_context_length (the collectors then lower it to the engine's,
    warned again: roll_core.agentic.rollout.fit_engine_context)."""
    name = cfg.infer_engine.name
    try:
        infer.check_sampling(sampling)
    except UnsupportedSamplingError as exc:
        raise ConfigError(f"infer_engine={name}: {exc}") from exc
    context = infer.max_context_length()
    if getattr(cfg.pipeline, "name", None) in EPISODE_PIPELINES:
        task = getattr(cfg.env, "max_context_length", None)
        if isinstance(task, int) and not isinstance(task, bool) and task > context:
            log.warning(
                "env.max_context_length=%d exceeds the %s engine's context of %d tokens: episodes will end at %d "
                "(end max_context); lower env.max_context_length or raise infer_engine.max_model_len",
                task,
                name,
                context,
                context,
            )
        return
    need = cfg.model.max_prompt_length + cfg.model.max_response_length
    if need > context:
        log.warning(
            "model.max_prompt_length + max_response_length = %d exceeds the %s engine's context of %d tokens: "
            "long prompts get shorter responses (finish reason 'length')",
            need,
            name,
            context,
        )
