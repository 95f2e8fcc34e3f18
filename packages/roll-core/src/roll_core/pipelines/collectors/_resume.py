"""Rows an inference engine aborted on its own, resumed from their partial output (`resume_aborted`), and the
inference group that evaluation samples with (`_Resuming`): the synchronous prompts collector's, pipeline=rollout's and
roll-eval's (roll_core.pipelines.collectors.prompts re-exports both); `resuming` builds it for the post-training
collectors' task evaluation (pipeline=sft, dpo, distill_offline, and pipeline=distill's teacher accuracy)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from roll_core.agentic.resume_stops import split_stop
from roll_core.idle_aborts import KEY as IDLE_ABORTS_KEY
from roll_core.idle_aborts import MAX_IDLE_ABORTS, check_max_idle_aborts, idle_backoff_s
from roll_core.interfaces import Request, SamplingParams
from roll_core.pipelines.sampling import pad_right
from roll_core.protocol import Batch
from roll_core.routing import ROUTING_ROWS, carry_routing
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


_resume_ids = itertools.count()


def resume_aborted(
    infer: Any,
    prompts: Batch,
    gen: Batch,
    params: SamplingParams,
    n: int,
    pad_id: int,
    cut_ids: frozenset[int] = frozenset(),
    *,
    max_idle_aborts: int = MAX_IDLE_ABORTS,
    tokenizer: Any = None,
) -> tuple[Batch, list[int], int]:
    """`gen` (a batched generation: `n` rows per prompt of `prompts`) with the rows the engine aborted on its own
    resumed; returns (generation, refused row indices, rows resumed).

    A row with finish reason "abort" is submitted again (`infer.submit_request`) as its prompt followed by what it
    generated, with the rest of its budget (`params.max_new_tokens`) and a seed of its own per attempt, until it
    finishes: its tokens and behaviour log-probs are every attempt's in order, its finish reason the last one's, its
    MoE routing (`routed_experts_rows`) the last request's, which covers the prompt and every token, with earlier
    attempts' where it recorded none (roll_core.routing.carry_routing; a restart: its prompt's). An abort that
    left the whole budget generated, or a resume whose context the engine cannot hold, is a row cut at its limit
    ("length"); a prefix holding a picture placeholder is not resumed (the response is cut before it anyway:
    roll_core.pipelines.rollout.cut_picture_tokens, and the engine would refuse a placeholder without a picture)
    and ends "stop"; a stop string of `params.stop` that the earlier attempts began and a resume completed (no engine
    saw it whole: each matches stop strings on its own request's output) cuts the row at its completing token, "stop",
    where an unaborted row stopped (roll_core.agentic.resume_stops; read with `tokenizer`, which callers with stop
    strings must give); a constrained row (`params.structured`) is generated again from its prompt (the engine would
    start the constraint over after the prefix). A row aborted `max_idle_aborts` (pipeline.max_idle_aborts) times in
    a row without a token (a constrained row: `max_idle_aborts` times, tokens or not), the batch's own abort
    included, stays "abort" and is returned as refused (logged): the caller drops it (its group), it is not an
    answer to score.

    Why: scoring an aborted row trains the engine's preemption as the policy's failure (reward 0 for a cut answer);
    resuming keeps the row a sample of the policy (dropping or resampling it would bias the batch against long
    responses, the ones preemption hits)."""
    check_max_idle_aborts(max_idle_aborts)
    reasons = list(gen["finish_reason"])
    todo = [i for i, r in enumerate(reasons) if r == "abort"]
    if not todo:
        return gen, [], 0
    budget = params.max_new_tokens
    resp, logp, mask = gen["responses"], gen["behaviour_logprobs"], gen["response_mask"].bool()
    tokens = {i: resp[i][mask[i]].tolist() for i in todo}
    logprobs = {i: logp[i][mask[i]].tolist() for i in todo}
    routing = list(gen[ROUTING_ROWS]) if ROUTING_ROWS in gen else None
    mm = prompts["mm_inputs"] if "mm_inputs" in prompts else None
    # The engine's aborts in a row that brought no progress, this one included (a constrained row starts over at
    # every attempt: each of its aborts counts, else one aborted every time after a token would never end).
    restarts = params.structured is not None
    if params.stop and tokenizer is None:
        raise ValueError("resume_aborted: stop strings need the tokenizer to find one split across a resume")
    idle = {i: int(restarts or not tokens[i]) for i in todo}
    resumed: set[int] = set()
    refused: list[int] = []
    for attempt in itertools.count(1):
        pending = []
        for i in todo:
            if len(tokens[i]) >= budget:
                reasons[i] = "length"  # the abort raced the budget's end: the row is complete, cut at its limit
            elif cut_ids.intersection(tokens[i]):
                reasons[i] = "stop"
            else:
                pending.append(i)
        if not pending:
            break
        handles = {}
        for i in pending:
            if restarts:  # a constraint cannot go on from a prefix (the engine would start it over there)
                tokens[i], logprobs[i] = [], []
            seed = None if params.seed is None else derive_seed(params.seed, Purpose.ENGINE_ROW, i, attempt)
            rest = params.replace(max_new_tokens=budget - len(tokens[i]), seed=seed)
            request = Request(
                f"rlvr-resume-{next(_resume_ids)}",
                list(prompts["prompt_ids"][i // n]) + tokens[i],
                rest,
                mm=None if mm is None else mm[i // n],
            )
            handles[i] = infer.submit_request(request)
            resumed.add(i)
        todo = []
        for i, handle in handles.items():
            out = handle.result()
            earlier = len(tokens[i])
            tokens[i] += list(out.token_ids)
            logprobs[i] += list(out.logprobs)
            prompt = prompts["prompt_ids"][i // n]
            if routing is not None:  # earlier attempts' records where this one has none (a restart: its prompt's)
                routing[i] = carry_routing(routing[i], out.routed_experts, len(prompt) if restarts else None)
            # the engine cannot hold prompt + prefix: the response is cut at the engine's limit
            reasons[i] = "length" if out.finish_reason == "prompt_too_long" else out.finish_reason
            # a stop string split across the resume point: the row ends where an unaborted one did
            split = split_stop(tokenizer, prompt, tokens[i], earlier, params.stop) if params.stop else None
            if split is not None:
                del tokens[i][split:], logprobs[i][split:]
                if routing is not None and routing[i] is not None:  # the positions of the cut tokens go too
                    routing[i] = routing[i][: len(prompt) + split]
                reasons[i] = "stop"
            if reasons[i] != "abort":
                continue
            idle[i] = 0 if out.token_ids and not restarts else idle[i] + 1
            if idle[i] < max_idle_aborts or len(tokens[i]) >= budget:
                todo.append(i)
            else:
                refused.append(i)
        # Resubmitted at once, rows an engine preempted for a moment (KV-cache blocks still held) used up every try
        # within milliseconds and their prompts were refused (roll_core.idle_aborts).
        time.sleep(idle_backoff_s(max((idle[i] for i in todo if len(tokens[i]) < budget), default=0)))
    if refused:
        log.warning(
            "the inference engine aborted %d row(s) %d times in a row without a token (prompts of up to %d tokens): "
            "their prompts are refused (SGLang aborts a prompt longer than its KV cache holds; an engine that only "
            "pauses that often: raise %s)",
            len(refused),
            max_idle_aborts,
            max(len(prompts["prompt_ids"][i // n]) for i in refused),
            IDLE_ABORTS_KEY,
        )
    width = max([resp.shape[1], *(len(t) for t in tokens.values())])
    t = gen.tensors()
    resp, logp = pad_right(resp, width, pad_id).clone(), pad_right(logp, width).clone()
    mask = pad_right(gen["response_mask"], width).clone()
    for i in tokens:
        k = len(tokens[i])
        resp[i], logp[i], mask[i] = pad_id, 0.0, 0
        if k:
            resp[i, :k] = torch.tensor(tokens[i], dtype=resp.dtype)
            logp[i, :k] = torch.tensor(logprobs[i], dtype=logp.dtype)
            mask[i, :k] = 1
    t.update(responses=resp, behaviour_logprobs=logp, response_mask=mask)
    t["truncated"] = torch.tensor([r == "length" for r in reasons], dtype=torch.long)
    fields = {**gen.fields, "finish_reason": reasons}
    if routing is not None:
        fields[ROUTING_ROWS] = routing
    return Batch(t, fields, gen.meta), sorted(refused), len(resumed)


class _Resuming:
    """An inference group whose batch `generate` resumes the rows the engine aborted on its own (`resume_aborted`):
    what evaluation samples with (a row aborted `max_idle_aborts` times in a row without a token stays "abort",
    logged)."""

    def __init__(
        self,
        infer: Any,
        pad_id: int,
        cut_ids: frozenset[int],
        max_idle_aborts: int = MAX_IDLE_ABORTS,
        tokenizer: Any = None,
    ) -> None:
        self.infer, self.pad_id, self.cut_ids = infer, pad_id, cut_ids
        self.max_idle_aborts, self.tokenizer = max_idle_aborts, tokenizer

    def generate(self, prompts: Batch, params: SamplingParams, n: int = 1) -> Batch:
        gen = self.infer.generate(prompts, params, n=n)
        cut, most, tok = self.cut_ids, self.max_idle_aborts, self.tokenizer
        return resume_aborted(
            self.infer, prompts, gen, params, n, self.pad_id, cut, max_idle_aborts=most, tokenizer=tok
        )[0]


def resuming(infer: Any, tokenizer: Any, max_idle_aborts: int = MAX_IDLE_ABORTS) -> _Resuming:
    """`infer` (an inference group) as a text evaluation samples with (`_Resuming`): rows the engine aborted on its
    own are resumed, padded with `tokenizer`'s pad id (0 without one), and refused after `max_idle_aborts`
    (pipeline.max_idle_aborts) idle aborts in a row. For the collectors that evaluate a task's held-out problems
    beside training rows from files (pipeline=sft, dpo, distill_offline): they sampled with the bare group, so one
    preemption of a row under load (vLLM's preemption, SGLang's memory pressure) scored it an engine failure."""
    pad = tokenizer.pad_token_id
    return _Resuming(infer, 0 if pad is None else int(pad), frozenset(), max_idle_aborts, tokenizer)
