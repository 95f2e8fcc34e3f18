"""roll_core.evaluate's sample records against a scripted engine and reward: rows the engine aborted on its own are
resumed (as a training run's evaluation resumes them), rows the engine keeps refusing and rows the reward could not
score are marked failed (counted in the metrics' `failed`), problems whose prompt fills the engine's context are
counted as skipped; and the sampling checks refuse greedy decoding with n > 1 however it is asked for."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.eval_metrics import summarize
from roll_core.evaluate import answer_equivalence, check_sampling, sample_rows
from roll_core.idle_aborts import MAX_IDLE_ABORTS
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.protocol import Batch
from roll_core.testing.echo import EchoProblem, EchoTask

ANSWER = 5  # tokens of a complete answer; the reward below grades a complete answer right, a cut one wrong
A, B = 40, 41  # the token ids the engine answers with ("E" and "F" in the tiny tokenizer)


class _Engine:
    """Batch `generate`: n rows per prompt of ANSWER tokens A ('stop'), except rows in `partial` (aborted after that
    many tokens) and the rows of prompts in `too_long` ('prompt_too_long', no token). Request API: a resumed row gets
    the rest of its answer as tokens B ('stop'); the rows of prompts in `refuse` are aborted without a token."""

    def __init__(self, prompts: list[str], partial: dict[int, int], refuse: set[int], too_long: set[int]) -> None:
        self.prompts, self.partial, self.refuse, self.too_long = prompts, partial, refuse, too_long
        self.ids: list[list[int]] = []
        self.requests: list[Request] = []

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        self.ids = [list(p) for p in prompts["prompt_ids"]]
        rows = len(prompts) * n
        resp = torch.zeros((rows, ANSWER), dtype=torch.long)
        logp, mask = torch.zeros((rows, ANSWER)), torch.zeros((rows, ANSWER), dtype=torch.long)
        finish = []
        for i in range(rows):
            if i // n in self.too_long:
                finish.append("prompt_too_long")
                continue
            k = self.partial.get(i, ANSWER)
            resp[i, :k], mask[i, :k] = A, 1
            finish.append("abort" if i in self.partial else "stop")
        out = Batch(
            {"responses": resp, "behaviour_logprobs": logp, "response_mask": mask, "truncated": torch.zeros(rows)},
            {"finish_reason": finish},
        )
        out.meta["generate_seconds"] = 1.0
        return out

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        p = next(j for j, ids in enumerate(self.ids) if request.prompt_ids[: len(ids)] == ids)
        done = len(request.prompt_ids) - len(self.ids[p])
        ids, finish = ([], "abort") if p in self.refuse else ([B] * (ANSWER - done), "stop")
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.1] * len(ids), finish))
        return fut


class _Scoring:
    """Right when the response is complete; rows in `unscored` are the reward's failures (scored 0, flagged)."""

    def __init__(self, tokenizer: Any, unscored: set[int]) -> None:
        self.tokenizer, self.unscored = tokenizer, unscored

    def score(self, batch: Batch) -> Batch:
        mask = batch["response_mask"].bool()
        texts = [self.tokenizer.decode(batch["responses"][i][mask[i]].tolist()) for i in range(len(batch))]
        failed = torch.tensor([i in self.unscored for i in range(len(batch))])
        right = (mask.sum(-1) >= ANSWER).float() * (~failed).float()
        out = Batch(
            {"scores": right, "correct": right, "formatted": torch.ones_like(right), "reward_failed": failed},
            {"response_text": texts},
        )
        out.meta["reward_counters"] = {"rows": len(batch), "failed_rows": len(self.unscored)}
        return out


def _collector(
    engine: _Engine, problems: list[EchoProblem], unscored: set[int], max_idle_aborts: int = MAX_IDLE_ABORTS
) -> SimpleNamespace:
    tokenizer = build_tiny_tokenizer()
    model = SimpleNamespace(max_prompt_length=256, chat_template_kwargs={})
    return SimpleNamespace(
        cfg=SimpleNamespace(model=model, pipeline=SimpleNamespace(seed=0, max_idle_aborts=max_idle_aborts)),
        tokenizer=tokenizer,
        processor=None,
        eval_set=problems,
        infer=engine,
        sampling=SamplingParams(max_new_tokens=16, temperature=1.0),
        eval_temperature=1.0,
        scoring=_Scoring(tokenizer, unscored),
    )


@pytest.fixture(autouse=True)
def no_idle_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core import idle_aborts

    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.0)


def test_aborted_rows_are_resumed_refused_and_unscored_rows_are_failed_not_wrong_answers() -> None:
    """Problem 0: its second row aborted after 2 tokens (a preemption) and is resumed to a complete, right answer
    (roll-eval scored the cut answer: wrong, and not what eval/accuracy of the training run counts). Problem 1: one
    row the engine keeps refusing, one the reward could not score: both `failed`, neither a wrong answer of the
    model in samples.jsonl. Problem 2 fills the engine's context: a skipped problem (it went uncounted)."""
    problems = [EchoProblem(f"p{i}", f"question {i}") for i in range(3)]
    engine = _Engine([p.prompt for p in problems], partial={1: 2, 2: 0}, refuse={1}, too_long={2})
    collector = _collector(engine, problems, unscored={3})
    rows, skipped, _ = sample_rows(collector, EchoTask(), 2)

    assert skipped == {"prompt_length": 0, "engine_context": 1, "bad_pictures": 0}
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["finish_reason"] for r in rows] == ["stop", "stop", "abort", "stop"]
    assert [r["length"] for r in rows] == [ANSWER, ANSWER, 0, ANSWER]
    assert [r["correct"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    assert rows[1]["response"] == "EEFFF"  # its 2 tokens, then the resumed rest
    assert [r["failed"] for r in rows] == [None, None, "engine", "reward"]
    assert rows[2]["extracted"] is None and rows[3]["extracted"] == "EEEEE"  # a refused row does not vote
    m = summarize(rows, [1, 2])
    assert m["failed"] == 2 and m["accuracy"] == pytest.approx(0.5) and m["pass@2"] == pytest.approx(0.5)


@pytest.mark.parametrize("n", [3, 11])
def test_a_row_is_refused_at_the_configured_max_idle_aborts(n: int) -> None:
    """roll-eval refused a row at the module's 8 idle aborts whatever `pipeline.max_idle_aborts` said: now at the
    N-th in a row (the batch's own abort the first, so N - 1 requests)."""
    problems = [EchoProblem(f"p{i}", f"question {i}") for i in range(2)]
    engine = _Engine([p.prompt for p in problems], partial={2: 0}, refuse={1}, too_long=set())
    rows, _, _ = sample_rows(_collector(engine, problems, unscored=set(), max_idle_aborts=n), EchoTask(), 2)
    assert [r["failed"] for r in rows] == [None, None, "engine", None] and len(engine.requests) == n - 1


def test_greedy_decoding_with_several_samples_is_refused_however_it_is_asked_for() -> None:
    """top_k=1 is greedy at any temperature: --n 4 gave 4 copies of one response, which pass@4 and maj@4 counted as
    4 independent samples (pass@4 = pass@1, maj@4 = accuracy, said to be sampled)."""
    from roll_core.config import load_config

    cfg = load_config(["model=tiny", "pipeline.eval_temperature=0.7", "infer_engine.top_k=1"])
    with pytest.raises(ConfigError, match=r"infer_engine.top_k=1 keeps only the most likely token.*--n 1"):
        check_sampling(cfg, 4)
    check_sampling(cfg, 1)  # one greedy response per problem is a fine evaluation
    check_sampling(load_config(["model=tiny", "pipeline.eval_temperature=0.7", "infer_engine.top_k=2"]), 4)
    with pytest.raises(ConfigError, match=r"evaluation temperature is 0.0, below .*greedy"):
        check_sampling(load_config(["model=tiny", "pipeline.eval_temperature=0"]), 2)


def test_the_vote_equivalence_comes_from_whoever_extracts_the_answers() -> None:
    """maj@n merges answers with the `same_answer` of the task or reward whose `extract_answer` made them (another
    one's would compare keys it never made), called once per pair however many summaries ask."""
    calls: list[tuple[str, str]] = []

    class Reward:
        def extract_answer(self, text: str) -> str | None:
            return text

        def same_answer(self, first: str, other: str) -> bool:
            calls.append((first, other))
            return first.lower() == other.lower()

    same = answer_equivalence(SimpleNamespace(reward=Reward()))
    assert same is not None and same("X", "x") and same("X", "x") and not same("x", "y")
    assert calls == [("X", "x"), ("x", "y")]
    assert answer_equivalence(EchoTask()) is None  # extracts, no equivalence: votes by key
    assert answer_equivalence(SimpleNamespace(extract_answer=str, reward=Reward())) is None  # the task's answers
    assert answer_equivalence(SimpleNamespace(reward=None)) is None
