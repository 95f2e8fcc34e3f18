"""A row the engine aborted inside a stop string, resumed by the RLVR collectors (`resume_aborted`: pipeline=rlvr's
training rows and evaluation, pipeline=rollout, roll-eval), ends where the same row never aborted ends.

Every engine matches stop strings on its own request's output, so a string the aborted attempt began and the resumed
attempt completed was matched by none: the row ran on to its budget ("length", truncated, the overlong penalty) and the
reward read text past the stop string. The engine here is the real hf engine on the built-in tiny model, greedy: the
unaborted row is the reference, token for token."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from roll_core.interfaces import Request, SamplingParams
from roll_core.pipelines.collectors._resume import _Resuming, resume_aborted
from roll_core.protocol import Batch

BUDGET = 16


class Engine:
    """The group API `resume_aborted` calls (`generate` over a prompts batch, `submit_request`) over one hf engine;
    `generate` aborts row 0 after `abort_after` tokens (what an engine under memory pressure returns)."""

    def __init__(self, engine: Any, abort_after: int) -> None:
        self.engine, self.abort_after = engine, abort_after

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        cut = params.replace(max_new_tokens=self.abort_after)
        out = self.engine.generate(prompts["prompt_ids"], cut, n)
        gen = Batch(
            {"responses": out.responses, "behaviour_logprobs": out.logprobs, "response_mask": out.response_mask},
            {"finish_reason": ["abort"] * len(out.finish_reasons)},
        )
        gen.meta["generate_seconds"] = 0.0
        return gen

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        return self.engine.submit(request)


@pytest.fixture(scope="module")
def setup() -> Any:
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_engines.infer.hf import HFInferEngine

    path = resolve_model_path("builtin:tiny")
    engine = HFInferEngine(path, max_new_tokens=BUDGET, seed=0)
    yield engine, AutoTokenizer.from_pretrained(path)
    engine.shutdown()


def _stop_and_reference(engine: Any, tok: Any, prompt: list[int]) -> tuple[str, list[int], int]:
    """A stop string spelt by greedy tokens 4..6 (begun at token 4), and the unaborted row that stops on it."""
    free = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=BUDGET, ignore_eos=True))
    ref = free.responses[0].tolist()
    stop = tok.decode(ref[4:7])
    assert stop.strip() and stop not in tok.decode(ref[:6]), (stop, tok.decode(ref))
    params = SamplingParams(temperature=0, max_new_tokens=BUDGET, ignore_eos=True, stop=(stop,))
    unaborted = engine.generate([prompt], params)
    got = unaborted.responses[0][unaborted.response_mask[0].bool()].tolist()
    assert unaborted.finish_reasons == ["stop"] and len(got) < BUDGET, (stop, got)
    return stop, got, len(got)


def test_a_row_aborted_inside_a_stop_string_ends_where_the_unaborted_row_ends(setup: Any) -> None:
    engine, tok = setup
    prompt = list(tok("What is 1+2?")["input_ids"])
    stop, want, k = _stop_and_reference(engine, tok, prompt)
    params = SamplingParams(temperature=0, max_new_tokens=BUDGET, ignore_eos=True, stop=(stop,))
    prompts = Batch(fields={"prompt_ids": [prompt]})
    for abort_after in range(5, k):  # every abort point inside the stop string
        infer = Engine(engine, abort_after)
        gen = infer.generate(prompts, params, 1)
        out, refused, resumed = resume_aborted(infer, prompts, gen, params, 1, 0, tokenizer=tok)
        got = out["responses"][0][out["response_mask"][0].bool()].tolist()
        assert (refused, resumed) == ([], 1)
        # was: the whole budget, finish "length", truncated 1, the reward reading text past the stop string
        assert got == want, (abort_after, tok.decode(got), tok.decode(want))
        assert out["finish_reason"] == ["stop"] and out["truncated"].tolist() == [0]
        assert int(out["response_mask"].sum()) == k and torch.all(out["behaviour_logprobs"][0, :k] < 0)
        # evaluation's group (the prompts collector's, roll-eval's) ends the row there too
        ev = _Resuming(infer, 0, frozenset(), tokenizer=tok).generate(prompts, params, n=1)
        assert ev["responses"][0][ev["response_mask"][0].bool()].tolist() == want
        assert ev["finish_reason"] == ["stop"]


def test_stop_strings_without_a_tokenizer_are_refused_when_a_row_is_resumed(setup: Any) -> None:
    engine, tok = setup
    prompts = Batch(fields={"prompt_ids": [list(tok("Hi")["input_ids"])]})
    params = SamplingParams(temperature=0, max_new_tokens=BUDGET, ignore_eos=True, stop=("zzz",))
    infer = Engine(engine, 3)
    with pytest.raises(ValueError, match="tokenizer"):
        resume_aborted(infer, prompts, infer.generate(prompts, params, 1), params, 1, 0)


def test_the_async_collectors_sample_resumed_inside_a_stop_string_ends_there_too(setup: Any) -> None:
    """pipeline=rlvr with async_ratio > 0: the driver resumes a sample the engine aborted (or whose request was
    lost) as a new request over prompt + prefix; its batch (`generation_from_samples`) ends it where it stopped."""
    import types

    from roll_core.pipelines.sampling import generation_from_samples
    from roll_core.scheduling.scheduler import GroupState, SampleState, Segment

    engine, tok = setup
    prompt = list(tok("What is 1+2?")["input_ids"])
    stop, want, k = _stop_and_reference(engine, tok, prompt)
    params = SamplingParams(temperature=0, max_new_tokens=BUDGET, ignore_eos=True, stop=(stop,))
    first = engine.generate([prompt], params.replace(max_new_tokens=5))
    head = first.responses[0][first.response_mask[0].bool()].tolist()
    rest = engine.submit(Request("resume", prompt + head, params.replace(max_new_tokens=BUDGET - 5))).result(60)
    group = GroupState(0, types.SimpleNamespace(answer="3", id="p0", prompt="q"), prompt, 0)
    segments = [Segment(head, first.logprobs[0, :5].tolist(), 0), Segment(rest.token_ids, rest.logprobs, 1)]
    group.samples = [SampleState(group, 0, segments, finish=rest.finish_reason)]
    gen = generation_from_samples([group], 0, None, tok, params.stop)
    assert gen["responses"][0][gen["response_mask"][0].bool()].tolist() == want  # was the whole budget
    assert gen["finish_reason"] == ["stop"] and gen["truncated"].tolist() == [0]
    # the kept tokens were sampled under versions 0 (5 tokens) and 1 (the rest up to the stop string's end)
    assert gen["behaviour_version"].tolist() == [0]
    # without stop strings nothing is cut (a stop string of no engine's request is no end)
    whole = generation_from_samples([group], 0, None)
    assert int(whole["response_mask"].sum()) == len(head) + len(rest.token_ids) > k
