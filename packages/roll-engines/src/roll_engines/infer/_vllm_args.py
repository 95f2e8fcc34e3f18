"""How the `vllm` engine's knobs become vLLM's engine arguments and environment (roll_engines.infer.vllm).

Contract: `cpu_env` sets what vLLM's CPU backend reads at import, so it must run before `vllm` is imported (it only
sets variables, a value the user exported is kept where that is safe; the KV cache size is always the engine's
`kv_cache_gb`, set anew for every engine, since vLLM reads it when each engine's config is built); `engine_args`
returns the keyword arguments of `vllm.LLM` for one engine and imports nothing from vLLM, so it can be checked
without starting one; `sampling_params` turns roll's SamplingParams into vLLM's for one request (n=1, processed
log-probs of the sampled token, DELTA outputs), given vLLM's class. Refusals of combinations vLLM cannot serve (FP8
or routing on CPU, a vision model without torchvision) happen in the engine's constructor, before these are called.
Values are the ones measured in roll's notes/cpu-engines.md and the module docstring of roll_engines.infer.vllm.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from roll_engines.infer._adapters import vllm_max_rank

if TYPE_CHECKING:
    from roll_core.interfaces import SamplingParams

log = logging.getLogger(__name__)

#: roll's methods inside vLLM's worker processes (roll_engines.infer._vllm_worker).
WORKER_EXTENSION = "roll_engines.infer._vllm_worker.RollWorkerExtension"


#: The KV cache size cpu_env last set in this process (not a user's export, which it warns about replacing).
_kv_set: list[str | None] = [None]


def cpu_env(kv_cache_gb: int, threads: int | None, cache_root: str | None, tensor_parallel_size: int = 1) -> None:
    """Environment vLLM's CPU backend reads at import (measured settings of roll's notes/cpu-engines.md)."""
    # Overwritten, not setdefault: vLLM-CPU reads it at every engine's config (CpuPlatform.check_and_update_config),
    # so a second engine of the process silently kept the first one's size. An export of another size is replaced.
    given, kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE"), str(int(kv_cache_gb))  # vLLM parses an int (GiB)
    if given not in (None, "", kv, _kv_set[0]):
        log.warning("VLLM_CPU_KVCACHE_SPACE=%s in the environment is replaced by kv_cache_gb=%s", given, kv)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = _kv_set[0] = kv
    # One process: the engine core in this process uses every core (by default one is left to a scheduler process).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The cores this process may use (affinity mask, cgroup CPU quota; ROLL_NUM_THREADS), as the HF engines count
    # them: os.cpu_count() is the host's, and a pod limited to 2 CPUs on a 64-core node ran 64 throttled threads.
    from roll_core.models import default_num_threads

    n = threads or default_num_threads()
    per = max(1, n // tensor_parallel_size)  # cores per tensor-parallel rank
    os.environ["OMP_NUM_THREADS"] = str(per)  # Ray sets 1 in workers with fractional CPUs
    # One core list per tensor-parallel rank ("|"-separated, vLLM's format), taken from the affinity mask (taskset,
    # Slurm, --cpuset-cpus): libgomp refuses a place outside it and then binds nothing. Ranks share no core unless
    # the mask has fewer cores than they need (they then share the mask's, never stray outside it).
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call (macOS)
        allowed = []
    cores = [allowed[i % len(allowed)] if allowed else i for i in range(per * tensor_parallel_size)]
    binds = "|".join(",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(tensor_parallel_size))
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if len(given.split("|")) != tensor_parallel_size or given == "auto":  # unset, or set for another TP size
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binds
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cache_root:
        os.environ.setdefault("VLLM_CACHE_ROOT", cache_root)


def engine_args(
    path: str,
    *,
    on_cpu: bool,
    dtype: str,
    seed: int,
    tensor_parallel_size: int,
    max_num_seqs: int,
    max_model_len: int | None,
    enforce_eager: bool,
    enable_prefix_caching: bool,
    trust_remote_code: bool,
    gpu_memory_utilization: float,
    quantization: str | None = None,
    vision: bool = False,
    lora_rank: int = 0,
    return_routing: bool = False,
    image_min_pixels: int | None = None,
    image_max_pixels: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for a roll engine (the knobs are VLLMInferEngine's, same names).

    `vision`: the model is a vision-language model (pictures only, no video profiling). `return_routing`: vLLM
    records every MoE layer's experts (roll_engines.infer._vllm_routing), which it does only with prefix caching
    on: the caller has refused `enable_prefix_caching=False` with it. `image_min_pixels` / `image_max_pixels`
    (model.image_*_pixels; None: the folder's own): the picture size bounds, resolved against the folder's image
    processor as roll's prompt builder resolves them and given to vLLM as `mm_processor_kwargs` (both bounds: a
    single one would reach transformers' processor call as a `size` without its other edge, which it refuses), so
    vLLM's expansion of each placeholder, and its memory profiling of the largest picture, use roll's grid.
    ValueError for bounds that cannot apply (roll_core.multimodal.load_image_processor).
    """
    kwargs: dict[str, Any] = {
        "model": path,
        "dtype": dtype,
        "seed": seed,
        "tensor_parallel_size": tensor_parallel_size,
        "max_num_seqs": max_num_seqs,
        "enforce_eager": enforce_eager,
        "enable_prefix_caching": enable_prefix_caching,
        "logprobs_mode": "processed_logprobs",
        # The backend whose masks the trainer replays exactly (roll_engines.structured; engine module docstring).
        "structured_outputs_config": {"backend": "outlines"},
        "trust_remote_code": trust_remote_code,
        "worker_extension_cls": WORKER_EXTENSION,
        # Chosen, not left to vLLM: inside a placement group it picks Ray, which refuses a multi-device bundle.
        "distributed_executor_backend": "uni" if tensor_parallel_size == 1 else "mp",
    }
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() in ("1", "true", "yes", "on"):
        # roll-train sets it off a terminal (roll_core.library_bars) and engine workers inherit it; vLLM's own
        # "Loading safetensors checkpoint shards" bar does not read it and filled log files.
        kwargs["use_tqdm_on_load"] = False
    if quantization:  # online: each weight sync's reload re-quantizes layer by layer (vLLM's layerwise reload)
        kwargs["quantization"] = quantization
    if vision:
        kwargs["limit_mm_per_prompt"] = {"video": 0}  # roll sends pictures only: no video profiling at start
    if image_min_pixels is not None or image_max_pixels is not None:
        from roll_core.multimodal.processor import pixel_range

        if not vision:
            raise ValueError(f"model.image_min_pixels / image_max_pixels bound pictures, but {path} is a text model")
        low, high = pixel_range(path, image_min_pixels, image_max_pixels, trust_remote_code)
        kwargs["mm_processor_kwargs"] = {"min_pixels": low, "max_pixels": high}
    if on_cpu:
        # vLLM-CPU 0.32 rewinds the seeded generator of a request whose sampled token it discards (a prompt
        # prefilled in chunks), and a CPU generator has no offset to rewind: RuntimeError at the first large
        # batch. Whole-prompt prefill never discards, so per-request seeds keep working. GPUs keep chunking.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(4096, max_model_len or model_context(path, trust_remote_code))
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
    if lora_rank:
        # Two adapters at once: the current one and a superseded one that a running request still uses.
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_rank(lora_rank), max_loras=2, max_cpu_loras=4)
    if return_routing:
        kwargs["enable_return_routed_experts"] = True  # vLLM's AuxOutputConfig flag
    return kwargs


def sampling_params(cls: Any, p: SamplingParams, max_tokens: int, delta: Any) -> Any:
    """vLLM's SamplingParams (`cls`) of one request; `delta`: vLLM's RequestOutputKind.DELTA."""
    structured = None
    if p.structured is not None:
        from vllm.sampling_params import StructuredOutputsParams

        from roll_engines.structured import to_regex

        structured = StructuredOutputsParams(regex=to_regex(p.structured))
    return cls(
        n=1,
        # Greedy by roll's rule (below GREEDY_TEMPERATURE): vLLM would raise a temperature in (0, 0.01) to 0.01.
        temperature=0.0 if p.greedy else p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=max_tokens,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos,
        seed=p.seed,
        logprobs=0,
        include_stop_str_in_output=True,
        # Stop strings are matched on the decoded text: with special tokens in it, as the hf engine and SGLang
        # match them (a stop string "<|im_start|>" never fired with vLLM's default).
        skip_special_tokens=False,
        output_kind=delta,
        structured_outputs=structured,
    )


def model_context(path: str, trust_remote_code: bool) -> int:
    """The model's own context limit (vLLM's default max_model_len)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 4096)
