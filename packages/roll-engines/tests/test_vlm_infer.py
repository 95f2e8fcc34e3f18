"""The hf inference engine with a vision-language model (tiny random Qwen2.5-VL, `builtin:tiny-qwen2.5-vl`).

- Sampled log-probs of a batch mixing one-picture, two-picture and text prompts equal a teacher-forced
  transformers forward over prompt + response (pictures through the vision tower, 3D rotary positions), to 1e-4.
- Continuous batching: requests with other pictures and prompt lengths joining a running batch mid-decode give
  the greedy tokens and log-probs each gives alone; equal ids with other pictures are two prompts, not one.
- Prefix cache: a conversation's next turn reuses the cached KV only when its pictures are the cached ones (equal
  ids with another picture re-encode everything), including a next turn that adds a picture.
- A request whose placeholders and picture features disagree is a ValueError naming it, raised to its caller while
  the running batch carries on; pictures sent to a text model are refused the same way.
- A picture whose pixels the vision tower cannot take (found only at the prefill) fails its own request, naming it;
  the requests prefilled with it and those decoding give the tokens they give without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from PIL import Image
from torch import Tensor

from roll_core.interfaces import Request, SamplingParams
from roll_core.models import resolve_model_path
from roll_core.multimodal import MMInputs, VisionProcessor, as_content, merge
from roll_engines.infer.hf import HFInferEngine

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


Loaded = tuple[str, VisionProcessor, HFInferEngine]


@pytest.fixture(scope="module")
def loaded() -> Iterator[dict[str, Loaded]]:
    """One engine per family for the whole module (built on first use)."""
    cache: dict[str, Loaded] = {}
    yield cache
    for _, _, eng in cache.values():
        eng.shutdown()


def _load(cache: dict[str, Loaded], name: str) -> Loaded:
    if name not in cache:
        path = resolve_model_path(f"builtin:{name}")
        cache[name] = (path, VisionProcessor(path), HFInferEngine(path, max_num_seqs=8))
    return cache[name]


@pytest.fixture(params=["tiny-qwen2.5-vl", "tiny-llava"])
def family(request: pytest.FixtureRequest, loaded: dict[str, Loaded]) -> Loaded:
    """Qwen2.5-VL (3D mrope positions, patch-level pixel rows) and LLaVA (1D positions, one pixel row a picture)."""
    return _load(loaded, request.param)


@pytest.fixture
def vl_path(loaded: dict[str, Loaded]) -> str:
    return _load(loaded, "tiny-qwen2.5-vl")[0]


@pytest.fixture
def vp(loaded: dict[str, Loaded]) -> VisionProcessor:
    return _load(loaded, "tiny-qwen2.5-vl")[1]


@pytest.fixture
def engine(loaded: dict[str, Loaded]) -> HFInferEngine:
    return _load(loaded, "tiny-qwen2.5-vl")[2]


def picture(colour: tuple[int, int, int], size: tuple[int, int] = (60, 40), seed: int = 0) -> Any:
    """A picture with some texture (a flat one gives near-identical patches whatever its colour)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 60, (size[1], size[0], 3), generator=g)
    arr = (torch.tensor(colour).clamp(0, 195) + noise).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


def prompt(vp: VisionProcessor, text: str, images: list[Any]) -> tuple[list[int], MMInputs | None]:
    return vp.encode_messages([{"role": "user", "content": as_content(text, len(images))}], images)


def teacher_forced(model: Any, ids: list[int], response: list[int], mm: MMInputs | None, image_token: int) -> Tensor:
    """log p(response | prompt) from one transformers forward over prompt + response: picture features scattered
    into the prompt's placeholders, positions from the model's get_rope_index. A sampled placeholder token in the
    response is a text token (no picture behind it), as in the engine's decode. Qwen2-VL / Qwen2.5-VL only (Qwen3-VL
    adds deepstack features at inner layers, LLaVA has no get_rope_index)."""
    inner = model.model
    full = torch.tensor([ids + response])
    attn = torch.ones_like(full)
    in_prompt = torch.zeros_like(full, dtype=torch.bool)
    in_prompt[:, : len(ids)] = full[:, : len(ids)] == image_token
    embeds = inner.get_input_embeddings()(full)
    grid = None
    if mm is not None:
        grid = mm.tensors["image_grid_thw"]
        feats = inner.get_image_features(mm.tensors["pixel_values"], grid, return_dict=True).pooler_output
        embeds = embeds.masked_scatter(in_prompt[..., None], torch.cat(feats).to(embeds.dtype))
    pos, _ = inner.get_rope_index(full, mm_token_type_ids=in_prompt.int(), image_grid_thw=grid, attention_mask=attn)
    with torch.no_grad():
        logits = model(inputs_embeds=embeds, attention_mask=attn, position_ids=pos).logits
    logp = torch.log_softmax(logits[0, len(ids) - 1 : -1].float(), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_sampled_logprobs_equal_a_teacher_forced_forward(engine: HFInferEngine, vp: VisionProcessor) -> None:
    one = prompt(vp, "what colour is <image> ?", [picture((200, 10, 10))])
    two = prompt(vp, "<image> or <image>", [picture((10, 10, 200), (30, 90), 1), picture((10, 200, 10), (90, 30), 2)])
    text = (vp.tokenizer(vp.render([{"role": "user", "content": "no picture"}]))["input_ids"], None)
    other = prompt(vp, "what colour is <image> ?", [picture((10, 200, 200), seed=3)])  # one's ids, another picture
    assert len({len(one[0]), len(two[0]), len(text[0])}) == 3 and two[1].num_images == 2 and other[0] == one[0]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=7)
    prompts = [one, two, text, other]
    out = engine.generate([p for p, _ in prompts], params, n=2, mm=[m for _, m in prompts])
    assert out.responses.shape == (8, 10) and out.response_mask.all()
    for row in range(8):
        ids, mm = prompts[row // 2]
        response = out.responses[row].tolist()
        ref = teacher_forced(engine.model, ids, response, mm, vp.image_token_id)
        torch.testing.assert_close(out.logprobs[row], ref, atol=1e-4, rtol=0)
    # The pictures reach the policy: the same ids and response with another picture have other log-probs.
    resp = out.responses[0].tolist()
    assert not torch.allclose(teacher_forced(engine.model, one[0], resp, other[1], vp.image_token_id), out.logprobs[0])


def _drive(engine: HFInferEngine, futures: list) -> None:
    while not all(f.done() for f in futures):
        engine.batcher.step()


def test_requests_joining_mid_decode_equal_each_alone(family: Loaded) -> None:
    _, vp, engine = family
    red, blue = picture((200, 10, 10)), picture((10, 10, 200), seed=5)
    a = prompt(vp, "hi <image> ?", [red])
    c = prompt(vp, "hi <image> ?", [blue])  # the same ids as a, another picture
    b = prompt(vp, "two: <image> and <image>, which?", [blue, picture((10, 200, 10), (30, 90), 6)])
    d = (vp.tokenizer(vp.render([{"role": "user", "content": "only text here"}]))["input_ids"], None)
    assert a[0] == c[0] and len({len(a[0]), len(b[0]), len(d[0])}) == 3
    reqs = {k: Request(k, list(ids), GREEDY, mm) for k, (ids, mm) in zip("abcd", (a, b, c, d))}
    alone = {k: engine.generate([r.prompt_ids], GREEDY, mm=[r.mm]) for k, r in reqs.items()}
    # Stepped by hand (the engine's lock held: no other thread steps) so arrivals land at known decode steps.
    with engine._lock:
        futs = {"a": engine._enqueue(reqs["a"]), "c": engine._enqueue(reqs["c"])}  # one prefill, two prompts
        for _ in range(3):
            engine.batcher.step()
        assert len(engine.batcher.running) == 2
        futs["b"] = engine._enqueue(reqs["b"])
        for _ in range(2):
            engine.batcher.step()
        assert len(engine.batcher.running) == 3
        futs["d"] = engine._enqueue(reqs["d"])
        _drive(engine, list(futs.values()))
    for k, fut in futs.items():
        got, ref = fut.result(), alone[k]
        assert got.token_ids == ref.responses[0].tolist(), k
        assert got.logprobs == pytest.approx(ref.logprobs[0].tolist(), abs=1e-4), k
    assert futs["a"].result().logprobs != pytest.approx(futs["c"].result().logprobs, abs=1e-4)


def test_prefix_cache_reuses_only_the_same_pictures(family: Loaded) -> None:
    vl_path, vp, engine = family
    red, green, blue = picture((200, 10, 10), seed=8), picture((10, 200, 10), seed=9), picture((10, 10, 200))
    plain = HFInferEngine(vl_path, prefix_cache_mb=0)
    first, first_mm = prompt(vp, "look: <image>", [red])
    obs = vp.tokenizer("<|user|>and now?\n<|assistant|>", add_special_tokens=False)["input_ids"]

    def run(eng: HFInferEngine, ids: list[int], mm: MMInputs | None) -> Any:
        return eng.submit(Request(f"r{len(ids)}", ids, GREEDY, mm)).result(timeout=120)

    engine.load_weights(dict(engine.model.state_dict()))  # a clean store (a weight update empties it)
    turn1 = run(engine, first, first_mm)
    nxt = first + turn1.token_ids + obs
    # The same ids with the other picture: must not reuse the red picture's keys and values.
    hits = engine.batcher.prefixes.hits
    other = run(engine, nxt, prompt(vp, "look: <image>", [green])[1])
    ref = run(plain, nxt, prompt(vp, "look: <image>", [green])[1])
    assert other.token_ids == ref.token_ids
    assert other.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert engine.batcher.prefixes.hits == hits
    # The same picture: reused (only the new tokens encoded), and equal to encoding everything.
    turn1 = run(engine, first, first_mm)
    same = run(engine, nxt, first_mm)
    assert engine.batcher.prefixes.hits == hits + 1
    ref = run(plain, nxt, first_mm)
    assert same.token_ids == ref.token_ids and same.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    # A next turn that adds a picture: the cached prefix holds the first, the new one goes through the tower.
    more, more_mm = vp.encode_messages([{"role": "user", "content": as_content("<image> too", 1)}], [blue])
    third, third_mm = nxt + same.token_ids + more, merge([first_mm, more_mm])
    got = run(engine, third, third_mm)
    assert engine.batcher.prefixes.hits == hits + 2
    ref = run(plain, third, third_mm)
    assert got.token_ids == ref.token_ids and got.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    plain.shutdown()


def test_placeholder_feature_mismatch_is_an_error_for_that_request(engine: HFInferEngine, vp: VisionProcessor) -> None:
    ids, mm = prompt(vp, "count <image>", [picture((90, 90, 10))])
    short = list(ids)
    short.remove(vp.image_token_id)  # one placeholder fewer than the picture's features
    long_run = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=1)
    running = engine.submit(Request("good", ids, long_run, mm))
    with pytest.raises(ValueError, match=r"request 'bad'.*image placeholder token\(s\).*feature"):
        engine.submit(Request("bad", short, GREEDY, mm))
    with pytest.raises(ValueError, match="request 'no-pictures'"):  # placeholders without their pictures
        engine.submit(Request("no-pictures", ids, GREEDY, None))
    out = running.result(timeout=120)
    assert len(out.token_ids) == 40 and out.finish_reason == "length"
    # The batch API checks every prompt before any starts.
    with pytest.raises(ValueError, match="image placeholder"):
        engine.generate([ids, short], GREEDY, mm=[mm, mm])
    assert not engine.batcher.has_work()
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([ids], GREEDY, mm=[mm, mm])


def test_a_picture_the_tower_cannot_take_fails_only_its_request(engine: HFInferEngine, vp: VisionProcessor) -> None:
    """Pixel rows that do not fit the vision tower (a picture processed for another patch size) pass the placeholder
    check and fail in the prefill. Only that request fails, with an error naming it; the requests admitted with it
    and the one already decoding give the tokens (and seeded samples) they give without it; the engine goes on."""
    a = prompt(vp, "hi <image> ?", [picture((200, 10, 10))])
    b = prompt(vp, "what <image> is it", [picture((10, 10, 200), seed=3)])
    c = prompt(vp, "two: <image> and <image>", [picture((10, 200, 10), (30, 90), 6), picture((90, 90, 10), seed=4)])
    d = (vp.tokenizer(vp.render([{"role": "user", "content": "only text here"}]))["input_ids"], None)
    t = b[1].tensors
    bad = MMInputs({**t, "pixel_values": t["pixel_values"][:, :-3]}, b[1].tokens_per_image, ["other"])
    seeded = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=11)
    long_run = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)

    def run(with_bad: bool) -> dict[str, Any]:
        with engine._lock:  # stepped by hand: the new requests are admitted together while "running" decodes
            futs = {"running": engine._enqueue(Request("running", c[0], long_run, c[1]))}
            for _ in range(3):
                engine.batcher.step()
            news = [("a", a, seeded), ("bad", (b[0], bad), GREEDY), ("b", b, GREEDY), ("d", d, seeded)]
            for k, (ids, mm), params in news:
                if with_bad or k != "bad":
                    futs[k] = engine._enqueue(Request(k, list(ids), params, mm))
            _drive(engine, list(futs.values()))
        return futs

    ref, got = run(with_bad=False), run(with_bad=True)
    with pytest.raises(RuntimeError, match=r"request 'bad': its prefill failed \(RuntimeError: shape") as err:
        got["bad"].result()
    assert isinstance(err.value.__cause__, RuntimeError)
    assert set(got) == {*ref, "bad"}
    for k, fut in ref.items():
        assert got[k].result().token_ids == fut.result().token_ids, k
        assert got[k].result().logprobs == pytest.approx(fut.result().logprobs, abs=1e-4), k
    assert len(got["running"].result().token_ids) == 16
    # The batch API runs the others and then raises, naming the caller's prompt.
    with pytest.raises(RuntimeError, match=r"^hf engine: prompt 1 \(row 2\): its prefill failed") as err:
        engine.generate([a[0], b[0], d[0]], GREEDY, n=2, mm=[a[1], bad, None])
    assert "generate-" not in str(err.value)  # an internal id the caller never saw
    assert not engine.batcher.has_work()
    out = engine.generate([b[0]], GREEDY, mm=[b[1]])  # and serves the next call
    assert out.responses[0].tolist() == ref["b"].result().token_ids


def test_a_text_model_refuses_pictures(vp: VisionProcessor) -> None:
    text = HFInferEngine("builtin:tiny")
    _, mm = prompt(vp, "<image>", [picture((1, 2, 3))])
    with pytest.raises(ValueError, match=r"request 'pic'.*1 picture\(s\).*not a vision-language model"):
        text.submit(Request("pic", [5, 6, 7], GREEDY, mm))
    text.shutdown()


def test_placeholders_collapse_to_one_per_picture_for_vllm(vp: VisionProcessor) -> None:
    """vLLM expands one placeholder per picture itself: the engine sends the collapsed form, which the processor's
    own expansion turns back into the request's ids (two adjacent pictures included)."""
    from roll_engines.infer._vision import collapse_placeholders

    pics = [picture((9, 9, 9)), picture((90, 9, 9), (90, 30), 1), picture((9, 90, 9))]
    ids, mm = prompt(vp, "<image><image> and <image>", pics)
    short = collapse_placeholders(ids, mm, vp.image_token_id)
    assert short.count(vp.image_token_id) == 3 and len(short) == len(ids) - mm.num_tokens + 3
    assert vp.expand(short, mm) == ids
    with pytest.raises(ValueError, match="picture 0 needs"):
        collapse_placeholders([*ids[: ids.index(vp.image_token_id) + 1], 5], mm, vp.image_token_id)
