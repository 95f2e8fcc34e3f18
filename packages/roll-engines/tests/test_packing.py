"""Shared-prompt packing (roll_engines.train._packing) gives what the padded forward gives, with fewer tokens.

The batch has groups of identical prompts of different lengths (left padding), right-padded responses of
different lengths, an empty response, rows of one group not next to each other, and multi-turn rows (one
sharing a group's prompt) with observation holes in the response mask. Tiny Llama in fp32. Tolerances:
log-probs, entropies and values atol 1e-5 (summation-order noise is ~1e-6); gradients rtol 1e-4 / atol 1e-6;
weights after 4 AdamW steps at lr 1e-3 atol 1e-5: AdamW's first steps move a weight by ~lr * sign(grad), so the
rounding noise of a near-zero gradient can move it by up to ~1e-2 * lr (the padded path split into other
micro-batches differs from itself by as much, at 1 or 2 of 95k weights); a wrong gradient moves many by ~lr.
Sliding-window families (Gemma2/3, Mistral, Qwen2 with `use_sliding_window`) pack too, each windowed layer under its
window in padded-row columns: their packed rows are longer than the window, and the block mask alone (the window
dropped) gives other log-probs, so the equality shows the window is applied.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import Tensor

from roll_core.pipelines.objectives import PolicyObjective, ValueObjective
from roll_core.sequences import pad_left
from roll_engines.train._packing import PackedBatch, pack, packed_forward, prompt_order, unsupported_reason
from roll_engines.train.hf import HFTrainEngine

LOGPROB_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
WEIGHT_ATOL = 1e-5


def make_batch(rows: list[tuple[list[int], list[tuple[list[int], int]]]], pad_id: int = 0) -> dict[str, Tensor]:
    """The trainer's layout from (prompt ids, [(piece ids, trained 0/1), ...]) rows, as agentic `to_tensors`
    builds it: observation pieces (trained 0) are attended context with response_mask 0; for single-turn rows
    this is exactly `build_sequences` (the response attention mask equals the response mask)."""
    tokens = [[t for piece, _ in pieces for t in piece] for _, pieces in rows]
    trained = [[m for piece, m in pieces for _ in piece] for _, pieces in rows]
    r = max(len(t) for t in tokens)
    responses = torch.full((len(rows), r), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(rows), r), dtype=torch.long)
    present = torch.zeros((len(rows), r), dtype=torch.long)
    for i, (t, m) in enumerate(zip(tokens, trained)):
        responses[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        response_mask[i, : len(m)] = torch.tensor(m, dtype=torch.long)
        present[i, : len(t)] = 1
    prompts, prompt_mask = pad_left([p for p, _ in rows], pad_id)
    attention_mask = torch.cat([prompt_mask, present], dim=1)
    return {
        "prompts": prompts,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp_min(0),
        "responses": responses,
        "response_mask": response_mask,
    }


def _mixed_batch(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 99, (n,), generator=g).tolist()

    pa, pb, pc, pd = toks(9), toks(4), toks(12), toks(6)
    rows = [
        (pa, [(toks(5), 1)]),
        (pa, [(toks(2), 1)]),
        (pb, [(toks(7), 1)]),
        (pc, [(toks(3), 1)]),
        (pb, [(toks(1), 1)]),
        (pa, [(toks(3), 1), (toks(4), 0), (toks(2), 1)]),  # multi-turn: response, observation, response
        (pb, [([], 1)]),  # an empty response
        (pd, [(toks(2), 1), (toks(1), 0), (toks(3), 1), (toks(2), 0)]),  # ends on an observation
        (pa, [(toks(6), 1)]),  # group a again, not next to the others
    ]
    batch = make_batch(rows)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["ref_logprobs"] = -torch.rand(mask.shape, generator=g) * mask
    batch["values"] = torch.randn(mask.shape, generator=g) * mask
    batch["returns"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def _attended(batch: dict[str, Tensor]) -> Tensor:
    """(B, R) response positions under the attention mask: where both paths compute an output."""
    r = batch["responses"].shape[1]
    return batch["attention_mask"][:, -r:].bool()


def _engines(tiny: str, rows: str = "auto", **kwargs: object) -> tuple[HFTrainEngine, HFTrainEngine]:
    """A padded and a packed engine; `rows` forces the packed layout: "one" row per micro-batch, "many"
    (first-fit rows of the padded width, several segments sharing a row when they fit) or the cost model's."""
    padded = HFTrainEngine(tiny, pack_sequences=False, **kwargs)
    packed = HFTrainEngine(tiny, pack_sequences=True, **kwargs)
    assert packed.pack_sequences and not padded.pack_sequences
    packed.pack_hidden_size = {"one": 10**9, "many": 0, "auto": packed.pack_hidden_size}[rows]
    return padded, packed


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("chunk", "rows"), [(3, "auto"), (16, "one"), (16, "many")])
def test_logprobs_and_entropy_equal_padded(tiny: str, attn: str, chunk: int, rows: str) -> None:
    batch = _mixed_batch()
    padded, packed = _engines(tiny, rows, attn_implementation=attn, logprob_chunk_size=chunk, role="reference")
    want = padded.compute_logprobs(batch, temperature=0.7, with_entropy=True)
    got = packed.compute_logprobs(batch, temperature=0.7, with_entropy=True)
    m = _attended(batch)
    for key in ("logprobs", "entropy"):
        assert got[key].shape == want[key].shape == m.shape
        torch.testing.assert_close(got[key][m], want[key][m], atol=LOGPROB_ATOL, rtol=0, msg=key)
        assert (got[key][~m] == 0).all()  # nothing is computed outside the attention mask
    assert packed.forward_tokens < padded.forward_tokens


@pytest.mark.parametrize(("micro", "rows"), [(2, "auto"), (4, "auto"), (9, "one"), (9, "many")])
def test_gradients_equal_padded(tiny: str, micro: int, rows: str) -> None:
    batch = _mixed_batch(1)
    padded, packed = _engines(tiny, rows, micro_batch_size=micro)
    # Non-trivial ratios (clipping acts), a KL term and an entropy bonus: every output carries gradient.
    old = padded.compute_logprobs(batch)["logprobs"].detach()
    batch["old_logprobs"] = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    objective = PolicyObjective(agg="seq-mean-token-mean", kl_loss_coef=0.1, entropy_coef=0.01)
    want = padded.compute_gradients(batch, objective)
    got = packed.compute_gradients(batch, objective)
    assert want.keys() == got.keys() and all(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_train_step_gives_the_same_weights(tiny: str) -> None:
    batch = _mixed_batch(2)
    padded, packed = _engines(tiny, lr=1e-3, micro_batch_size=5)  # several segments per packed row
    before = padded.get_weights()
    kwargs = dict(mini_batches=2, epochs=2, shuffle_seed=7)
    m_pad = padded.train_step(batch, PolicyObjective(entropy_coef=0.01), **kwargs)
    m_pack = packed.train_step(batch, PolicyObjective(entropy_coef=0.01), **kwargs)
    assert m_pack["grad_norm"] == pytest.approx(m_pad["grad_norm"], rel=1e-4)
    assert m_pack["forward_tokens"] < m_pad["forward_tokens"]
    after = packed.get_weights()
    for name, w in padded.get_weights().items():
        assert not torch.equal(w, before[name]), f"{name} did not train"
        torch.testing.assert_close(after[name], w, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_critic_values_and_gradients_equal_padded(tiny: str) -> None:
    batch = _mixed_batch(3)
    padded, packed = _engines(tiny, "many", role="critic", lr=1e-3, micro_batch_size=4)
    want, got = padded.compute_values(batch)["values"], packed.compute_values(batch)["values"]
    m = _attended(batch)
    torch.testing.assert_close(got[m], want[m], atol=LOGPROB_ATOL, rtol=0)
    g_want = padded.compute_gradients(batch, ValueObjective())
    g_got = packed.compute_gradients(batch, ValueObjective())
    assert g_want.keys() == g_got.keys()
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_a_group_runs_as_one_sequence_with_its_prompt_once(tiny: str) -> None:
    # The quickstart's shape, scaled down: 2 prompts x 4 samples, long prompts, short answers.
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (30, 27)]
    lens = [[5, 3, 6, 2], [4, 4, 1, 5]]
    rows = [(prompts[k], [(torch.randint(3, 99, (n,), generator=g).tolist(), 1)]) for k in range(2) for n in lens[k]]
    batch = make_batch(rows)
    first = [batch[k][:4] for k in ("input_ids", "attention_mask", "position_ids", "responses")]
    packed = pack(*first, hidden_size=64)
    assert packed is not None and packed.input_ids.shape == (1, 30 + sum(lens[0]))
    # Each response continues its prompt's positions: 30, 31, ...
    assert packed.position_ids[0, 30:35].tolist() == list(range(30, 35))
    assert packed.position_ids[0, 35:38].tolist() == list(range(30, 33))
    a = packed.allowed[0, 0]
    assert a[31, :30].all() and a[35, :30].all()  # both responses see the whole prompt
    assert not a[35, 30:35].any() and not a[34, 35:].any()  # never a sibling response (before or after)

    padded, engine = _engines(tiny, logprob_chunk_size=4, role="reference")
    padded.compute_logprobs(batch)
    engine.compute_logprobs(batch)
    assert padded.forward_tokens == 8 * batch["input_ids"].shape[1] == 8 * (30 + 6)
    assert engine.forward_tokens == (30 + sum(lens[0])) + (27 + sum(lens[1]))  # one row per group, no padding


def test_prompt_order_groups_rows_stably() -> None:
    batch = _mixed_batch()
    r = batch["responses"].shape[1]
    order = prompt_order(batch["input_ids"], batch["attention_mask"], batch["position_ids"], r)
    assert order.tolist() == [0, 1, 5, 8, 2, 4, 6, 3, 7]


def test_unpackable_micro_batches_and_models_fall_back(
    tiny: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    batch = _mixed_batch()
    ids, am, pos, resp = (batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses"))
    holes = am.clone()
    holes[0, -resp.shape[1]] = 0  # a response whose attention is not a prefix
    assert pack(ids, holes, pos, resp, 64) is None
    no_tokens = am.clone()
    no_tokens[:, -resp.shape[1] :] = 0
    assert pack(ids, no_tokens, pos, resp, 64) is None

    engine = HFTrainEngine(tiny, role="reference")
    assert unsupported_reason(engine.model) is None
    engine.model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in unsupported_reason(engine.model)

    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(
        vocab_size=99,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        window_size=4,
        attention_types=[[["global", "local"], 1]],
    )
    GPTNeoForCausalLM(cfg).save_pretrained(tmp_path / "gpt-neo")
    with caplog.at_level(logging.WARNING, logger="roll_engines.train.hf"):
        neo = HFTrainEngine(str(tmp_path / "gpt-neo"), role="reference", attn_implementation="eager")
    assert not neo.pack_sequences and "local layers" in caplog.text
    out = neo.compute_logprobs(batch)["logprobs"]
    assert neo.forward_tokens == ids.numel() and torch.isfinite(out).all()


# ---- model families: the packed forward equals the padded one, or the family is refused -----------------------
# Tiny fp32 models built from configs, weights drawn at std 0.3 so each log-prob depends on its context (at the
# default init they are ~uniform and any mask gives the same numbers): log-probs spread by ~1.5 nats, summation noise
# ~1e-6, a wrong attention pattern moves them by 0.1 to 5.

_SMALL = dict(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _family(name: str) -> tuple[torch.nn.Module, str]:
    """(model, attn_implementation) of a tiny `name` model with sharpened weights."""
    import transformers as tf

    heads = dict(num_key_value_heads=2, head_dim=16)
    configs = {
        "llama": lambda: tf.LlamaConfig(**_SMALL, **heads),
        # Qwen2.5's checkpoints: a window in the config, switched off.
        "qwen2": lambda: tf.Qwen2Config(**_SMALL, **heads, sliding_window=4, use_sliding_window=False),
        "qwen2-window": lambda: tf.Qwen2Config(
            **_SMALL, **heads, sliding_window=4, use_sliding_window=True, max_window_layers=0
        ),
        "gemma": lambda: tf.GemmaConfig(**_SMALL, **heads),
        # One full-attention layer and one windowed (Qwen2 windows the layers from `max_window_layers` on).
        "qwen2-mixed": lambda: tf.Qwen2Config(
            **_SMALL, **heads, sliding_window=4, use_sliding_window=True, max_window_layers=1
        ),
        "gemma2": lambda: tf.Gemma2Config(**_SMALL, **heads, sliding_window=4),
        "gemma3": lambda: tf.Gemma3TextConfig(**_SMALL, **heads, sliding_window=4, sliding_window_pattern=2),
        "gemma3-bidirectional": lambda: tf.Gemma3TextConfig(
            **_SMALL, **heads, sliding_window=4, sliding_window_pattern=2, use_bidirectional_attention=True
        ),
        "mistral-window": lambda: tf.MistralConfig(**_SMALL, **heads, sliding_window=4),
        "gpt-neo-local": lambda: tf.GPTNeoConfig(
            vocab_size=99,
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            window_size=4,
            attention_types=[[["global", "local"], 1]],
        ),
        "mpt-alibi": lambda: tf.MptConfig(vocab_size=99, d_model=32, n_heads=2, n_layers=2),
        "lfm2-conv": lambda: tf.Lfm2Config(**_SMALL, **heads, layer_types=["conv", "full_attention"]),
    }
    cfg = configs[name]()
    attn = "eager" if name.split("-")[0] in ("gpt", "mpt", "gemma2", "gemma3") else "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    model.config.use_cache = False
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model, attn


def _family_batch() -> dict[str, Tensor]:
    """Two prompts of different lengths (left padding), responses of 1 to 7 tokens and an empty one, one group's
    rows apart, every packed row longer than the 4-token windows of the windowed families."""
    g = torch.Generator().manual_seed(5)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 99, (n,), generator=g).tolist()

    pa, pb = toks(9), toks(4)
    return make_batch(
        [
            (pa, [(toks(5), 1)]),
            (pa, [(toks(2), 1)]),
            (pb, [(toks(7), 1)]),
            (pa, [(toks(6), 1)]),
            (pb, [([], 1)]),
            (pb, [(toks(1), 1)]),
        ]
    )


def _padded_and_packed(model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, PackedBatch]:
    """(B, R) response log-probs at temperature 0.7 of the padded forward, and the batch packed in one row."""
    ids, am, pos, resp = (batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses"))
    r = resp.shape[1]
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, -r - 1 : -1].float() / 0.7
    want = torch.gather(logits.log_softmax(-1), -1, resp[..., None])[..., 0]
    packed = pack(ids, am, pos, resp, hidden_size=10**9)
    assert packed is not None and packed.input_ids.shape[0] == 1
    return want, packed


def _block_masked(model: torch.nn.Module, packed: PackedBatch) -> Tensor:
    """(B, R) log-probs at temperature 0.7 of the packed row under the block mask alone in every layer (no window:
    what packing gave a windowed model before its windows were masked)."""
    mask = packed.attention_mask(model.config._attn_implementation)
    out = model(
        input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, logits_to_keep=packed.keep
    )
    logits = out.logits.float() / 0.7
    return packed.scatter(logits.log_softmax(-1)[packed.source, packed.targets])


WINDOWED = ["gemma3", "gemma2", "mistral-window", "qwen2-window", "qwen2-mixed"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma", *WINDOWED])
def test_families_pack_to_the_padded_logprobs_and_gradients(name: str) -> None:
    model, _ = _family(name)
    assert unsupported_reason(model) is None
    batch = _family_batch()
    m = _attended(batch)
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(6)) * m
    want, packed = _padded_and_packed(model, batch)
    got = packed_forward(model, packed, critic=False, temperature=0.7)["logprobs"]
    assert want[m].std() > 0.5  # the log-probs depend on the context: a wrong mask would show
    torch.testing.assert_close(got[m], want[m], atol=LOGPROB_ATOL, rtol=0)
    if name in WINDOWED:  # the window matters here: without it the packed row gives other log-probs
        with torch.no_grad():
            assert (_block_masked(model, packed)[m] - want[m]).abs().max() > 0.05
    grads = []
    for out in (want, got):
        model.zero_grad(set_to_none=True)
        (out * weights)[m].sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():  # sharpened weights give gradients ~10: summation noise ~1e-5 of the largest
        torch.testing.assert_close(grads[1][n], g, rtol=GRAD_RTOL, atol=1e-5 * float(g.abs().max()), msg=n)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("gpt-neo-local", "local layers"),  # GPT-Neo's 256-token local attention (here 4) was let through
        ("mpt-alibi", "ALiBi"),  # MPT builds its ALiBi bias in `build_mpt_alibi_tensor`: was let through
        ("lfm2-conv", "conv layers"),
        ("gemma3-bidirectional", "bidirectional"),
    ],
)
def test_families_whose_layers_see_the_row_order_are_refused(name: str, reason: str) -> None:
    model, _ = _family(name)
    with torch.no_grad():
        want, packed = _padded_and_packed(model, _family_batch())
        got = _block_masked(model, packed)
    m = _attended(_family_batch())
    assert (got[m] - want[m]).abs().max() > 0.05  # packing would give these models other log-probs
    assert reason in (unsupported_reason(model) or "")
    if name != "mpt-alibi":  # (its bias is no mask matter: the engine's check refuses it)
        with pytest.raises(ValueError, match=reason):  # the packed forward refuses to give them wrong numbers
            packed_forward(model, packed, critic=False)


def test_sliding_windows_of_a_vision_language_model_are_refused() -> None:
    """Gemma3's vision-language forward builds its picture tokens' (bidirectional) masks itself: a window there is
    not packed (its text model alone is)."""
    import transformers as tf

    text = dict(**_SMALL, num_key_value_heads=2, head_dim=16, sliding_window=4, sliding_window_pattern=2)
    text["vocab_size"] = 300
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    cfg = tf.Gemma3Config(
        text_config=text,
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    assert "vision-language" in (unsupported_reason(tf.Gemma3ForConditionalGeneration(cfg)) or "")


@pytest.mark.parametrize("packed", [True, False])
def test_gather_ids_out_of_the_vocabulary_are_refused(tiny: str, packed: bool) -> None:
    batch = _mixed_batch()
    engine = HFTrainEngine(tiny, role="reference", pack_sequences=packed)
    r = batch["responses"].shape[1]
    for bad in (-1, engine.model.config.vocab_size):
        ids = torch.zeros((batch["responses"].shape[0], r, 2), dtype=torch.long)
        ids[0, 0, 1] = bad  # advanced indexing would read -1 as the vocabulary's last token
        with torch.no_grad(), pytest.raises(ValueError, match="gather ids must be token ids"):
            engine._forward(batch, 1.0, False, gather_ids=ids)


# ---- the engine packs a sliding-window model: Gemma3 text (window 8, then a global layer) ---------------------


@pytest.fixture(scope="module")
def tiny_gemma3(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """roll's tiny random Gemma3 text model (conf/model/gemma3.yaml's test model): a sliding-window layer (window 8,
    shorter than the packed rows and than most padded rows of `_mixed_batch`) and a global one."""
    from roll_core.testing.models import tiny_model

    return tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))


def _sharpen(engine: HFTrainEngine) -> None:
    """The same weights in every engine, drawn at std 0.3 (see `_family`): each log-prob depends on its context."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in engine.model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gemma3_engine_packs_to_the_padded_logprobs_and_gradients(tiny_gemma3: str, attn: str) -> None:
    batch = _mixed_batch(1)
    padded, packed = _engines(tiny_gemma3, "many", attn_implementation=attn, micro_batch_size=9)  # packs (asserted)
    for engine in (padded, packed):
        _sharpen(engine)
    m = _attended(batch)
    want = padded.compute_logprobs(batch, temperature=0.7)["logprobs"]
    got = packed.compute_logprobs(batch, temperature=0.7)["logprobs"]
    assert packed.forward_tokens < padded.forward_tokens  # the packed forward ran
    assert want[m].std() > 0.5
    torch.testing.assert_close(got[m], want[m], atol=LOGPROB_ATOL, rtol=0)
    # The window matters: the block mask alone in both layers gives other log-probs.
    rows = [batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses")]
    one = pack(*rows, hidden_size=0)
    assert one is not None and int(one.allowed[..., 0, :, :].sum(-1).max()) > 8  # rows attend past the window
    with torch.no_grad():
        assert (_block_masked(packed.model, one)[m] - want[m]).abs().max() > 0.05

    batch["old_logprobs"] = want.detach() + 0.3 * torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    objective = PolicyObjective(agg="seq-mean-token-mean", kl_loss_coef=0.1, entropy_coef=0.01)
    g_want = padded.compute_gradients(batch, objective)
    g_got = packed.compute_gradients(batch, objective)
    assert g_want.keys() == g_got.keys() and all(g.abs().sum() > 0 for g in g_want.values())
    for n, g in g_want.items():  # sharpened weights: summation noise ~1e-5 of the largest gradient
        torch.testing.assert_close(g_got[n], g, rtol=GRAD_RTOL, atol=1e-5 * float(g.abs().max()), msg=n)
