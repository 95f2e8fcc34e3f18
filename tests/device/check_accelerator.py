"""Accelerator checks that need only torch and transformers: no Ray, no Hydra, no package registry.

    python tests/device/check_accelerator.py --device cuda        # what `nox -s device -- cuda` runs first
    python tests/device/check_accelerator.py --device cpu         # the same code path on the CPU (CI smoke)
    python tests/device/check_accelerator.py --device cuda --only bf16 GRPO --require megatron-core vllm

Runs from a source checkout (the packages' src folders are put on sys.path), each check in isolation, and prints
a table of what ran, what was skipped (and why) and what failed, then `N passed, N failed, N skipped`. Exit
status: 0 when nothing failed; 1 when a check failed; 2 when the run could not check what was asked (the
requested device is absent, or `--only` matched no check). A check whose package is missing skips, unless that
package is named in `--require` (the caller installed it: a skip would hide a broken install), then it fails.
Checks:
1. bf16 training step with fp32 master weights (hf engine) tracks an fp32 step;
2. weight sync from a trainer process to an inference engine in another process: CUDA IPC (one device) and a
   torch.distributed broadcast group (NCCL over two devices; on `--device cpu` the same code over gloo);
3. Megatron-Core TP=1: one step equals the hf engine's (when megatron-core is installed);
4. vLLM: greedy generate equals the hf engine's, then a weight update changes it accordingly (when vllm is
   installed);
5. a 3-step GRPO loop on the tiny model over the engines directly (generate, reward, advantages, train, sync).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for pkg in ("roll-hw", "roll-algos", "roll-core", "roll-engines"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))

import torch  # noqa: E402


class Skip(Exception):
    """A check that cannot run here (missing hardware or package)."""


class MissingPackage(Skip):
    """A check whose package is not installed: a skip, or a failure when the package is in `--require`."""

    def __init__(self, package: str, exc: ImportError):
        super().__init__(f"{package} not installed ({exc})")
        self.package = package


def _require_module(module: str, package: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackage(package, exc) from exc


def _cache_dir() -> None:
    """ROLL_CACHE_DIR for the built-in tiny models: a temporary folder of this run (removed when it exits) unless
    the caller named one. Spawned check processes inherit the variable, and only this process removes it."""
    if not os.environ.get("ROLL_CACHE_DIR"):
        import atexit
        import shutil

        folder = os.environ["ROLL_CACHE_DIR"] = tempfile.mkdtemp(prefix="roll-device-")
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))


def _tiny() -> str:
    _cache_dir()
    from roll_core.models import resolve_model_path

    return resolve_model_path("builtin:tiny")


def check_bf16_master(device: str) -> str:
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine

    path = _tiny()
    batch = toy_batch(path)

    def run(dtype: str) -> tuple[dict, dict]:
        eng = HFTrainEngine(path, device=device, dtype=dtype, lr=1e-5, micro_batch_size=6)
        w0 = {k: v.float().cpu().clone() for k, v in eng.iter_weights()}
        for _ in range(4):
            eng.train_step(batch, PolicyObjective())
        assert all(p.dtype == torch.float32 for p in eng.model.parameters()), "master weights must stay fp32"
        return w0, {k: v.float().cpu().clone() for k, v in eng.iter_weights()}

    w0, ref = run("float32")
    _, mixed = run("bfloat16")
    dist = lambda a, b: float(sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt())
    ratio = dist(mixed, ref) / dist(ref, w0)
    assert ratio < 0.15, f"bf16-compute run is {ratio:.0%} of the update away from fp32"
    return f"bf16 compute vs fp32: {ratio:.1%} of the update"


def _ipc_receiver(queue_in, queue_out, path: str) -> None:  # a child process: the inference engine
    for pkg in ("roll-hw", "roll-algos", "roll-core", "roll-engines"):
        sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))
    from roll_core.cluster.buckets import open_cuda
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(path, device="cuda")
    engine.begin_weight_update()
    while (item := queue_in.get()) is not None:
        engine.update_weights(open_cuda(item["handle"], item["specs"]))
        queue_out.put("copied")
    engine.finish_weight_update()
    queue_out.put(engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=8)).responses[0].tolist())


def check_cuda_ipc(device: str) -> str:
    if device != "cuda":
        raise Skip("CUDA IPC needs a CUDA device")
    import torch.multiprocessing as mp

    from roll_core.cluster.buckets import buckets, share_cuda
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = _tiny()
    train = HFTrainEngine(path, device="cuda")
    with torch.no_grad():
        for p in train.model.parameters():
            p.mul_(1.5)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(q_in, q_out, path))
    proc.start()
    try:
        n = 0
        for bucket in buckets(train.iter_weights(), 64 * 1024):
            handle, specs, keep = share_cuda(bucket)
            q_in.put({"handle": handle, "specs": specs})
            assert q_out.get(timeout=300) == "copied"
            del keep
            n += 1
        q_in.put(None)
        got = q_out.get(timeout=300)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    ref = HFInferEngine(path, device="cuda")
    ref.load_weights(dict(train.iter_weights()))
    expected = ref.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=8)).responses[0].tolist()
    assert got == expected, (got, expected)
    return f"{n} buckets through CUDA IPC; the engine generates with the trainer's weights"


def _broadcast_rank(rank: int, port: int, path: str, result, backend: str) -> None:  # a child process
    for pkg in ("roll-hw", "roll-algos", "roll-core", "roll-engines"):
        sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))
    try:
        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        from roll_core.cluster.buckets import SyncGroup, buckets

        group = SyncGroup("127.0.0.1", port, rank, 2, backend, timeout_s=120)
        if rank == 0:
            from roll_engines.train.hf import HFTrainEngine

            train = HFTrainEngine(path, device=device)
            for bucket in buckets(train.iter_weights(), 64 * 1024):
                group.send(bucket)
            group.send(None)
            result.put(("sender", sum(v.double().sum().item() for _, v in train.iter_weights())))
        else:
            total = 0.0
            while (bucket := group.receive()) is not None:
                total += sum(v.double().sum().item() for _, v in bucket)
            result.put(("receiver", total))
    except BaseException as exc:  # the parent reports it instead of waiting out its timeout
        result.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def check_nccl_broadcast(device: str) -> str:
    """Rank 0 (a trainer) broadcasts its weights in buckets to rank 1 (an engine) in another process: over NCCL
    with two CUDA devices; on the CPU the same code over gloo (so a bare machine exercises it too)."""
    if device == "cpu":
        backend = "gloo"
    elif device == "cuda" and torch.cuda.device_count() >= 2:
        backend = "nccl"
    else:
        raise Skip("an NCCL broadcast group needs two CUDA devices (NCCL refuses two ranks on one device)")
    import queue

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    path, port = _tiny(), free_port()
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, path, result, backend)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        sums = {}
        for _ in procs:
            try:
                role, value = result.get(timeout=300)
            except queue.Empty:
                raise TimeoutError("no answer from a rank within 300 s") from None
            if role == "error":
                raise RuntimeError(value)
            sums[role] = value
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert abs(sums["sender"] - sums["receiver"]) < 1e-3, sums
    return f"trainer rank 0 -> engine rank 1 over {backend.upper()}: every tensor arrived"


def check_megatron(device: str) -> str:
    _require_module("megatron.core", "megatron-core")
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine
    from roll_engines.train.megatron import MegatronTrainEngine

    path = _tiny()
    batch = toy_batch(path)
    backend = "nccl" if device == "cuda" else "gloo"
    mg = MegatronTrainEngine(path, device=device, dist_backend=backend, use_distributed_optimizer=False, lr=1e-2)
    hf = HFTrainEngine(path, device=device, lr=1e-2)
    mg.train_step(batch, PolicyObjective())
    hf.train_step(batch, PolicyObjective())
    a, b = mg.get_weights(), hf.get_weights()
    mg.shutdown()  # a local run's teardown: the process group of one ends (NCCL warns at exit otherwise)
    worst = max(float((a[k].cpu() - b[k].cpu()).abs().max()) for k in b)
    assert worst < 2e-4, f"Megatron step differs from hf by {worst}"
    return f"TP=1 step equals the hf engine's (max |dw| {worst:.1e})"


def check_vllm(device: str) -> str:
    _require_module("vllm", "vllm")
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.infer.vllm import VLLMInferEngine

    _cache_dir()
    from roll_core.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-wide")
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    engine = VLLMInferEngine(path, device=device, max_model_len=512, gpu_memory_utilization=0.2)
    hf = HFInferEngine(path, device=device)
    assert (
        engine.generate([[5, 6, 7]], greedy).responses.tolist() == hf.generate([[5, 6, 7]], greedy).responses.tolist()
    )
    scaled = {k: v * 1.5 for k, v in hf.model.state_dict().items()}
    engine.begin_weight_update()
    engine.update_weights(scaled.items())
    engine.finish_weight_update()
    hf.load_weights(scaled)
    same = (
        engine.generate([[5, 6, 7]], greedy).responses.tolist() == hf.generate([[5, 6, 7]], greedy).responses.tolist()
    )
    engine.shutdown()
    assert same, "after the weight update vLLM and hf disagree"
    return "greedy tokens equal hf's before and after a weight update"


def check_grpo_loop(device: str) -> str:
    """Three GRPO steps over the engines: the tiny model learns to answer 7 (reward = last char is 7)."""
    from roll_algos.advantages import broadcast_to_tokens, group_normalized
    from roll_core.interfaces import SamplingParams
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.sequences import build_sequences, pad_left
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = _tiny()
    infer = HFInferEngine(path, device=device, max_new_tokens=6)
    train = HFTrainEngine(path, device=device, lr=3e-3, micro_batch_size=16)
    tok = infer.tokenizer
    prompts = [list(tok(f"Q{i}: say 7")["input_ids"]) for i in range(4)]
    rewards = []
    for step in range(3):
        gen = infer.generate(prompts, SamplingParams(max_new_tokens=6, seed=step), n=8)
        texts = [tok.decode(r[m.bool()]) for r, m in zip(gen.responses, gen.response_mask)]
        scores = torch.tensor([float(t.replace("</s>", "").strip().endswith("7")) for t in texts])
        rewards.append(float(scores.mean()))
        p_ids, p_mask = pad_left([p for p in prompts for _ in range(8)], infer.pad_id)
        batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
        mask = gen.response_mask.float()
        adv = broadcast_to_tokens(group_normalized(scores, 8), mask)
        batch.update(
            responses=gen.responses, response_mask=gen.response_mask, advantages=adv, behaviour_logprobs=gen.logprobs
        )
        metrics = train.train_step(batch, PolicyObjective())
        assert metrics["actor/train_infer_logprob_diff"] < 1e-3, metrics
        infer.load_weights(dict(train.iter_weights()))
    return f"3 steps; reward {', '.join(f'{r:.2f}' for r in rewards)}; train/infer log-prob gap < 1e-3"


CHECKS: dict[str, Callable[[str], str]] = {
    "bf16 step, fp32 master weights": check_bf16_master,
    "weight sync: CUDA IPC": check_cuda_ipc,
    "weight sync: NCCL broadcast": check_nccl_broadcast,
    "Megatron-Core TP=1 step": check_megatron,
    "vLLM generate + weight update": check_vllm,
    "3-step GRPO loop": check_grpo_loop,
}


def device_missing(device: str) -> str | None:
    """Why the requested device is absent (None when it is there)."""
    if device == "cpu":
        return None
    if device == "cuda":
        if torch.cuda.is_available():
            return None
        build = torch.version.cuda or getattr(torch.version, "hip", None)
        if not build:
            return f"no cuda device: torch {torch.__version__} is a CPU-only build"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return f"no cuda device: torch {torch.__version__} (built for {build}) sees none (check the driver{where})"
    return f"unknown device {device!r} (choose cuda or cpu; torch addresses ROCm GPUs as cuda)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="*", help="names (substrings) of checks to run")
    ap.add_argument(
        "--require",
        nargs="*",
        default=[],
        metavar="PACKAGE",
        help="packages the caller installed (megatron-core, vllm): a check missing one fails instead of skipping",
    )
    ap.add_argument("--check-timeout", type=int, default=600, metavar="S", help="a check running longer fails")
    args = ap.parse_args()
    missing = device_missing(args.device)
    if missing:
        print(f"check_accelerator: {missing}; nothing was checked", file=sys.stderr)
        return 2
    chosen = {n: f for n, f in CHECKS.items() if not args.only or any(s.lower() in n.lower() for s in args.only)}
    if not chosen:
        print(f"check_accelerator: --only {args.only} matches none of {list(CHECKS)}", file=sys.stderr)
        return 2
    required = {r.lower() for r in args.require}
    rows = []

    def too_long(signum, frame):  # a hung check fails and the others still run (SIGALRM: the main thread)
        raise TimeoutError(f"no result within {args.check_timeout} s")

    signal.signal(signal.SIGALRM, too_long)
    for name, fn in chosen.items():
        t0 = time.perf_counter()
        signal.alarm(args.check_timeout)
        try:
            status, detail = "ok", fn(args.device)
        except MissingPackage as exc:
            if exc.package.lower() in required:
                status, detail = "FAILED", f"{exc} although it was installed for this run"
            else:
                status, detail = "skipped", str(exc)
        except Skip as exc:
            status, detail = "skipped", str(exc)
        except Exception as exc:  # report and go on: one table of everything
            status, detail = "FAILED", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            signal.alarm(0)
        rows.append((name, status, time.perf_counter() - t0, detail))
    name_w = max(len(r[0]) for r in rows)
    print(f"\naccelerator checks on {args.device} (torch {torch.__version__}):")
    for name, status, seconds, detail in rows:
        print(f"  {name:<{name_w}}  {status:<7} {seconds:6.1f}s  {detail}")
    counts = {s: sum(r[1] == s for r in rows) for s in ("ok", "FAILED", "skipped")}
    print(f"{counts['ok']} passed, {counts['FAILED']} failed, {counts['skipped']} skipped")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
