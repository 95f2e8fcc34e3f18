"""Vision-language models in the training engines (roll_engines.train._vision): the hf engine's log-probs of a
multimodal batch, packed and padded, equal a plain transformers forward of each row; pictures run once per
distinct prompt when packed; prompts with equal text and other pictures never share; training, LoRA and
checkpoints round-trip; the hf infer engine's sampling log-probs equal the trainer's; fsdp2 over two gloo ranks
equals hf; placeholder/feature mismatches and unsupported combinations are clear errors.

Families: Qwen2.5-VL (3D mrope positions from the model's get_rope_index) and LLaVA (CLIP tower, 1D positions),
Qwen3-VL and Qwen2-VL in the full matrix; tiny random models built from configs. fp32 throughout; log-prob
tolerance 1e-5 (summation-order noise is ~1e-6), sampler vs trainer 2e-4 as for text models (KV-cached decode vs
one forward).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from roll_core.models import resolve_model_path
from roll_core.multimodal import MMInputs, VisionProcessor, as_content
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.sequences import build_sequences, pad_left
from roll_engines.train.hf import HFTrainEngine

#: CI runs Qwen2.5-VL and LLaVA; Qwen3-VL (interleaved mrope, deepstack) and Qwen2-VL run in `nox -s full_matrix`.
FAMILIES = [
    "tiny-qwen2.5-vl",
    "tiny-llava",
    pytest.param("tiny-qwen3-vl", marks=pytest.mark.full_matrix),
    pytest.param("tiny-qwen2-vl", marks=pytest.mark.full_matrix),
]
FAMILY_NAMES = ["tiny-qwen2.5-vl", "tiny-llava", "tiny-qwen3-vl", "tiny-qwen2-vl"]
ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))


def _path(name: str) -> str:
    return resolve_model_path(f"builtin:{name}")


def _prompts(vp: VisionProcessor) -> list[tuple[list[int], MMInputs]]:
    """Four prompts: two with different pictures (B has two), and two with EQUAL text but different pictures; then
    a text-only prompt (mm None)."""

    def enc(text: str, colours: list[tuple[int, int, int]], size=(56, 56)) -> tuple[list[int], MMInputs]:
        pics = [Image.new("RGB", size, c) for c in colours]
        return vp.encode_messages([{"role": "user", "content": as_content(text, len(pics))}], pics)

    return [
        enc("count <image>", [(200, 0, 0)]),
        enc("what is <image> next to <image>?", [(0, 200, 0), (0, 0, 9)], size=(84, 56)),
        enc("same <image>", [(1, 2, 3)]),
        enc("same <image>", [(250, 240, 3)]),
        enc("no picture", []),
    ]


#: Row -> prompt: 3 responses each for prompts 0 and 1, 2 each for the equal-text pair, groups interleaved.
ROWS = [0, 2, 1, 0, 3, 1, 0, 2, 1, 3]


def _batch(vp: VisionProcessor, rows: list[int] = ROWS, seed: int = 0) -> dict[str, Any]:
    """The trainer's layout (left-padded prompts, right-padded responses of 1-6 tokens) with `mm_inputs`."""
    prompts = _prompts(vp)
    g = torch.Generator().manual_seed(seed)
    resp = [torch.randint(10, 60, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g) for _ in rows]
    p_ids, p_mask = pad_left([prompts[i][0] for i in rows], vp.tokenizer.pad_token_id)
    responses, mask = pad_left([r.flip(0).tolist() for r in resp], vp.tokenizer.pad_token_id)
    responses, mask = responses.flip(1), mask.flip(1)  # right-padded
    batch: dict[str, Any] = build_sequences(p_ids, p_mask, responses, mask)
    batch.update(prompts=p_ids, responses=responses, response_mask=mask)
    batch["advantages"] = torch.randn(len(rows), generator=g)[:, None].expand_as(mask).clone()
    batch["old_logprobs"] = torch.zeros(mask.shape)
    batch["mm_inputs"] = [prompts[i][1] for i in rows]  # rows of one prompt share its MMInputs object
    return batch


def _plain_logprobs(model: Any, vp: VisionProcessor, batch: dict[str, Any]) -> list[torch.Tensor]:
    """Each row alone through transformers (positions computed by the model itself): the reference."""
    out = []
    for i in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()][None]
        n = int(batch["response_mask"][i].sum())
        extra = {"mm_token_type_ids": (ids == vp.image_token_id).int()} if vp.mrope else {}
        if vp.mrope:
            model.model.rope_deltas = None  # transformers' own cache of the positions; roll never lets it live
        with torch.no_grad():
            logits = model(input_ids=ids, **extra, **batch["mm_inputs"][i].tensors).logits[0].float()
        logp = torch.log_softmax(logits[-n - 1 : -1], -1)
        out.append(logp.gather(-1, ids[0, -n:, None])[:, 0])
    return out


def _count_pictures(engine: HFTrainEngine) -> list[int]:
    """Pictures the vision tower encodes per forward (the model's get_image_features, wrapped)."""
    inner = engine.model.model
    seen: list[int] = []
    original = inner.get_image_features

    def counting(pixel_values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        grid = args[0] if args else kwargs.get("image_grid_thw")
        seen.append(int(grid.shape[0]) if grid is not None else int(pixel_values.shape[0]))
        return original(pixel_values, *args, **kwargs)

    inner.get_image_features = counting
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logprobs_equal_padded_and_each_row_alone(family: str) -> None:
    from transformers import AutoModelForImageTextToText

    path = _path(family)
    vp = VisionProcessor(path)
    batch = _batch(vp)
    packed = HFTrainEngine(path, role="reference", logprob_chunk_size=16)
    padded = HFTrainEngine(path, role="reference", logprob_chunk_size=16, pack_sequences=False)
    seen = _count_pictures(packed)
    got = packed.compute_logprobs(batch, with_entropy=True)
    want = padded.compute_logprobs(batch, with_entropy=True)
    mask = batch["response_mask"].bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(got[key][mask], want[key][mask], atol=ATOL, rtol=0, msg=key)
    # Each distinct prompt's pictures once: 1 + 2 + 1 + 1 (the equal-text pair keeps both of its pictures).
    assert seen == [5]
    assert packed.forward_tokens < 0.6 * padded.forward_tokens
    plain = AutoModelForImageTextToText.from_pretrained(path).eval()
    for i, want_row in enumerate(_plain_logprobs(plain, vp, batch)):
        torch.testing.assert_close(got["logprobs"][i][mask[i]], want_row, atol=ATOL, rtol=0, msg=f"row {i}")
    if vp.mrope:  # the engines pass explicit positions: transformers never caches rope deltas on the model
        assert packed.model.model.rope_deltas is None and padded.model.model.rope_deltas is None


def test_agentic_rows_with_pictures_in_their_responses_pack_exactly() -> None:
    """Multi-turn rows whose responses hold observation pictures (agentic: the row's MMInputs is every turn's, in
    order): two rows share prompt A (one prompt computation) but see different observation pictures, a third
    continues prompt B. Packed = padded = each row alone."""
    from transformers import AutoModelForImageTextToText

    path = _path("tiny-qwen2.5-vl")
    vp = VisionProcessor(path)
    prompts = _prompts(vp)

    def observation(colour: tuple[int, int, int]) -> tuple[list[int], MMInputs]:
        content = as_content("you see <image>", 1)
        return vp.encode_messages([{"role": "user", "content": content}], [Image.new("RGB", (56, 84), colour)])

    rows = []  # (prompt, response pieces [(ids, trained)], the row's pictures in placeholder order)
    for p, colour in ((0, (9, 9, 200)), (0, (200, 9, 9)), (1, (9, 200, 9))):
        ids, mm = prompts[p]
        obs_ids, obs_mm = observation(colour)
        rows.append((ids, [([40, 41], 1), (obs_ids, 0), ([42, 43, 44], 1)], mm.extend(obs_mm)))
    pad = vp.tokenizer.pad_token_id
    p_ids, p_mask = pad_left([r[0] for r in rows], pad)
    tokens = [[t for piece, _ in r[1] for t in piece] for r in rows]
    width = max(map(len, tokens))
    responses = torch.full((len(rows), width), pad)
    response_mask, present = torch.zeros_like(responses), torch.zeros_like(responses)
    for i, r in enumerate(rows):
        responses[i, : len(tokens[i])] = torch.tensor(tokens[i])
        response_mask[i, : len(tokens[i])] = torch.tensor([m for piece, m in r[1] for _ in piece])
        present[i, : len(tokens[i])] = 1
    batch: dict[str, Any] = build_sequences(p_ids, p_mask, responses, present)
    batch.update(responses=responses, response_mask=response_mask, mm_inputs=[r[2] for r in rows])
    packed = HFTrainEngine(path, role="reference")
    padded = HFTrainEngine(path, role="reference", pack_sequences=False)
    seen = _count_pictures(packed)
    got, want = packed.compute_logprobs(batch)["logprobs"], padded.compute_logprobs(batch)["logprobs"]
    attended = present.bool()
    torch.testing.assert_close(got[attended], want[attended], atol=ATOL, rtol=0)
    assert seen == [1 + 1 + 1 + 2 + 1]  # prompt A once, its rows' two observations, prompt B, its observation
    plain = AutoModelForImageTextToText.from_pretrained(path).eval()
    for i, r in enumerate(rows):
        ids = torch.tensor([r[0] + tokens[i]])
        with torch.no_grad():
            logits = plain(input_ids=ids, mm_token_type_ids=(ids == vp.image_token_id).int(), **r[2].tensors).logits
        plain.model.rope_deltas = None
        n = len(tokens[i])
        logp = torch.log_softmax(logits[0, -n - 1 : -1].float(), -1).gather(-1, ids[0, -n:, None])[:, 0]
        torch.testing.assert_close(got[i, :n], logp, atol=ATOL, rtol=0, msg=f"row {i}")


def test_training_micro_batches_keep_pictures_with_their_rows() -> None:
    """Gradients of the packed engine (micro-batches of 3 rows, or a token budget; rows grouped by prompt) equal the
    padded engine's in one micro-batch; the vision tower is trained (pictures reach the policy gradient)."""
    path = _path("tiny-qwen2.5-vl")
    batch = _batch(VisionProcessor(path))
    loss = PolicyObjective()
    packed = HFTrainEngine(path, lr=1e-3, micro_batch_size=3)
    whole = HFTrainEngine(path, lr=1e-3, micro_batch_size=len(ROWS), pack_sequences=False)
    # A token budget (micro-batches of whole prompt groups, at most 120 attended tokens) cuts rows differently.
    budget = HFTrainEngine(path, lr=1e-3, micro_batch_tokens=120)
    want = whole.compute_gradients(batch, loss)
    for got in (packed.compute_gradients(batch, loss), budget.compute_gradients(batch, loss)):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    assert budget.micro_batches_run > 2
    assert max(float(g.abs().max()) for n, g in got.items() if ".visual." in n) > 0


def test_a_placeholder_feature_mismatch_is_a_clear_error_before_the_forward() -> None:
    path = _path("tiny-qwen2.5-vl")
    vp = VisionProcessor(path)
    batch = _batch(vp)
    ids = batch["input_ids"].clone()
    where = (ids[3] == vp.image_token_id).nonzero()[:2, 0]
    ids[3, where] = vp.tokenizer.pad_token_id  # two placeholders lost (as a truncated prompt loses them)
    bad = {**batch, "input_ids": ids}
    eng = HFTrainEngine(path, lr=1e-3)
    message = r"batch row 3: 2 image placeholder token\(s\) .* 1 picture\(s\) with 4 feature\(s\)"
    with pytest.raises(ValueError, match=message):
        eng.compute_logprobs(bad)
    with pytest.raises(ValueError, match=message):
        eng.train_step(bad, PolicyObjective())
    assert eng.forward_tokens == 0  # refused before any forward
    no_pictures = {k: v for k, v in batch.items() if k != "mm_inputs"}
    with pytest.raises(ValueError, match=r"batch row 0: 4 image placeholder.* 0 picture"):
        eng.compute_logprobs(no_pictures)
    text = HFTrainEngine(_path("tiny"), role="reference")
    other = {k: v for k, v in batch.items() if k != "mm_inputs"}
    other["mm_inputs"] = [None, None, *batch["mm_inputs"][2:]]
    with pytest.raises(ValueError, match=r"batch row 2 carries 2 picture\(s\) but .* not a vision-language model"):
        text.compute_logprobs(other)
    with pytest.raises(ValueError, match="cannot be the critic"):
        HFTrainEngine(path, role="critic")


def test_checkpoint_reloads_in_transformers_with_the_same_logprobs(tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    path = _path("tiny-qwen2.5-vl")
    vp = VisionProcessor(path)
    batch = _batch(vp)
    eng = HFTrainEngine(path, lr=1e-2, micro_batch_size=5)
    initial = eng.compute_logprobs(batch)["logprobs"]
    assert eng.train_step(batch, PolicyObjective(), mini_batches=2)["optimizer_steps"] == 2
    trained = eng.compute_logprobs(batch)["logprobs"]
    assert (trained - initial)[batch["response_mask"].bool()].abs().max() > 1e-3  # the steps moved the policy
    eng.save(tmp_path / "ckpt", tokenizer_path=path)
    # The weight-sync names are the checkpoint's, which transformers loads as the model's own.
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt" / "model").eval()
    assert {k for k, _ in eng.iter_weights()} == set(reloaded.state_dict())
    mask = batch["response_mask"].bool()
    for i, row in enumerate(_plain_logprobs(reloaded, vp, batch)):
        torch.testing.assert_close(trained[i][mask[i]], row, atol=ATOL, rtol=0, msg=f"row {i}")
    # The checkpoint holds its pictures' processor (roll-eval and serving load the folder as the original).
    saved = VisionProcessor(tmp_path / "ckpt" / "model")
    msgs = [{"role": "user", "content": as_content("x <image>", 1)}]
    pic = Image.new("RGB", (84, 56), (10, 200, 30))
    (ids_a, mm_a), (ids_b, mm_b) = vp.encode_messages(msgs, [pic]), saved.encode_messages(msgs, [pic])
    assert ids_a == ids_b and mm_a is not None and mm_b is not None
    torch.testing.assert_close(mm_a.tensors, mm_b.tensors, atol=0, rtol=0)
    fresh = HFTrainEngine(path, lr=1e-2)
    fresh.load(tmp_path / "ckpt")
    torch.testing.assert_close(fresh.compute_logprobs(batch)["logprobs"], trained, atol=0, rtol=0)


def test_lora_trains_the_language_model_and_syncs_merged_weights(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from transformers import AutoModelForImageTextToText

    path = _path("tiny-qwen2.5-vl")
    vp = VisionProcessor(path)
    batch = _batch(vp)
    eng = HFTrainEngine(path, lr=1e-2, micro_batch_size=5, lora_rank=4, lora_alpha=8.0)
    adapted = {n for n, p in eng.model.named_parameters() if p.requires_grad}
    assert adapted and all(".lora_" in n and ".language_model." in n for n in adapted)
    base = eng.compute_logprobs(batch)["logprobs"]
    for _ in range(2):
        eng.train_step(batch, PolicyObjective())
    policy = eng.compute_logprobs(batch)["logprobs"]
    assert (policy - base).abs().max() > 1e-3
    torch.testing.assert_close(eng.compute_logprobs(batch, base=True)["logprobs"], base, atol=0, rtol=0)
    merged = dict(eng.iter_weights())
    changed = {k for k, _ in eng.iter_weights(changed_only=True)}
    assert changed and all(".language_model." in k for k in changed)
    plain = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)  # what a weight sync hands an inference engine
    mask = batch["response_mask"].bool()
    for i, row in enumerate(_plain_logprobs(plain, vp, batch)):
        torch.testing.assert_close(policy[i][mask[i]], row, atol=ATOL, rtol=0, msg=f"row {i}")


@pytest.mark.parametrize(
    "family", ["tiny-qwen2.5-vl", *(pytest.param(f, marks=pytest.mark.full_matrix) for f in FAMILY_NAMES[1:])]
)
def test_trainer_logprobs_equal_the_hf_infer_engines_sampling(family: str) -> None:
    from roll_engines.infer.hf import HFInferEngine

    path = _path(family)
    vp = VisionProcessor(path)
    prompts = _prompts(vp)
    infer = HFInferEngine(path, max_new_tokens=8, temperature=0.8)
    n = 3
    gen = infer.generate([p for p, _ in prompts], infer.defaults.replace(seed=5), n=n, mm=[m for _, m in prompts])
    p_ids, p_mask = pad_left([p for p, _ in prompts for _ in range(n)], infer.pad_id)
    batch: dict[str, Any] = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(responses=gen.responses, response_mask=gen.response_mask)
    batch["mm_inputs"] = [m for _, m in prompts for _ in range(n)]
    train = HFTrainEngine(path, role="reference")
    logp = train.compute_logprobs(batch, temperature=0.8)["logprobs"]
    torch.testing.assert_close(logp * gen.response_mask, gen.logprobs, atol=2e-4, rtol=1e-4)


def test_megatron_refuses_a_vision_model_naming_the_engines_that_train_it() -> None:
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    from roll_core.errors import ConfigError
    from roll_engines.train.megatron import MegatronTrainEngine

    message = r"cannot train the vision-language model '(qwen2_5_vl|llava)'.* train_engine=hf or train_engine=fsdp2"
    for family in ("tiny-qwen2.5-vl", "tiny-llava"):
        with pytest.raises(ConfigError, match=message):  # before any process group or model is built
            MegatronTrainEngine(_path(family), dist_backend="gloo", use_distributed_optimizer=False)


# ---- fsdp2: two gloo ranks -------------------------------------------------------------------------------------
FSDP_ROWS = [*ROWS, 4, 4]  # two text-only rows at the end (rank 1's)


def _fsdp2_rank(rank: int, port: int, path: str, out: str) -> None:
    """One of two fsdp2 ranks: log-probs and gradients of its half of the batch. Rank 1's last micro-batch is the
    two text-only rows while rank 0's has pictures: the vision tower's gradients are None on rank 1 only."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    batch = _batch(VisionProcessor(path), FSDP_ROWS)
    rows = torch.arange(6) if rank == 0 else torch.arange(6, len(FSDP_ROWS))
    part = {k: (v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows.tolist()]) for k, v in batch.items()}
    eng = FSDP2TrainEngine(path, dist_backend="gloo", lr=1e-3, micro_batch_size=2, num_threads=1)
    scored = eng.compute_logprobs(part)
    grads = eng.compute_gradients(part, PolicyObjective())
    if rank == 0:
        torch.save({"grads": grads}, out)
    torch.save({"logprobs": scored["logprobs"]}, f"{out}.{rank}")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


# torch warns when an FSDP2 root returns a view (the VLM's logits do); a false alarm, as in test_train_conformance.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
def test_fsdp2_one_rank_equals_hf_on_a_multimodal_batch() -> None:
    """The FSDP2 wrap of a VLM (decoder layers under model.language_model, the tower in the root unit) in this
    process (a gloo group of one): log-probs and gradients of the text-and-pictures batch equal hf's."""
    import torch.distributed as dist

    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    path = _path("tiny-qwen2.5-vl")
    batch = _batch(VisionProcessor(path), FSDP_ROWS)
    try:
        eng = FSDP2TrainEngine.conformance_engine(path, lr=1e-3, micro_batch_size=3)
        got, grads = eng.compute_logprobs(batch)["logprobs"], eng.compute_gradients(batch, PolicyObjective())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    hf = HFTrainEngine(path, lr=1e-3, micro_batch_size=4)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], hf.compute_logprobs(batch)["logprobs"][mask], atol=ATOL, rtol=0)
    expected = hf.compute_gradients(batch, PolicyObjective())
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


@pytest.mark.full_matrix  # two spawned ranks: ~10 s more than the in-process rank above
def test_fsdp2_two_ranks_equal_hf_on_a_multimodal_batch(tmp_path: Path) -> None:
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    path = _path("tiny-qwen2.5-vl")
    out = tmp_path / "fsdp2.pt"
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "transformers", "roll_engines.train.fsdp2", "roll_core.multimodal"]
    )
    ranks = mp.start_processes(
        _fsdp2_rank, args=(free_port(), path, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=1):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two fsdp2 ranks did not finish in 180 s")
    batch = _batch(VisionProcessor(path), FSDP_ROWS)
    hf = HFTrainEngine(path, lr=1e-3, micro_batch_size=4)
    want = hf.compute_logprobs(batch)["logprobs"]
    got = torch.cat([torch.load(f"{out}.{r}")["logprobs"] for r in (0, 1)])
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=ATOL, rtol=0)
    expected = hf.compute_gradients(batch, PolicyObjective())
    grads = torch.load(out)["grads"]
    assert grads.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
