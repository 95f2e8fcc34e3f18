"""The synchronous prompts collector (pipeline=rlvr) and rows the engine aborts on its own: SGLang under memory
pressure and vLLM at its preemption limit end a row with finish reason "abort" and a partial answer. Such a row used
to be scored (0 for its incomplete answer) and trained as the policy's failure; it is now resumed from its partial
output, as the asynchronous driver resumes its samples, and a prompt the engine keeps refusing has its whole group
dropped (counted), so GRPO's groups stay complete. "Keeps refusing" is `pipeline.max_idle_aborts` aborts in a row
without a token, in training, evaluation and pipeline=rollout alike.

The engine is scripted: the batch API aborts chosen rows after a few tokens, the request API finishes them."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.prompts import MAX_IDLE_ABORTS, PromptCollector, resume_aborted
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch

PROMPTS = [[11, 12, 13], [21, 22]]
ANSWER = 5  # tokens of a complete answer (the reward below gives 1 to a complete answer, 0 to a cut one)


class AbortingInfer:
    """Batch `generate`: every row answers ANSWER tokens 7 ('stop'), except rows in `partial` (row -> tokens), which
    the engine aborts after that many. Request API: a resumed row gets the rest of its answer as tokens 8 ('stop'),
    or `preempt[attempt]` tokens then another abort; a prompt in `refuse` is aborted without a token every time."""

    def __init__(self, partial: dict[int, int], preempt: tuple[int, ...] = (), refuse: tuple[int, ...] = ()) -> None:
        self.partial, self.preempt, self.refuse = partial, preempt, refuse
        self.requests: list[Request] = []

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        rows = len(prompts) * n
        resp = torch.zeros((rows, ANSWER), dtype=torch.long)
        logp, mask = torch.zeros((rows, ANSWER)), torch.zeros((rows, ANSWER), dtype=torch.long)
        finish = []
        for i in range(rows):
            k = self.partial.get(i, ANSWER)
            resp[i, :k], logp[i, :k], mask[i, :k] = 7, -0.1, 1
            finish.append("abort" if i in self.partial else "stop")
        out = Batch(
            {"responses": resp, "behaviour_logprobs": logp, "response_mask": mask, "truncated": torch.zeros(rows)},
            {"finish_reason": finish},
        )
        out.meta["generate_seconds"] = 1.0
        return out

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        prompt = next(p for p in PROMPTS if request.prompt_ids[: len(p)] == p)
        done = len(request.prompt_ids) - len(prompt)  # tokens the row already has
        attempt = sum(r.prompt_ids[: len(prompt)] == prompt for r in self.requests) - 1
        if PROMPTS.index(prompt) in self.refuse:
            ids, finish = [], "abort"
        elif attempt < len(self.preempt):
            ids, finish = [8] * self.preempt[attempt], "abort"
        else:
            ids, finish = [8] * min(ANSWER - done, request.params.max_new_tokens), "stop"
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.3] * len(ids), finish))
        return fut


@pytest.fixture(autouse=True)
def fast_idle_retries(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refusals' tries without the waits between them (roll_core.idle_aborts; ~3.5 s each otherwise), except in
    the test of those waits."""
    from roll_core import idle_aborts

    if "paused" not in request.node.name:
        monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.0)


def test_rows_an_engine_paused_for_a_moment_aborted_are_resumed_not_refused() -> None:
    """Resubmitted at once, rows an engine preempted for 0.3 s (KV-cache blocks still held) used up their tries
    within milliseconds and their prompts were refused; with the waits between tries they are resumed."""
    import time

    class Paused(AbortingInfer):
        def submit_request(self, request: Request, route_key: str | None = None) -> Future:
            self.start = getattr(self, "start", None) or time.monotonic()
            if time.monotonic() - self.start < 0.3:
                self.requests.append(request)
                fut: Future = Future()
                fut.set_result(RequestOutput(request.request_id, request.prompt_ids, [], [], "abort"))
                return fut
            return super().submit_request(request, route_key)

    infer = Paused({1: 2, 2: 0})
    params = SamplingParams(max_new_tokens=16)
    out, refused, resumed = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    assert (refused, resumed) == ([], 2)
    assert out["finish_reason"] == ["stop"] * 4
    assert 2 * 2 <= len(infer.requests) < 2 * MAX_IDLE_ABORTS  # a few idle tries each, then the answer


def _prompts() -> Batch:
    return Batch(fields={"prompt_ids": [list(p) for p in PROMPTS], "problem_id": ["p0", "p1"], "answer": ["", ""]})


def test_a_row_the_engine_aborts_is_resumed_from_its_partial_output() -> None:
    infer = AbortingInfer({1: 2})
    params = SamplingParams(max_new_tokens=16, seed=3)
    gen = infer.generate(_prompts(), params, 2)
    out, refused, resumed = resume_aborted(infer, _prompts(), gen, params, 2, pad_id=0)
    assert (refused, resumed) == ([], 1)
    (req,) = infer.requests
    assert req.prompt_ids == PROMPTS[0] + [7, 7] and req.params.max_new_tokens == 14 and req.params.seed != 3
    n = int(out["response_mask"][1].sum())
    assert out["responses"][1, :n].tolist() == [7, 7, 8, 8, 8]
    assert out["behaviour_logprobs"][1, :n].tolist() == pytest.approx([-0.1, -0.1, -0.3, -0.3, -0.3])
    assert out["finish_reason"] == ["stop"] * 4 and out["truncated"].tolist() == [0, 0, 0, 0]
    assert torch.equal(out["responses"][[0, 2, 3]], gen["responses"][[0, 2, 3]])  # the other rows untouched


def test_a_row_preempted_again_resumes_again_and_one_with_its_budget_spent_is_cut() -> None:
    infer = AbortingInfer({0: 1}, preempt=(0, 2))  # resumed: aborted without a token, then after 2 more
    params = SamplingParams(max_new_tokens=16)
    out, refused, resumed = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    assert (refused, resumed, len(infer.requests)) == ([], 1, 3)
    assert [len(r.prompt_ids) - 3 for r in infer.requests] == [1, 1, 3]  # each attempt after the tokens so far
    assert out["responses"][0, : int(out["response_mask"][0].sum())].tolist() == [7, 8, 8, 8, 8]
    spent = AbortingInfer({2: ANSWER})  # aborted with the whole budget generated: complete, cut at its limit
    params = SamplingParams(max_new_tokens=ANSWER)
    out, refused, resumed = resume_aborted(spent, _prompts(), spent.generate(_prompts(), params, 2), params, 2, 0)
    assert (out["finish_reason"][2], out["truncated"][2].item(), resumed, spent.requests) == ("length", 1, 0, [])


def test_a_constrained_row_is_generated_again_from_its_prompt() -> None:
    """A structured-output constraint cannot go on after a prefix (the engine would start it over there)."""
    from roll_core.interfaces.inference import StructuredOutput

    infer = AbortingInfer({3: 2})
    params = SamplingParams(max_new_tokens=16, structured=StructuredOutput(regex="[0-9]+"))
    out, refused, resumed = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    (req,) = infer.requests
    assert (refused, resumed) == ([], 1)
    assert req.prompt_ids == PROMPTS[1] and req.params.max_new_tokens == 16 and req.params.structured is not None
    assert out["responses"][3, : int(out["response_mask"][3].sum())].tolist() == [8] * ANSWER
    # one aborted after a token every time restarts from nothing every time: given up, not retried for ever
    again = AbortingInfer({3: 2}, preempt=(1,) * 100)
    out, refused, _ = resume_aborted(again, _prompts(), again.generate(_prompts(), params, 2), params, 2, 0)
    assert refused == [3] and len(again.requests) == MAX_IDLE_ABORTS - 1


def test_a_prompt_the_engine_keeps_refusing_is_given_up_after_max_idle_aborts() -> None:
    infer = AbortingInfer({2: 0}, refuse=(1,))
    params = SamplingParams(max_new_tokens=16)
    out, refused, _ = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    assert refused == [2] and out["finish_reason"][2] == "abort"
    assert len(infer.requests) == MAX_IDLE_ABORTS - 1  # the batch's own abort was the first without a token


class _Reward:
    """1 for a complete answer (ANSWER tokens), 0 for a cut one."""

    def score(self, batch: Batch) -> Batch:
        s = (batch["response_mask"].sum(-1) >= ANSWER).float()
        return Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * len(s)})


def _collector(infer: AbortingInfer, pipeline: Any = None) -> PromptCollector:
    """The prompts collector around `infer`; `pipeline`: its pipeline config (seed 0, 2 prompts a step, the default
    max_idle_aborts when None)."""
    c = PromptCollector.__new__(PromptCollector)
    algo = SimpleNamespace(group_size=2, drop_uniform_groups=False, overlong_buffer=0, reward_clip=None)
    model = SimpleNamespace(max_response_length=16, max_prompt_length=64, chat_template_kwargs={})
    if pipeline is None:
        pipeline = SimpleNamespace(seed=0, rollout_batch_size=2, max_idle_aborts=MAX_IDLE_ABORTS)
    c.cfg = SimpleNamespace(algo=algo, model=model, pipeline=pipeline)
    c.ctx = SimpleNamespace(samples=lambda step, rows: None)
    c.tokenizer, c.task, c.infer, c.processor = build_tiny_tokenizer(), SimpleNamespace(), infer, None
    c.sampling = SamplingParams(max_new_tokens=16)
    c.train_set, c.domains, c.reward_model, c.advantage_scale = [0, 1], [], None, None
    c._draw = lambda k: list(range(k))  # type: ignore[method-assign]
    c._prompt_batch = lambda problems, counts: _prompts()  # type: ignore[method-assign]
    c.sampler = SimpleNamespace(progress=lambda: 0.0)
    c.reward, c.reward_budget, c._step_counters, c._step_failure = _Reward(), RewardFailureBudget(3), {}, None
    return c


def _grpo(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from roll_core.algorithms import AdvantageInputs, grpo, token_rewards_from_scores

    algo = SimpleNamespace(group_size=2, norm_mean_type=None, norm_std_type=None)
    return grpo(AdvantageInputs(scores, token_rewards_from_scores(scores, mask.float()), mask.float()), algo)[0]


def test_an_aborted_row_is_trained_as_its_resumed_answer_not_as_a_failure() -> None:
    """Both rows of prompt 0 answer correctly, one after a preemption: the group has no signal (advantage 0). Scored
    as aborted, the cut row was a failure (score 0) and GRPO pushed both rows apart."""
    out = StepLog()
    collected = _collector(AbortingInfer({1: 2})).next(1, out)
    assert collected.scores.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert out["reward/mean"] == 1.0 and out["data/resumed_rows"] == 1 and out["data/refused_prompts"] == 0
    assert collected.batch["finish_reason"] == ["stop"] * 4
    adv = _grpo(collected.scores, collected.batch["response_mask"])
    assert float(adv.abs().sum()) == 0.0


def test_a_refused_prompt_drops_its_whole_group_so_grpo_groups_stay_complete() -> None:
    """Prompt 1's rows are refused (no token, ever): its group goes, counted; prompt 0's group (one row preempted
    and resumed) is trained alone, with consecutive complete groups as GRPO reads them."""
    out = StepLog()
    collected = _collector(AbortingInfer({1: 2, 2: 0, 3: 0}, refuse=(1,))).next(1, out)
    assert len(collected.batch) == 2 and collected.batch["prompt_ids"] == [PROMPTS[0]] * 2
    assert out["data/refused_prompts"] == 1 and out["data/trained_groups"] == 1 and out["reward/mean"] == 1.0
    assert torch.isfinite(_grpo(collected.scores, collected.batch["response_mask"])).all()
    with pytest.raises(RuntimeError, match="refused every prompt"):
        _collector(AbortingInfer({i: 0 for i in range(4)}, refuse=(0, 1))).next(1, StepLog())


def test_evaluation_resumes_the_engines_aborts_too() -> None:
    from roll_core.pipelines.collectors.prompts import _Resuming

    infer = AbortingInfer({0: 3})
    gen = _Resuming(infer, 0, frozenset()).generate(_prompts(), SamplingParams(max_new_tokens=16), n=1)
    assert gen["finish_reason"] == ["stop", "stop"] and gen["response_mask"].sum(-1).tolist() == [ANSWER, ANSWER]


def _rollout_collector(infer: AbortingInfer, monkeypatch: pytest.MonkeyPatch) -> object:
    """A rollout-only collector (pipeline=rollout) around the scripted engine, scoring with `_Reward`."""
    from roll_core.pipelines.collectors import rollout_only

    scoring = _collector(infer)
    scoring.end_reward_step = lambda step: None  # type: ignore[method-assign]
    scoring.log_samples = lambda *a: None  # type: ignore[method-assign]
    scoring.score = lambda batch, out: _Reward().score(batch)  # type: ignore[method-assign]
    c = rollout_only.RolloutCollector.__new__(rollout_only.RolloutCollector)
    c.cfg, c.ctx = scoring.cfg, SimpleNamespace(sampling=SamplingParams(max_new_tokens=16))
    c.ro = SimpleNamespace(samples_per_prompt=2, shard=0)
    c.scoring, c.tokenizer, c.infer, c.task = scoring, scoring.tokenizer, infer, SimpleNamespace()
    c.skipped, c.reward_failed_rows = 0, 0
    prompts = _prompts()
    prompts["prompt_text"], prompts["metadata"] = ["a", "b"], [{}, {}]
    monkeypatch.setattr(rollout_only, "prompt_batch", lambda *a, **k: prompts)
    return c


def test_rollout_only_writes_resumed_answers_and_leaves_refused_rows_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """pipeline=rollout wrote an aborted row as an answer (a cut response scored 0: DPO's rejected side, SFT
    filtered on it); it is now resumed, and a row the engine keeps refusing is not written (counted)."""
    out = StepLog()
    c = _rollout_collector(AbortingInfer({1: 2, 2: 0, 3: 0}, refuse=(1,)), monkeypatch)
    rows = c._rows(1, [0, 1], out)
    assert [(r["prompt_ids"], len(r["response_ids"]), r["reward"], r["finish_reason"]) for r in rows] == [
        (PROMPTS[0], ANSWER, 1.0, "stop"),
        (PROMPTS[0], ANSWER, 1.0, "stop"),
    ]
    assert out["data/resumed_rows"] == 3 and out["data/refused_rows"] == 2


@pytest.mark.parametrize("n", [3, 11])
def test_pipeline_max_idle_aborts_decides_when_the_sync_collector_refuses_a_prompt(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipeline.max_idle_aborts=N` (only RLVR's async driver read it: the sync collector's resumes, its evaluation's
    and pipeline=rollout's refused at the module's 8 whatever was set): a row the engine aborts without a token every
    time is refused at its N-th abort in a row (the batch's own abort the first, so N - 1 requests), in training,
    evaluation and pipeline=rollout; the error of a step whose every prompt was refused names the key and N."""
    from roll_core.config.compose import load_config
    from roll_core.pipelines.collectors import prompts

    pipeline = load_config([f"pipeline.max_idle_aborts={n}", "pipeline.rollout_batch_size=2"]).pipeline
    infer = AbortingInfer({1: 2, 2: 0, 3: 0}, refuse=(1,))
    out = StepLog()
    collected = _collector(infer, pipeline).next(1, out)
    assert out["data/refused_prompts"] == 1 and len(collected.batch) == 2
    assert sum(r.prompt_ids[:2] == PROMPTS[1] for r in infer.requests) == 2 * (n - 1)  # both rows of prompt 1
    with pytest.raises(RuntimeError, match=rf"raise pipeline[.]max_idle_aborts, now {n}"):
        _collector(AbortingInfer({i: 0 for i in range(4)}, refuse=(0, 1)), pipeline).next(1, StepLog())

    # evaluation: the collector's `evaluate` samples through what it passes the evaluation loop
    seen: list[Any] = []

    def evaluate(infer: Any, *args: Any, **kwargs: Any) -> dict[str, float]:  # the loop over the held-out set
        seen.append(infer)
        return {"accuracy": 0.0, "accuracy_stderr": None, "reward": 0.0, "n": 0}

    monkeypatch.setattr(prompts, "evaluate", evaluate)
    evaluating = AbortingInfer({1: 0}, refuse=(1,))
    c = _collector(evaluating, pipeline)
    c.task, c.eval_set, c.scoring = SimpleNamespace(), [], None
    c.evaluate(1)
    gen = seen[0].generate(_prompts(), SamplingParams(max_new_tokens=16), n=1)
    assert gen["finish_reason"] == ["stop", "abort"] and len(evaluating.requests) == n - 1

    # pipeline=rollout: the refused rows are not written
    rolling = AbortingInfer({2: 0, 3: 0}, refuse=(1,))
    ro = _rollout_collector(rolling, monkeypatch)
    ro.cfg = SimpleNamespace(**{**vars(ro.cfg), "pipeline": pipeline})
    rollout_out = StepLog()
    ro._rows(1, [0, 1], rollout_out)
    assert rollout_out["data/refused_rows"] == 2 and len(rolling.requests) == 2 * (n - 1)


# ---- MoE routing of resumed rows (routed-expert replay) ---------------------------------------------------------
class RoutedInfer(AbortingInfer):
    """AbortingInfer recording MoE routing (1 layer, top-2): the batch's row i holds i + 1 at every computed
    position; resumes follow `script` per request: "refused" (aborted before its prefill: nothing computed),
    "too_long" (prompt_too_long: nothing computed), "finish" (the rest of the answer, 9 everywhere)."""

    def __init__(self, partial: dict[int, int], script: list[str]) -> None:
        super().__init__(partial)
        self.script = script

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        from roll_core.routing import ROUTING_ROWS

        out = super().generate(prompts, params, n)
        lens = [len(prompts["prompt_ids"][i // n]) + int(out["response_mask"][i].sum()) - 1 for i in range(len(out))]
        out[ROUTING_ROWS] = [torch.full((k, 1, 2), i + 1, dtype=torch.int16) for i, k in enumerate(lens)]
        return out

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        from roll_core.routing import UNROUTED

        self.requests.append(request)
        what, k = self.script.pop(0), len(request.prompt_ids)
        ids = [8] * (ANSWER - (k - 3)) if what == "finish" else []
        finish = {"refused": "abort", "too_long": "prompt_too_long", "finish": "stop"}[what]
        routed = torch.full((k + max(len(ids) - 1, 0), 1, 2), 9 if ids else UNROUTED, dtype=torch.int16)
        fut: Future = Future()
        logp = [-0.3] * len(ids)
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, logp, finish, routed_experts=routed))
        return fut


def test_a_resumed_rows_routing_keeps_what_earlier_attempts_recorded() -> None:
    """Each attempt's routing replaced the row's: a last attempt that computed nothing (prompt_too_long, or the hf
    engine aborting it before its prefill) threw away the routing already recorded, and the row trained with the
    trainer's own router. Positions the last attempt did not record now keep the earlier attempts' experts."""
    from roll_core.routing import ROUTING_ROWS, UNROUTED

    params = SamplingParams(max_new_tokens=16)
    infer = RoutedInfer({1: 2}, ["refused", "too_long"])  # row 1: prompt 3 + 2 tokens, 4 positions recorded (2)
    out, _, _ = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    assert out["finish_reason"][1] == "length"
    row = out[ROUTING_ROWS][1][:, 0, 0].tolist()
    assert row == [2, 2, 2, 2, UNROUTED]  # was: 5 x UNROUTED (the prompt_too_long attempt's)
    # an attempt that records everything replaces the earlier ones (the same tokens, the latest weights' record)
    infer = RoutedInfer({1: 2}, ["refused", "finish"])
    out, _, _ = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    assert out[ROUTING_ROWS][1][:, 0, 0].tolist() == [9] * 7  # prompt 3 + 5 tokens, the last never fed back
    assert [r.shape[0] for r in out[ROUTING_ROWS]] == [7, 7, 6, 6]


def test_a_restarted_rows_routing_keeps_only_its_prompts() -> None:
    """A constrained row is generated again from its prompt: the earlier response's positions are of other tokens,
    only its prompt's routing lines up."""
    from roll_core.interfaces.inference import StructuredOutput
    from roll_core.routing import ROUTING_ROWS

    params = SamplingParams(max_new_tokens=16, structured=StructuredOutput(regex="[0-9]+"))
    infer = RoutedInfer({3: 2}, ["too_long"])  # row 3: prompt 2 + 2 tokens, 3 positions recorded (4)
    out, _, _ = resume_aborted(infer, _prompts(), infer.generate(_prompts(), params, 2), params, 2, 0)
    assert int(out["response_mask"][3].sum()) == 0
    assert out[ROUTING_ROWS][3][:, 0, 0].tolist() == [4, 4]  # was: [-1, -1]; never the old response's third


def test_assemble_counts_the_positions_the_trainer_routes_itself() -> None:
    """Rows (or positions) with no recorded routing fell back to the trainer's router uncounted."""
    from roll_core.pipelines.rollout import assemble
    from roll_core.routing import ROUTED_EXPERTS, ROUTING_ROWS, UNROUTED

    prompts = Batch(fields={"prompt_ids": [[11, 12, 13], [21, 22], [31]]})
    gen = Batch(
        {
            "responses": torch.tensor([[7, 7, 7], [7, 7, 0], [7, 0, 0]]),
            "behaviour_logprobs": torch.zeros(3, 3),
            "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]),
        },
        {
            "finish_reason": ["stop"] * 3,
            ROUTING_ROWS: [
                torch.ones(5, 2, 2, dtype=torch.int16),  # prompt 3 + 3 tokens: all recorded
                torch.tensor([1, 1, UNROUTED], dtype=torch.int16).view(3, 1, 1).repeat(1, 2, 2),  # one lost
                torch.full((1, 2, 2), UNROUTED, dtype=torch.int16),  # nothing recorded (1 counted position)
            ],
        },
    )
    gen[ROUTING_ROWS][1][2, 1] = 1  # one MoE layer of the lost position recorded: the other is still the trainer's
    counts: dict[str, Any] = {}
    batch = assemble(SimpleNamespace(pad_token_id=0), prompts, gen, counts)
    assert ROUTED_EXPERTS in batch
    assert counts["routing/unreplayed_positions"] == 2 and counts["routing/unreplayed_rows"] == 1


class _RoundsInfer(AbortingInfer):
    """Every row answers ANSWER tokens; the engine reports `seconds[r]` for its r-th batch (generation round)."""

    def __init__(self, seconds: list[float]) -> None:
        super().__init__({})
        self.seconds = list(seconds)

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        out = super().generate(prompts, params, n)
        out.meta["generate_seconds"] = self.seconds.pop(0)
        return out


class _RoundsReward:
    """Scores and reward counters scripted per call (one per generation round)."""

    def __init__(self, script: list[tuple[list[float], dict[str, float]]]) -> None:
        self.script = list(script)

    def score(self, batch: Batch) -> Batch:
        scores, counters = self.script.pop(0)
        s = torch.tensor(scores)
        out = Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * len(s)})
        out.meta["reward_counters"] = dict(counters)
        return out


def test_dynamic_samplings_refill_rounds_count_in_the_steps_rollout_and_reward_counts() -> None:
    """DAPO dynamic sampling (algo.drop_uniform_groups): round 0's two groups have no reward variance and are
    dropped, a refill round draws two more. The step's reward counters (`reward/rows`, `reward/failed_rows`) were
    round 0's only (4 rows, 1 failed, while the failure budget counted 8 and 3) and the rollout throughput was
    round 0's tokens over round 0's time (20 tokens / 1 s); they now cover both rounds: 8 rows scored, 3 failed,
    `perf/rollout_tokens` 40 generated in 1 + 3 s."""
    c = _collector(_RoundsInfer([1.0, 3.0]))
    c.cfg.algo.drop_uniform_groups, c.cfg.algo.refill_oversample, c.cfg.algo.refill_max_batches = True, 1.0, 2.0
    c.reward = _RoundsReward(
        [
            ([1.0, 1.0, 0.0, 0.0], {"rows": 4, "failed_rows": 1, "failed_errors": 1}),  # both groups uniform
            ([1.0, 0.0, 0.0, 1.0], {"rows": 4, "failed_rows": 2, "failed_errors": 2}),  # both informative
        ]
    )
    out = StepLog()
    collected = c.next(1, out)
    assert len(collected.batch) == 4 and collected.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert (out["data/sampled_groups"], out["data/dropped_groups"], out["data/refill_rounds"]) == (4, 2, 1)
    assert (out["reward/rows"], out["reward/failed_rows"], out["reward/failed_errors"]) == (8.0, 3.0, 3.0)
    assert c.reward_budget.totals["rows"] == 8 and c.reward_budget.totals["failed_rows"] == 3  # the same counts
    assert out.get("perf/rollout_tokens") == 2 * 4 * ANSWER
    assert out["perf/rollout_tokens_per_s"] == pytest.approx(2 * 4 * ANSWER / 4.0)
    assert out["reward/mean"] == 0.5  # the reward metrics stay round 0's unfiltered sample's
