"""Structured outputs (JSON schema / regex constrained decoding) on the built-in tiny random model.

A random model is the best adversary: left alone it writes noise, so every sample matching its constraint shows the
mask works. The log-prob checks are the trainer's side: the sampler's reported log-probs are log_softmax of the
masked logits of a teacher-forced forward, and the hf train engine, given the batch's `structured` rows, recomputes
exactly those (and without them, different ones: the unconstrained policy).
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from roll_core.errors import MissingExtraError
from roll_core.interfaces.inference import (
    STRUCTURED_KEY,
    SamplingParams,
    StructuredOutput,
    UnsupportedSamplingError,
    check_structured,
    structured_from_rows,
    structured_rows,
)
from roll_core.models import resolve_model_path
from roll_core.sequences import build_sequences, pad_left

REGEX = StructuredOutput(regex=r"[a-c]{2,4}(x|yz)")
SCHEMA = StructuredOutput(
    json_schema={
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 2}, "k": {"enum": [1, 22, False]}},
        "required": ["s", "k"],
    }
)
T = 0.9


@pytest.fixture(scope="module")
def tiny() -> str:
    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="module")
def infer(tiny: str) -> Any:
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(tiny, max_new_tokens=48, num_threads=1)  # 2 shared CPU cores: threads only contend
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def samples(infer: Any) -> list[dict[str, Any]]:
    """Rows sampled at T: 2 prompts x 3 under the regex, under the schema and unconstrained (8 tokens)."""
    prompts = [infer.tokenizer("hello")["input_ids"], infer.tokenizer("{name}")["input_ids"]]
    rows = []
    for c, max_new in ((REGEX, 48), (SCHEMA, 48), (None, 8)):
        out = infer.generate(prompts, SamplingParams(temperature=T, max_new_tokens=max_new, seed=3, structured=c), 3)
        for i in range(len(out.finish_reasons)):
            n = int(out.response_mask[i].sum())
            rows.append(
                {
                    "prompt": list(prompts[i // 3]),
                    "tokens": out.responses[i, :n].tolist(),
                    "logprobs": out.logprobs[i, :n],
                    "finish": out.finish_reasons[i],
                    "constraint": c,
                }
            )
    return rows


def _batch(rows: list[dict[str, Any]], pad: int) -> dict[str, torch.Tensor]:
    r = max(len(x["tokens"]) for x in rows)
    resp = torch.full((len(rows), r), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), r), dtype=torch.long)
    logp = torch.zeros((len(rows), r))
    for i, x in enumerate(rows):
        n = len(x["tokens"])
        resp[i, :n], mask[i, :n], logp[i, :n] = torch.tensor(x["tokens"]), 1, x["logprobs"]
    p_ids, p_mask = pad_left([x["prompt"] for x in rows], pad)
    batch = build_sequences(p_ids, p_mask, resp, mask)
    batch.update(responses=resp, response_mask=mask, behaviour_logprobs=logp)
    batch[STRUCTURED_KEY] = structured_rows([x["constraint"] for x in rows])
    return batch


def test_structured_output_is_validated_and_round_trips() -> None:
    for bad, match in (
        ({}, "exactly one"),
        ({"regex": "a", "json_schema": {}}, "exactly one"),
        ({"regex": "(a"}, "not a valid regex"),
        ({"json_schema": "{nope"}, "not valid JSON"),
        ({"json_schema": [1]}, "JSON object"),
    ):
        with pytest.raises(ValueError, match=match):
            StructuredOutput(**bad)
    with pytest.raises(ValueError, match="unknown keys"):
        StructuredOutput.from_dict({"grammar": "x"})
    # A dict and its text are the same constraint; a SamplingParams accepts the plain form.
    assert StructuredOutput(json_schema=SCHEMA.schema_text) == SCHEMA
    assert SamplingParams(structured={"regex": "a+"}).structured == StructuredOutput(regex="a+")
    encoded = structured_rows([None, REGEX, SCHEMA], width=300)
    assert encoded.shape == (3, 300) and encoded.dtype == torch.uint8 and not encoded[0].any()
    assert structured_from_rows(encoded) == [None, REGEX, SCHEMA]


def test_every_sample_matches_its_constraint(samples: list[dict[str, Any]], infer: Any) -> None:
    tok = infer.tokenizer
    for row in samples:
        if row["constraint"] is None:
            continue
        assert row["finish"] == "stop" and row["tokens"][-1] == tok.eos_token_id, row
        text = tok.decode(row["tokens"][:-1])
        if row["constraint"] is REGEX:
            assert re.fullmatch(REGEX.regex, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA.schema_dict)
    # Unconstrained, the same model writes noise: the constraint is what made the samples match.
    free = [tok.decode(r["tokens"]) for r in samples if r["constraint"] is None]
    assert not any(re.fullmatch(REGEX.regex, t) for t in free)
    # Greedy decoding is constrained too.
    out = infer.generate([tok("x")["input_ids"]], SamplingParams(temperature=0, max_new_tokens=48, structured=REGEX))
    assert re.fullmatch(REGEX.regex, tok.decode(out.responses[0, :-1].tolist()))


def test_behaviour_logprobs_are_of_the_masked_distribution(samples: list[dict[str, Any]], infer: Any) -> None:
    """Teacher-forced forward, logits / T masked by walking outlines-core's index directly: log_softmax of that
    gives the reported log-prob of every sampled token; the unmasked log_softmax does not."""
    from roll_engines.structured import to_regex, vocabulary

    model, tok = infer.model, infer.tokenizer  # the sampler's weights, fp32, in eval mode
    gap = 0.0
    for row in samples:
        if row["constraint"] is None:
            continue
        prompt, tokens = row["prompt"], row["tokens"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1] / T
        index = vocabulary(tok).index(to_regex(row["constraint"]))
        state, masked = index.get_initial_state(), logits.clone()
        for t, token in enumerate(tokens):
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
            keep[list(index.get_allowed_tokens(state))] = True
            masked[t, ~keep] = float("-inf")
            if token != tok.eos_token_id:
                state = index.get_next_state(state, token)
        ids = torch.tensor(tokens)[:, None]
        want = torch.log_softmax(masked, -1).gather(-1, ids)[:, 0]
        torch.testing.assert_close(row["logprobs"], want, atol=1e-4, rtol=1e-4)
        gap = max(gap, float((torch.log_softmax(logits, -1).gather(-1, ids)[:, 0] - want).abs().max()))
    assert gap > 0.5, "masking must change the log-probs (else this test checks nothing)"


def test_train_engine_replays_the_constraint(samples: list[dict[str, Any]], tiny: str, infer: Any) -> None:
    from roll_engines.train.hf import HFTrainEngine

    # Chunks of 5 rows mix constrained and unconstrained rows.
    train = HFTrainEngine(tiny, role="reference", trainable=False, logprob_chunk_size=5, num_threads=1)
    batch = _batch(samples, infer.pad_id)
    mask = batch["response_mask"].bool()
    out = train.compute_logprobs(batch, temperature=T, with_entropy=True)
    torch.testing.assert_close(out["logprobs"][mask], batch["behaviour_logprobs"][mask], atol=2e-4, rtol=1e-4)
    assert torch.isfinite(out["entropy"]).all() and train.structured_rejected_rows == 0
    constrained = torch.tensor([s["constraint"] is not None for s in samples])
    # Constrained entropies are those of the masked distribution: far below the ~log(V) of a random model's.
    assert (
        out["entropy"][constrained][mask[constrained]].mean() < out["entropy"][~constrained][mask[~constrained]].mean()
    )
    plain = train.compute_logprobs({k: v for k, v in batch.items() if k != STRUCTURED_KEY}, temperature=T)
    diff = (plain["logprobs"] - batch["behaviour_logprobs"]).abs() * mask
    assert diff[constrained].max() > 0.5, "without the constraint the trainer scores another policy"
    assert diff[~constrained].max() < 2e-4
    # A token the constraint never allowed: masking stops there (counted), log-probs stay finite.
    bad = {k: v.clone() for k, v in batch.items()}
    bad["responses"][0, 1] = infer.tokenizer.convert_tokens_to_ids("Z")
    got = train.compute_logprobs(bad, temperature=T)["logprobs"]
    assert torch.isfinite(got).all() and train.structured_rejected_rows == 1
    torch.testing.assert_close(got[0, 0], batch["behaviour_logprobs"][0, 0], atol=2e-4, rtol=1e-4)


def test_engines_without_support_refuse(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.infer.sglang import SGLangInferEngine, to_sglang_sampling
    from roll_engines.infer.vllm import VLLMInferEngine
    from roll_engines.structured import refuse_constrained_batch, to_regex
    from roll_engines.train.hf import HFTrainEngine
    from roll_engines.train.megatron.engine import MegatronTrainEngine

    params = SamplingParams(structured=SCHEMA)

    class PluginEngine:  # an engine that predates structured outputs
        name = "myengine"

    with pytest.raises(UnsupportedSamplingError, match=r"infer_engine=myengine cannot constrain.*hf, vllm, sglang"):
        check_structured(PluginEngine(), params)
    check_structured(PluginEngine(), SamplingParams())
    for cls in (HFInferEngine, VLLMInferEngine, SGLangInferEngine):
        assert cls.structured_outputs
    assert HFTrainEngine.structured_logprobs and not MegatronTrainEngine.structured_logprobs
    with pytest.raises(ValueError, match="train_engine=megatron cannot compute log-probs under structured"):
        refuse_constrained_batch({STRUCTURED_KEY: structured_rows([None, REGEX])}, "megatron")
    refuse_constrained_batch({STRUCTURED_KEY: structured_rows([None, None])}, "megatron")
    # SGLang gets the same regex every engine constrains with (SGLang itself is GPU-only: not run here).
    sent = to_sglang_sampling(params, 16)
    assert sent["regex"] == to_regex(SCHEMA) and "json_schema" not in sent
    with pytest.raises(ValueError, match="cannot be compiled"):
        to_regex(StructuredOutput(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}))
    # Without outlines-core: one line naming the extra.
    monkeypatch.setitem(__import__("sys").modules, "outlines_core", None)
    with pytest.raises(MissingExtraError, match=r"roll-engines\[structured\]"):
        HFInferEngine.check_sampling(None, params)


def test_schema_keywords_outlines_core_drops_are_refused() -> None:
    """outlines-core's regex builder drops some restricting JSON-schema keywords without a word (and concatenates the
    branches of a several-schema allOf): sampling under such a schema lets invalid values through. Each is refused,
    naming the keyword and where it sits; a schema outlines-core enforces whole still compiles."""
    from outlines_core.json_schema import build_regex_from_schema

    from roll_engines.structured import to_regex

    # Why: outlines-core's regexes accept values these schemas forbid.
    assert re.fullmatch(build_regex_from_schema('{"type": "integer", "minimum": 0}'), "-3")
    both = '{"allOf": [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 2}]}'
    assert re.fullmatch(build_regex_from_schema(both), '"ab""cd"')  # not even JSON
    score = {"type": "number", "minimum": 0, "maximum": 1}
    for schema, match in (
        ({"type": "integer", "minimum": 0}, r"'minimum' at \$"),
        ({"type": "object", "properties": {"score": score}}, r"'maximum', 'minimum' at \$\.properties\.score"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "string", "not": {"const": "a"}}, "'not'"),
        ({"$defs": {"A": {"type": "integer", "multipleOf": 2}}, "$ref": "#/$defs/A"}, r"\$\.\$defs\.A"),
        ({"anyOf": [{"type": "null"}, {"type": "integer", "exclusiveMaximum": 3}]}, r"\$\.anyOf\[1\]"),
        (json.loads(both), r"allOf of 2 schemas at \$"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, r"required \['b'\]"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "'minProperties'"),
    ):
        with pytest.raises(ValueError, match=match):
            to_regex(StructuredOutput(json_schema=schema))
    # Keywords outlines-core enforces, annotations, a one-schema allOf and a redundant additionalProperties pass.
    fine = {
        "title": "T",
        "description": "d",
        "type": "object",
        "properties": {
            "minimum": {"type": "integer", "default": 1, "examples": [1]},  # a property named like a keyword
            "s": {"allOf": [{"type": "string", "minLength": 1, "maxLength": 4}]},
        },
        "required": ["minimum"],
        "additionalProperties": False,
    }
    assert re.fullmatch(to_regex(StructuredOutput(json_schema=fine)), '{"minimum":7,"s":"ab"}')
    assert to_regex(SCHEMA) and to_regex(StructuredOutput(json_schema={"type": "object", "minProperties": 1}))


@pytest.mark.parametrize(
    "schema, forbidden, match",
    [
        # outlines-core reads one keyword per schema (properties, allOf, anyOf, oneOf, prefixItems, enum, const, $ref,
        # type; for a string minLength/maxLength, else pattern, else format) and drops the others beside it.
        ({"type": "object", "required": ["a"]}, "{}", r"'required' beside 'type' at \$"),
        ({"type": "integer", "enum": [1, "x"]}, '"x"', r"'type' 'integer' beside 'enum' at \$.*x is sampled"),
        ({"type": "string", "const": 1}, "1", r"'type' 'string' beside 'const'"),
        ({"enum": ["a", "bcd"], "maxLength": 2}, '"bcd"', r"'maxLength' beside 'enum'"),
        ({"type": "string", "pattern": "[a-z]+", "maxLength": 5}, '"12"', r"'pattern' beside 'type'"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "{}", "'anyOf'"),
        ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "type": "string"}, "1", r"'type' beside '\$ref'"),
        ({"type": "string", "properties": {}}, "{}", r"'type' 'string' beside 'properties'.*an object is sampled"),
        ({"prefixItems": [{"type": "integer"}], "minItems": 3}, "[1]", r"'minItems'/'maxItems' beside 'prefixItems'"),
        # Text written between a JSON string's quotes unescaped: not JSON.
        ({"type": "string", "pattern": "[^a]+"}, '"x"y"', r"pattern '\[\^a\]\+' at \$\.pattern.*can match"),
        ({"type": "string", "format": "email"}, '""x"@a.bc"', r"format 'email' at \$\.format"),
        ({"type": "string", "format": "time"}, '"00:00:00\\q1"', r"format 'time'"),
        (
            {"type": "object", "properties": {'c"d': {"type": "integer"}}, "required": ['c"d']},
            '{"c"d":1}',
            r"property names \['c\"d'\]",
        ),
        # oneOf sampled as anyOf: a value valid under two branches is invalid.
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", r"oneOf branches 0 and 1 at \$"),
        (
            {"oneOf": [{"properties": {"b": {}}, "required": ["b"]}, {"properties": {"a": {}}}]},
            None,  # outlines-core samples {"b":1} for branch 0, which branch 1 accepts (extra properties allowed)
            "oneOf branches 0 and 1",
        ),
    ],
)
def test_schemas_outlines_core_misreads_are_refused(schema: dict[str, Any], forbidden: str | None, match: str) -> None:
    """outlines-core's regex of each schema accepts a text the schema forbids (or that is not JSON at all) without a
    word; to_regex refused none of them, so sampling produced outputs the user's parser or validator rejects. Each is
    now refused, naming the keyword and where it stands."""
    from outlines_core.json_schema import build_regex_from_schema

    from roll_engines.structured import to_regex

    if forbidden is not None:  # why: outlines-core's own regex lets a forbidden text through
        assert re.fullmatch(build_regex_from_schema(json.dumps(schema)), forbidden), forbidden
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(forbidden), schema)
    with pytest.raises(ValueError, match=f"StructuredOutput.json_schema: .*{match}") as refused:
        to_regex(StructuredOutput(json_schema=schema))
    assert "would not be enforced" in str(refused.value)


def test_schemas_outlines_core_enforces_compile_exactly() -> None:
    """What outlines-core enforces whole still compiles: a keyword that does not apply to the sampled type, oneOf
    branches of distinct types or with a const discriminator (pydantic's discriminated union), a pattern that keeps
    to JSON string text. An unanchored alternation in a pattern ('a|b', which outlines-core bound to the quotes:
    '"a' or 'b"') is grouped, so the pattern's language is sampled."""
    from outlines_core.json_schema import build_regex_from_schema

    from roll_engines.structured import to_regex

    union = {
        "$defs": {
            "A": {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k"]},
            "B": {"type": "object", "properties": {"k": {"const": "b", "type": "string"}}, "required": ["k"]},
        },
        "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
        "discriminator": {"propertyName": "k"},
    }
    for schema, text in (
        ({"enum": [1, 2], "maxLength": 1, "title": "t"}, "2"),
        ({"type": "integer", "pattern": "x"}, "12"),
        ({"oneOf": [{"type": "string"}, {"type": "null"}]}, "null"),
        ({"oneOf": [{"type": "integer"}, {"const": 1.5}]}, "1.5"),
        (union, '{"k":"b"}'),
        ({"type": "string", "pattern": '^[^"\\\\\\x00-\\x1f]+$'}, '"x y"'),
        ({"type": ["object", "null"], "properties": {"a": {"type": "integer"}}}, '{"a":1}'),
    ):
        regex = to_regex(StructuredOutput(json_schema=schema))
        assert re.fullmatch(regex, text), (schema, text)
        jsonschema.validate(json.loads(text), schema)
    alternation = {"type": "string", "pattern": "a|b"}
    assert re.fullmatch(build_regex_from_schema(json.dumps(alternation)), 'b"')  # why: not JSON
    regex = to_regex(StructuredOutput(json_schema=alternation))
    assert [t for t in ('"a"', '"b"', '"a', 'b"') if re.fullmatch(regex, t)] == ['"a"', '"b"']


def _byte_index(regex: str) -> Any:
    """outlines-core's Index of `regex` over the 256 single bytes (what vLLM's / SGLang's outlines backend compile)."""
    import outlines_core

    return outlines_core.Index(regex, outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)}))


def _walk(regex: str, text: str) -> str:
    idx = _byte_index(regex)
    state = idx.get_initial_state()
    for b in text.encode():
        if (state := idx.get_next_state(state, b)) is None:
            return "rejected"
    return "matched" if idx.is_final_state(state) else "partial"


def test_every_engines_check_sampling_compiles_the_constraint(infer: Any) -> None:
    """The hf engine's check_sampling only checked that outlines-core was installed: a schema or regex outlines-core
    cannot compile passed it (the OpenAI server's early check, a run's wiring) and failed only when submitted.
    Every engine's check now compiles the constraint as vLLM and SGLang would."""
    from roll_engines.infer.sglang import SGLangInferEngine
    from roll_engines.infer.vllm import VLLMInferEngine

    dangling = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})
    checks = (infer.check_sampling, lambda p: VLLMInferEngine.check_sampling(None, p))
    checks += (lambda p: SGLangInferEngine.check_sampling(None, p),)
    for bad, match in (
        (dangling, "json_schema cannot be compiled"),
        (StructuredOutput(regex="a{,3}"), r"regex 'a\{,3\}' cannot be compiled by outlines-core.*\{0,n\} not \{,n\}"),
        (StructuredOutput(regex="^ab$"), r"regex '\^ab\$': the anchor '\^'"),
    ):
        for check in checks:
            with pytest.raises(ValueError, match=match):
                check(SamplingParams(structured=bad))
    for check in checks:
        check(SamplingParams(structured=REGEX))
        check(SamplingParams(structured=SCHEMA))


@pytest.mark.parametrize(
    "regex, construct, outlines",
    [
        ("^ab$", r"anchor '\^'", "fails"),
        (r"\Aab", r"anchor '\\A'", "fails"),
        ("ab$", r"anchor '\$'", "fails on 'ab$c'"),
        ("(?m)(x|^y)", r"anchor '\^'", "fails"),
        (r"a(?=b)b", r"lookaround '\(\?=\.\.\.\)'", "fails"),
        (r"(?<!c)b", r"lookaround '\(\?<!\.\.\.\)'", "fails"),
        (r"\bab\b", r"word boundary '\\b'", "fails"),
        (r"a\Bb", r"word boundary '\\B'", "fails"),
        (r"(a)b\1", "backreference", "fails"),
        (r"(?P<x>a)(?P=x)", "backreference", "fails"),
        (r"(a)?(?(1)b|c)", "conditional group", "fails"),
        (r"(?>a)b", "atomic group", "fails"),
        ("a*+a", "possessive quantifier", "matches 'aa', which Python's possessive a*+ never lets through"),
        ("[[:alpha:]]", r"'\[' or a set operation .* inside a char", "rejects ':]', Python's '[[:alph]' ']'"),
    ],
)
def test_regex_constructs_outside_outlines_cores_dialect_are_refused_naming_them(
    regex: str, construct: str, outlines: str
) -> None:
    """Python's `re` accepts these (StructuredOutput compiles them), outlines-core (vLLM's and SGLang's outlines
    backend, the hf sampler, the trainer's replay) fails on them when a request is compiled, or reads another
    language: each is refused at the check, naming the construct."""
    import warnings

    from roll_engines.structured import to_regex

    # Python warns that it may read '[[' as a nested set some day (this suite turns warnings into errors).
    warnings.filterwarnings("ignore", "Possible nested set", FutureWarning)
    # Why: Python takes it; outlines-core fails on it or constrains a different language.
    re.compile(regex)
    if outlines == "fails":
        with pytest.raises(ValueError):
            _byte_index(regex)
    elif regex == "ab$":
        assert _walk(regex, "ab") == "matched"
        with pytest.raises(ValueError):
            _byte_index("ab$c")  # Python: a valid regex that matches nothing
    elif regex == "a*+a":
        assert _walk(regex, "aa") == "matched" and re.fullmatch(regex, "aa") is None
    else:
        assert _walk(regex, ":]") == "rejected" and re.fullmatch(regex, ":]") is not None
    named = f"StructuredOutput.regex .*: (a |an |the )?{construct}.* not supported by outlines-core"
    with pytest.raises(ValueError, match=named):
        to_regex(StructuredOutput(regex=regex))


def test_regexes_outlines_core_builds_pass_the_check() -> None:
    """What looks like an anchor or a word boundary but is a literal or a class member, and outlines-core's other
    syntax, still compiles (and to the language Python reads)."""
    from roll_engines.structured import to_regex

    for regex, text in (("[$^]+", "^$"), (r"a\$", "a$"), (r"\d{2,}", "42"), ("(?i)ab", "aB"), ("(x|y)+", "xyx")):
        assert to_regex(StructuredOutput(regex=regex)) == regex
        assert re.fullmatch(regex, text) and _walk(regex, text) == "matched", regex


def test_ignore_eos_constraint_ends_at_its_eos_as_vllms(infer: Any) -> None:
    """ignore_eos: once the constraint's EOS ends a complete match, vLLM's outlines backend stops masking (the
    grammar is terminated: a full bitmask from then on). The hf sampler and the trainer's replay stop there too, so
    every engine samples the same policy and the replayed masks agree with any of them."""
    from roll_engines.structured import replay_mask

    tok = infer.tokenizer
    a, b, eos = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), tok.eos_token_id
    c = StructuredOutput(regex="ab")
    params = SamplingParams(temperature=T, max_new_tokens=12, seed=3, ignore_eos=True, structured=c)
    out = infer.generate([tok("hello")["input_ids"]], params, 2)
    v = infer.model.get_output_embeddings().weight.shape[0]
    for i, reason in enumerate(out.finish_reasons):
        tokens = out.responses[i].tolist()
        assert reason == "length" and len(tokens) == 12 and tokens[:3] == [a, b, eos], tokens
        # Unconstrained after the EOS: a random model's noise, not the final state's EOS-only mask.
        assert any(t != eos for t in tokens[3:]), tokens
        masks, k = replay_mask(c, tok, tokens, v)
        assert k == 12 and masks[:3].any(-1).all() and not masks[3:].any()


def test_constrain_logits_masks_each_constrained_row_as_its_replay(infer: Any) -> None:
    """The trainer's masking: each constrained row's first k positions get its replayed mask, every other entry
    (unconstrained rows, padding, positions after a token the constraint never allowed) is untouched, the input is
    not modified and gradients reach the kept entries only. Masked row by row (a (b, R, V) bool mask, as big as the
    logits in elements, was built on the host and copied to the device)."""
    from roll_engines.structured import constrain_logits, replay_mask

    tok = infer.tokenizer
    v = infer.model.get_output_embeddings().weight.shape[0]
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    c = StructuredOutput(regex="ab")
    responses = torch.tensor([[a, b, tok.eos_token_id, 0], [a, a, b, 0], [b, b, b, b]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    logits = torch.randn(3, 4, v, requires_grad=True)
    before = logits.detach().clone()
    out, rejected = constrain_logits(logits, structured_rows([c, c, None]), responses, mask, tok)
    assert rejected == 1 and torch.equal(logits.detach(), before)
    floor = torch.finfo(logits.dtype).min
    for i, n in ((0, 3), (1, 4)):
        rows, k = replay_mask(c, tok, responses[i, :n].tolist(), v)
        assert k == (3 if i == 0 else 1)
        assert torch.equal(out[i, :k].detach(), before[i, :k].masked_fill(rows, floor))
        assert torch.equal(out[i, k:].detach(), before[i, k:])
    assert torch.equal(out[2].detach(), before[2])
    out.sum().backward()
    rows0, _ = replay_mask(c, tok, responses[0, :3].tolist(), v)
    assert torch.equal(logits.grad[0, :3] == 0, rows0) and bool((logits.grad[1:] != 0).any())


class _NarrowLogits:
    """The engine's model with its logits cut to the first `width` ids: a tokenizer with tokens past the model's
    vocabulary (added tokens the model has no logits for), as the sampler sees it."""

    def __init__(self, model: Any, width: int) -> None:
        self.model, self.width, self.config = model, width, model.config

    def __call__(self, **kwargs: Any) -> Any:
        out = self.model(**kwargs)
        out.logits = out.logits[..., : self.width]
        return out


def test_a_state_allowing_no_id_within_the_logits_fails_its_request(
    infer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A constraint whose next tokens all lie past the model's logits width fails its request naming the constraint
    (it masked every entry, and the sampler drew uniformly over all tokens: a response outside the constraint,
    reported as a normal one). The tokens it could not allow are warned about; other requests go on."""
    from roll_core.interfaces.inference import Request
    from roll_engines.structured import ConstraintViolation

    tok = infer.tokenizer
    a = tok.convert_tokens_to_ids("a")
    c = StructuredOutput(regex="ab")
    prompt = tok("hello")["input_ids"]
    monkeypatch.setattr(infer.batcher, "model", _NarrowLogits(infer.batcher.model, a))  # 'a' (the only start) cut
    with caplog.at_level("WARNING", logger="roll_engines.structured"):
        with pytest.raises(RuntimeError, match=r"regex 'ab'.*none below the model's logits width") as err:
            infer.generate([prompt], SamplingParams(temperature=T, max_new_tokens=8, seed=3, structured=c))
    assert isinstance(err.value, ConstraintViolation)
    assert any("logits have only" in r.getMessage() for r in caplog.records)
    # Beside it an unconstrained request samples as usual (within the narrowed width), and the failed row left.
    bad = infer.submit(Request("narrow-bad", prompt, SamplingParams(max_new_tokens=4, seed=1, structured=c)))
    good = infer.submit(Request("narrow-good", prompt, SamplingParams(max_new_tokens=4, seed=1, ignore_eos=True)))
    with pytest.raises(ConstraintViolation, match="narrow-bad"):
        bad.result(timeout=120)
    out = good.result(timeout=120)
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and max(out.token_ids) < a
    assert not infer.batcher.running


def test_a_sampled_token_the_constraint_refuses_fails_its_request(infer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Matcher.advance` False in the sampler (the mask let through a token the constraint refuses) fails the
    request naming the constraint and the token; it was ignored, and the response went on outside the constraint.
    The engine serves constrained requests afterwards as before."""
    from roll_engines.structured import ConstraintViolation, Matcher

    tok = infer.tokenizer
    b = tok.convert_tokens_to_ids("b")
    c = StructuredOutput(regex="ab")
    prompt = tok("hello")["input_ids"]
    params = SamplingParams(temperature=T, max_new_tokens=6, seed=3, structured=c)

    def only_b(self: Any, width: int) -> torch.Tensor:  # a broken mask: 'b' where the constraint needs 'a'
        keep = torch.zeros(width, dtype=torch.bool)
        keep[b] = True
        return keep

    with monkeypatch.context() as m:
        m.setattr(Matcher, "keep", only_b)
        with pytest.raises(ConstraintViolation, match=rf"regex 'ab'.*sampled token {b} .*does not allow"):
            infer.generate([prompt], params)
    assert not infer.batcher.running
    out = infer.generate([prompt], params)
    a, eos = tok.convert_tokens_to_ids("a"), tok.eos_token_id
    assert out.finish_reasons == ["stop"] and out.responses[0, :3].tolist() == [a, b, eos]
