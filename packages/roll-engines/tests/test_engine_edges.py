"""Edges of the engines' APIs met by direct callers (the trainer and the pipelines never send them):
- the hf inference engine's `generate` names a failed row by the caller's prompt index and row, never by the
  internal request id it made up (a structured-output ConstraintViolation, a PrefillError);
- the hf inference engine refuses the sampling params vLLM refuses (an empty stop string, stop token ids that are
  not token ids of the model), so one set of params does not run on one engine and fail on the other;
- the train engines refuse a scoring/training temperature below GREEDY_TEMPERATURE (logits / 0: inf and NaN);
- the JSON-schema checks compute outlines-core's reading of each node once.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from roll_core.interfaces import Request, SamplingParams
from roll_core.interfaces.inference import GREEDY_TEMPERATURE, StructuredOutput
from roll_core.protocol import build_sequences, pad_left


@pytest.fixture(scope="module")
def infer(tiny: str) -> Any:
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(tiny, max_new_tokens=8, num_threads=1, prefix_cache_mb=0)
    yield engine
    engine.shutdown()


# ---- generate names the caller's row ---------------------------------------------------------------------------


def test_a_constraint_violation_in_generate_names_the_prompt_and_row(
    infer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 2 (prompt 1, sample 0 of n=2) gets a matcher whose mask lets through a token its constraint refuses: the
    error `generate` raises names prompt 1 and row 2 and the constraint's state, not the request id it made up
    ("generate-<hex>", which the caller never saw). The request API still names the caller's own request id."""
    pytest.importorskip("outlines_core")
    from roll_engines.structured import ConstraintViolation

    tok = infer.tokenizer
    b = tok.convert_tokens_to_ids("b")
    params = SamplingParams(temperature=0.9, max_new_tokens=6, seed=3, structured=StructuredOutput(regex="ab"))
    make = infer._matcher
    made: list[Any] = []

    def matcher(constraint: StructuredOutput) -> Any:
        m = make(constraint)
        if len(made) == 2:  # row 2: its mask allows only 'b', where the constraint needs 'a'
            keep = torch.zeros(infer._vocab, dtype=torch.bool)
            keep[b] = True
            m.keep = lambda width: keep[:width]
        made.append(m)
        return m

    monkeypatch.setattr(infer, "_matcher", matcher)
    prompts = [tok("hello")["input_ids"], tok("{name}")["input_ids"]]
    with pytest.raises(ConstraintViolation) as err:
        infer.generate(prompts, params, n=2)
    msg = str(err.value)
    assert msg.startswith("hf engine: prompt 1 (row 2): structured output regex 'ab' (automaton state ")
    assert f"sampled token {b} " in msg and "generate-" not in msg
    assert err.value.request_id.startswith("generate-")  # kept for whoever must abort it
    assert isinstance(err.value.__cause__, ConstraintViolation) and not infer.batcher.running
    made[:] = [None, None]  # the next matcher made is broken
    bad = infer.submit(Request("mine-bad", prompts[0], params))
    with pytest.raises(ConstraintViolation, match=r"^request 'mine-bad': structured output regex 'ab' \(automaton"):
        bad.result(timeout=120)


def test_a_prefill_failure_in_generate_names_the_prompt_and_row(infer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt whose prefill raises alone fails `generate` naming the caller's prompt and row only (the message
    carried "request 'generate-<hex>'" as well)."""
    from roll_engines.infer._batcher import PrefillError

    poison = 66
    forward = infer.model.forward

    def poisoned(*args: object, input_ids: torch.Tensor | None = None, **kwargs: object) -> object:
        if input_ids is not None and input_ids.shape[1] > 1 and bool((input_ids == poison).any()):
            raise RuntimeError("an injected failure")
        return forward(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(infer.model, "forward", poisoned)
    with pytest.raises(PrefillError) as err:
        infer.generate([[5, 6, 7], [10, poison, 11]], SamplingParams(max_new_tokens=3, seed=1), n=2)
    assert str(err.value) == "hf engine: prompt 1 (row 2): its prefill failed (RuntimeError: an injected failure)"


# ---- sampling params vLLM refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"stop": ("</s>", "")}, r"stop=\['</s>', ''\] holds an empty string"),
        ({"stop_token_ids": (3, -1)}, r"stop_token_ids \[-1\] are not token ids of the model's vocabulary \[0, "),
        ({"stop_token_ids": (10**6,)}, r"stop_token_ids \[1000000\] are not token ids"),
        ({"stop_token_ids": (2.0,)}, r"stop_token_ids \[2.0\] are not token ids"),
    ],
    ids=["empty-stop-string", "negative-id", "id-past-vocab", "float-id"],
)
def test_sampling_params_vllm_refuses_are_refused(infer: Any, changes: dict[str, Any], match: str) -> None:
    """vLLM refuses these (SamplingParams._verify_args: "stop cannot contain an empty string", "stop_token_ids must
    contain only integers"; _validate_stop_token_ids: ids outside [0, vocab)); the hf engine dropped the empty
    string and never matched the ids (a float 2.0 even stopped at token 2), so a run went on with hf and failed with
    vLLM. Refused by check_sampling, by generate and by submit, before anything is queued."""
    params = SamplingParams(max_new_tokens=4, seed=1).replace(**changes)
    with pytest.raises(ValueError, match=match):
        infer.check_sampling(params)
    with pytest.raises(ValueError, match=match):
        infer.generate([[5, 6, 7]], params)
    with pytest.raises(ValueError, match=match):
        infer.submit(Request("refused", [5, 6, 7], params))
    assert not infer.batcher.waiting and not infer.batcher.running


def test_stop_token_ids_in_the_vocabulary_still_stop_as_in_vllm(infer: Any) -> None:
    """The refusal keeps valid ids working: a stop token id ends the response at that token (kept, as vLLM keeps
    it in token_ids), with ignore_eos too (vLLM checks stop_token_ids whatever ignore_eos says)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    ref = infer.generate([[5, 6, 7]], greedy).responses[0].tolist()
    stop_at = ref[2]
    first = ref.index(stop_at)
    out = infer.generate([[5, 6, 7]], greedy.replace(stop_token_ids=(stop_at, infer._vocab - 1)))
    assert out.finish_reasons == ["stop"] and out.responses[0, : first + 1].tolist() == ref[: first + 1]
    assert int(out.response_mask[0].sum()) == first + 1


# ---- train engines: the temperature floor ----------------------------------------------------------------------


def _train_batch(infer: Any) -> dict[str, torch.Tensor]:
    prompts = [[5, 6, 7], [8, 9]]
    gen = infer.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=2))
    p_ids, p_mask = pad_left(prompts, infer.pad_id)
    batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(responses=gen.responses, response_mask=gen.response_mask)
    return batch


@pytest.mark.parametrize("temperature", [0.0, 1e-6, -1.0, math.nan, math.inf])
def test_the_hf_train_engine_refuses_a_temperature_below_the_greedy_floor(
    tiny: str, infer: Any, temperature: float
) -> None:
    """compute_logprobs divided the logits by the temperature: 0 returned NaN/inf log-probs (and 1e-6 overflowed
    them). The trainer's config refuses such a temperature; the engine API refuses it too, naming the floor.
    GREEDY_TEMPERATURE itself scores (finite log-probs). train_step and compute_gradients share the check (the
    fsdp2 engine inherits all three)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.hf import HFTrainEngine

    batch = _train_batch(infer)
    engine = HFTrainEngine(tiny, role="actor", lr=0.0)
    floor = rf"temperature={temperature!r} must be finite and at least GREEDY_TEMPERATURE=1e-05"
    with pytest.raises(ValueError, match=floor):
        engine.compute_logprobs(batch, temperature=temperature)
    with pytest.raises(ValueError, match=floor):
        engine.train_step(batch, PolicyObjective(), temperature=temperature)
    with pytest.raises(ValueError, match=floor):
        engine.compute_gradients(batch, PolicyObjective(), temperature=temperature)
    logp = engine.compute_logprobs(batch, temperature=GREEDY_TEMPERATURE)["logprobs"]
    assert bool(torch.isfinite(logp).all())


def test_the_megatron_train_engine_refuses_a_temperature_below_the_greedy_floor() -> None:
    """Megatron's compute_logprobs (and train_step, compute_gradients) divide by the temperature the same way
    (_vocab.response_logprobs): refused first thing, before any collective or pipeline schedule starts (a rank
    raising inside one would leave the others waiting)."""
    pytest.importorskip("megatron.core")
    from roll_engines.train.megatron.engine import MegatronTrainEngine

    class Bare:  # nothing the check reaches: it must come before any use of the engine
        critic, lora, trainable, optimizer, role = False, False, True, object(), "actor"

    with pytest.raises(ValueError, match="at least GREEDY_TEMPERATURE=1e-05"):
        MegatronTrainEngine.compute_logprobs(Bare(), {}, 0.0)
    with pytest.raises(ValueError, match="at least GREEDY_TEMPERATURE=1e-05"):
        MegatronTrainEngine.train_step(Bare(), {}, None, temperature=0.0)
    with pytest.raises(ValueError, match="at least GREEDY_TEMPERATURE=1e-05"):
        MegatronTrainEngine.compute_gradients(Bare(), {}, None, temperature=1e-9)


# ---- JSON-schema checks ----------------------------------------------------------------------------------------


def test_outlines_reading_of_each_schema_node_is_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_schema read `_consumed(node)` up to four times per node (the node check, then the pattern, format and
    oneOf checks); once now, with the same result (the pattern grouped, the rest unchanged)."""
    pytest.importorskip("outlines_core")
    from roll_engines import _structured_schema as S

    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^a|b$"},
            "when": {"type": "string", "format": "date"},
            "pick": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
        },
        "required": ["code", "when", "pick"],
    }
    calls: list[int] = []
    consumed = S._consumed

    def counted(node: dict[str, Any]) -> Any:
        calls.append(id(node))
        return consumed(node)

    monkeypatch.setattr(S, "_consumed", counted)
    out = S.check_schema(schema)
    assert len(calls) == len(set(calls)) == 6  # the root, its 3 properties, the 2 oneOf branches: each once
    assert out["properties"]["code"]["pattern"] == "^(?:a|b)$"
    assert {k: v for k, v in out["properties"].items() if k != "code"} == {
        k: v for k, v in schema["properties"].items() if k != "code"
    }
