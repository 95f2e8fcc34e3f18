"""`roll-eval`'s engine: held-out metrics of one model with the run config's inference settings.

Single-turn tasks: `n` responses per held-out problem (one greedy or sampled response by default; n > 1 needs a
sampling temperature > 0 and infer_engine.top_k != 1: greedy decoding gives n copies of one response), scored by the
same reward role (and reward model) a training run's evaluation uses (the `rlvr` prompts collector's scoring),
whatever `pipeline.name` says: evaluation of a single-turn task is the same for every pipeline kind. Every response
is one record (`rows`: problem index and id, domain, difficulty, response, ground truth, extracted answer, reward,
correctness, format flag, length, finish reason, failure), and the metrics are computed from those records by
roll_core.eval_metrics (pass@k, maj@n, lengths, truncation, format, per-domain and per-difficulty). With n=1 the
accuracy is the one a training run logs as `eval/accuracy`: the same prompts, sampling parameters and seed (derived
from `pipeline.seed`, so every model of a comparison sees the same problems and seeds), whatever the run's
`infer_engine.world_size` (evaluation runs on one engine; a batch split over N engines samples what one engine
samples: `InferGroup.generate`).

Rows the engine aborted on its own (SGLang under memory pressure, vLLM at its preemption limit) are resumed from
their partial output, as the training run's evaluation resumes them (`resume_aborted`); a row the engine keeps
refusing (`pipeline.max_idle_aborts` aborts in a row without a token) stays "abort" and is marked
`failed: "engine"`, a row the reward could not score `failed: "reward"`: both count as wrong, as in eval/accuracy,
and are counted in the metrics' `failed`. So is a row whose `correct` is no grade (not 0 or 1: a reward scored
without the reward guard giving partial credit 0.5; `failed: "reward"`, `invalid_correct: true`, counted in the
metrics' `invalid_correct`), as eval/accuracy counts it; roll-eval refused such a run.

Majority vote needs each response's extracted answer: the task's `extract_answer(response) -> str | None`, else
its reward's (the math reward's: the last non-empty \\boxed{}, plain numbers in one spelling: 1,000 = 1000); an
extractor that declares a `choices` parameter gets the row's `choices` (its metadata's), as the reward grading it
reads them (the visual reward: the last choice named), so that a vote is the answer that was graded. The
same owner's `same_answer(first, other) -> bool`, when it has one, merges answers no spelling unites (the math
reward's symbolic check: \\frac{1}{\\sqrt2} = \\frac{\\sqrt2}{2}; roll_core.eval_metrics.vote_keys). A task
with neither reports maj@n as None and says so once in the log. Problems whose prompt exceeds
`model.max_prompt_length`, or fills the engine's context, are skipped, counted (`skipped_problems`) and logged, never
truncated; `skipped_by_reason` splits the count (SKIP_REASONS: `prompt_length`, `engine_context`,
`bad_pictures`: a problem whose pictures could not be read or placed).

Agentic tasks (env=sokoban, ...): one episode per held-out environment seed, through the agentic collector's
evaluation, reporting success rate, mean turns and the invalid-action rate (n must be 1); agent programs
(pipeline=agent) through theirs (accuracy and reward); `samples` caps the seeds, or the program's held-out rows
(`first_eval_rows`). Their rates come with a standard error over the episodes
(`success_rate_stderr`, `accuracy_stderr`: `episode_result`). An episode whose environment (or agent program) failed
is an unsuccessful attempt in those rates whatever `env.on_failure` says (`failed_episodes`; `dropped_episodes`:
those `drop` keeps out of training); only episodes the engine refused are left out (`aborted_episodes`). Runs in this
process (no Ray), one inference worker per model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from roll_core import registry
from roll_core.cluster.launch import Cluster
from roll_core.cluster.roles import InferGroup
from roll_core.config.build import as_dict, build
from roll_core.config.compose import ConfigError
from roll_core.eval_metrics import (
    SameAnswer,
    breakdown,
    difficulty_of,
    failure,
    graded_row,
    memoized,
    problem_scores,
    rate_stderr,
    summarize,
)
from roll_core.interfaces.agentic import INFO_COUNTERS
from roll_core.interfaces.inference import GREEDY_TEMPERATURE
from roll_core.interfaces.tasks import AgenticTask, answer_reader
from roll_core.models import resolve_model_path
from roll_core.pipelines.collectors import CollectorContext
from roll_core.pipelines.wiring import sampling_params

log = logging.getLogger(__name__)

#: Why a held-out problem was not scored (`skipped_by_reason`): its prompt exceeds model.max_prompt_length, it fills
#: the inference engine's context (every row came back "prompt_too_long"), its pictures could not be read or placed.
SKIP_REASONS = ("prompt_length", "engine_context", "bad_pictures")


def eval_temperature(cfg: Any) -> float:
    """The temperature held-out sampling uses: pipeline.eval_temperature, else the inference engine's."""
    t = cfg.pipeline.eval_temperature
    return float(cfg.infer_engine.temperature if t is None else t)


def check_sampling(cfg: Any, n: int) -> None:
    """Refuse n < 1, and n > 1 responses per problem under greedy decoding (temperature 0, or top_k=1 at any
    temperature): n copies of one response, which pass@k and maj@n would count as n independent samples."""
    if n < 1:
        raise ConfigError(f"--n {n}: sample at least one response per problem")
    if n > 1 and eval_temperature(cfg) < GREEDY_TEMPERATURE:
        raise ConfigError(
            f"--n {n} samples {n} responses per problem, but the evaluation temperature is {eval_temperature(cfg)}, "
            f"below {GREEDY_TEMPERATURE} (greedy: {n} copies of one response, so pass@k and maj@n would say nothing): "
            f"set pipeline.eval_temperature=0.7 (or any value >= {GREEDY_TEMPERATURE}), or use --n 1"
        )
    if n > 1 and int(getattr(cfg.infer_engine, "top_k", 0) or 0) == 1:
        raise ConfigError(
            f"--n {n} samples {n} responses per problem, but infer_engine.top_k=1 keeps only the most likely token "
            f"(greedy at any temperature: {n} copies of one response, so pass@k and maj@n would say nothing): set "
            "infer_engine.top_k=0 (or a value > 1), or use --n 1"
        )


def answer_extractor(task: Any) -> Callable[[str], str | None] | None:
    """The task's `extract_answer`, else its reward's, else None (majority vote is then not reported)."""
    for owner in (task, getattr(task, "reward", None)):
        fn = getattr(owner, "extract_answer", None)
        if callable(fn):
            return fn
    return None


def answer_equivalence(task: Any) -> SameAnswer | None:
    """The `same_answer(first, other) -> bool` of whichever of the task and its reward gives `extract_answer` (it
    compares that one's answers; roll_core.eval_metrics), remembering its results; None: votes are by key alone."""
    for owner in (task, getattr(task, "reward", None)):
        if callable(getattr(owner, "extract_answer", None)):
            fn = getattr(owner, "same_answer", None)
            return memoized(fn) if callable(fn) else None
    return None


def restore_reward_model(collector: Any, model_path: str) -> bool:
    """Give the collector's reward model (reward_model=hf, normalize=running or batch: evaluation normalises by the
    training scores' running statistics either way) the statistics the training run had at the checkpoint
    `model_path` belongs to (`<checkpoint>/actor/model`), so that roll-eval's reward is the training run's own
    eval/reward (a fresh scorer standardised the evaluated batch by itself; a batch-mode checkpoint written before
    its statistics were kept has none). Returns whether statistics were restored."""
    scoring = getattr(collector, "reward_model", None)
    folder = Path(model_path)
    state_file = folder.parent.parent / "state.json"
    if scoring is None or folder.parts[-2:] != ("actor", "model") or not state_file.is_file():
        return False
    import json

    state = (json.loads(state_file.read_text()).get("collector") or {}).get("reward_model")
    if not state:
        return False
    scoring.load_state_dict(state)
    return True


def evaluate_model(cfg: Any, samples: int | None = None, n: int = 1, ks: Sequence[int] = (1,)) -> dict[str, Any]:
    """Evaluate `cfg.model` on `cfg.env`'s held-out split; `samples` caps the held-out problems (or seeds, or rows),
    `n` is the responses per problem and `ks` the pass@k values (each <= n). See the module docstring for the
    result."""
    check_sampling(cfg, n)
    task = build(cfg.env)
    agentic = isinstance(task, AgenticTask)
    episodes = agentic or bool(getattr(task, "is_agent_program", False))  # scored per episode by its collector
    if episodes and n > 1:
        raise ConfigError(f"--n {n}: several responses per problem are for single-turn tasks; env={cfg.env.name}")
    # A single-turn task is scored by the prompts collector whatever pipeline trained the model (sft, dpo, ...).
    name = ("agentic" if agentic and cfg.pipeline.name == "rlvr" else cfg.pipeline.name) if episodes else "rlvr"
    # said before a model is loaded; an agent program has held-out rows (`eval_rows`), not problems (`eval_set`):
    # asking it for `eval_set` was an AttributeError before any pipeline=agent evaluation
    if not episodes and not task.eval_set()[: samples or cfg.pipeline.eval_size]:
        raise ConfigError(
            f"env={getattr(task, 'name', type(task).__name__)} has no held-out problems to evaluate "
            f"(pipeline.eval_size={cfg.pipeline.eval_size}, --samples={samples}): give the task held-out problems "
            "(env.eval_size, env.eval_path) or raise pipeline.eval_size"
        )
    if episodes and not agentic:
        first_eval_rows(task, samples)
    pipe = dataclasses.replace(
        cfg.pipeline, name=name, eval_every=1, eval_size=samples or cfg.pipeline.eval_size, async_ratio=0
    )
    cfg = dataclasses.replace(cfg, pipeline=pipe)
    factory = registry.load("roll.collectors", name)
    factory.check(cfg, task)
    path = resolve_model_path(cfg.model.path)
    tokenizer, sampling = tokenizer_and_sampling(cfg, path)  # before an engine starts: a bad one is one line
    from roll_core.multimodal.processor import engine_pixels

    cluster = Cluster(type(cfg.cluster)(backend="local"), cfg.hw)
    ie = as_dict(cfg.infer_engine)
    infer = cluster.group(
        InferGroup,
        "actor_infer",
        1,
        engine=ie,
        runtime={
            "model_path": path,
            "dtype": ie.get("dtype") or cfg.model.dtype,
            "seed": cfg.pipeline.seed,
            "max_new_tokens": cfg.model.max_response_length,
            "platform": cluster.platform.name,
            "device": "auto",
            # as the training run's engines were built (roll_core.pipelines.wiring): a custom-code model, its
            # attention kernel
            "attn_implementation": cfg.model.attn_implementation,
            "trust_remote_code": cfg.model.trust_remote_code,
            # a vision-language run's picture size bounds, as its engines had them (only those set)
            **engine_pixels(cfg.model, path),
        },
    )
    try:
        collector = factory(CollectorContext(cfg, cluster, infer, sampling, tokenizer, task, path))
    except BaseException:
        cluster.shutdown()
        raise
    task_name = getattr(task, "name", type(task).__name__)
    try:
        restore_reward_model(collector, path)
        if episodes:
            if agentic and samples:
                collector.eval_seeds = collector.eval_seeds[:samples]  # type: ignore[attr-defined]
            m = collector.evaluate(0)
        else:
            rows, skipped, counters = sample_rows(collector, task, n)
    finally:
        collector.close()
        cluster.shutdown()
    if episodes:
        return episode_result(m, task_name, agentic)
    same = answer_equivalence(task)  # maj@n merges answers the task's grader equates (`1/\sqrt2`, `\sqrt2/2`)
    overall = summarize(rows, ks, same)
    return {
        "accuracy": overall["accuracy"],
        "reward": overall["reward"],
        "n": overall["problems"],
        "task": task_name,
        "samples_per_problem": n,
        "ks": list(ks),
        "temperature": eval_temperature(cfg),
        "metrics": overall,
        "by_domain": breakdown(rows, "domain", ks, same),
        "by_difficulty": breakdown(rows, "difficulty", ks, same),
        "skipped_problems": sum(skipped.values()),
        "skipped_by_reason": skipped,
        "reward_counters": counters,
        "rows": rows,
        # each problem's own scores, maj@n's with `same` too: what paired differences between models read
        "per_problem": problem_scores(rows, ks, same),
    }


def first_eval_rows(task: Any, samples: int | None) -> None:
    """Check that an agent-program task has held-out rows and cap them at `samples` (`--samples`; None: all).

    Its collector (pipeline=agent) runs one episode per row of `task.eval_rows()` every time it evaluates, so the
    cap has to be the task's own: the instance's `eval_rows` is replaced by one returning the first `samples` rows
    (an agentic task's seeds are cut on its collector instead). `--samples` was silently ignored here: every
    held-out row was evaluated.

    Raises:
        ConfigError: the task has no held-out rows (its collector would report a 0.0 rate over no episode).
    """
    rows = list(task.eval_rows())
    if not rows:
        raise ConfigError(
            f"env={getattr(task, 'name', type(task).__name__)} has no held-out rows to evaluate: give the task "
            "held-out rows (env.eval_size, env.eval_fraction)"
        )
    if samples is not None and samples < len(rows):
        kept = rows[:samples]
        task.eval_rows = lambda: list(kept)


def episode_result(m: dict[str, float], task_name: str, agentic: bool) -> dict[str, Any]:
    """roll-eval's result from an episode collector's `evaluate` metrics `m`: an agentic task's success rate, turns,
    invalid actions and end reasons, or an agent program's accuracy and reward. Both rates are the fraction of the
    `eval/n` episodes (one per held-out seed or row) that succeeded, so each comes with its standard error over
    those episodes (`<rate>_stderr`, roll_core.eval_metrics.rate_stderr; None for one episode).

    Episodes the inference engine refused (`eval/aborted_episodes`; an agentic task's end `abort`, in `ends`) have
    no outcome and are left out of `n` and the rates, with a warning naming their count (before, `n` shrank with no
    word of why). Episodes an environment failure ended (an agentic task's env_error / env_timeout, an agent
    program's failures: `failed_episodes`) are unsuccessful attempts in `n`, whatever `env.on_failure` says; those
    `drop` keeps out of training are `dropped_episodes` (the collector warned). When every episode in `n` failed so,
    a warning says the rate measures the environment's failures (an env_timeout may still be the model's: a program
    it ran hung).

    Raises:
        ConfigError: no episode had an outcome (`eval/n` 0): the collector logs no rate then (a 0.0 over nothing
            was reported as an accuracy of 0.0000 on 0 held-out problems). The engine's refusals, failed
            environment resets and first prompts over the context can cause it (`eval/reset_failed_episodes`,
            `eval/context_refused_episodes`: never attempted, out of `n`); the message names them. An environment
            failure after a turn is an unsuccessful attempt in `n`.
    """
    n = int(m["eval/n"])
    aborted = int(m.get("eval/aborted_episodes") or 0)
    failed = int(m.get("eval/failed_episodes") or 0)
    dropped = int(m.get("eval/dropped_episodes") or 0)
    if n < 1:  # environment failures are in n: refusals and failed resets (or no episode at all) leave it empty
        causes = (
            (aborted, "were refused by the inference engine"),
            (int(m.get("eval/reset_failed_episodes") or 0), "failed at their environment's reset"),
            (int(m.get("eval/context_refused_episodes") or 0), "had a first prompt over the context limit"),
        )
        why = "; ".join(f"{k} episode(s) {what}" for k, what in causes if k) or "no episode was run"
        raise ConfigError(
            f"env={task_name}: no held-out episode had an outcome ({why}, see the warnings above): there is no rate "
            "to report; check the environment (its log), give the engine room (infer_engine.max_model_len, its "
            "memory, env.max_context_length) and evaluate again"
        )
    if aborted:
        log.warning(
            "%d held-out episode(s) of %s were refused by the inference engine: left out of the rates, which are over "
            "the %d episodes with an outcome",
            aborted,
            task_name,
            n,
        )
    if failed and failed >= n:
        log.warning(
            "every one of the %d held-out episode(s) of %s ended in a failure of its environment or agent program "
            "(%s): the rate of 0 counts them as unsuccessful attempts; check the environment (its log, "
            "env.step_timeout_s) before reading it as the model's",
            n,
            task_name,
            _failure_kinds(m) or f"{failed} failed",
        )
    out: dict[str, Any] = {
        "accuracy": m["eval/accuracy"],
        "accuracy_stderr": rate_stderr(m["eval/accuracy"], n),
        "reward": m["eval/reward"],
        "n": n,
        "task": task_name,
    }
    out.update(aborted_episodes=aborted, failed_episodes=failed, dropped_episodes=dropped)
    if not agentic:  # an agent program: its collector's held-out accuracy and reward
        return out
    return {
        **out,
        "success_rate": m["eval/success_rate"],
        "success_rate_stderr": rate_stderr(m["eval/success_rate"], n),
        "mean_turns": m["eval/mean_turns"],
        "invalid_action_rate": m["eval/invalid_action_rate"],
        "tool_calls_mean": m["eval/tool_calls_mean"],
        # the envs' other tool counters (interfaces.agentic.INFO_COUNTERS), as training's eval logs them
        **{f"{c}_mean": m[f"eval/{c}_mean"] for c in INFO_COUNTERS if f"eval/{c}_mean" in m},
        "ends": {k.removeprefix("eval/end_"): v for k, v in m.items() if k.startswith("eval/end_")},
        "agentic": True,
    }


def _failure_kinds(m: dict[str, Any]) -> str:
    """How the held-out episodes in `n` of evaluate metrics `m` failed: an agent program's from its counts by kind
    (eval/failed_<kind>: `1 timeout, 2 no_reward`; the end reasons named no no_reward, which ends `terminated`), an
    agentic task's from its end shares (`3 env_timeout, 1 env_error`), whose failed resets (an env_error or
    env_timeout end too, out of `n`) are named apart: subtracted where one kind holds them all."""
    kinds = {
        k.removeprefix("eval/failed_"): int(v)
        for k, v in m.items()
        if k.startswith("eval/failed_") and k != "eval/failed_episodes" and v
    }
    if kinds:  # an agent program (no reset)
        return ", ".join(f"{v} {k}" for k, v in kinds.items())
    total = sum(
        int(m.get(k) or 0)
        for k in ("eval/n", "eval/aborted_episodes", "eval/reset_failed_episodes", "eval/context_refused_episodes")
    )
    ends = {k: round(m[f"eval/end_{k}"] * total) for k in ("env_timeout", "env_error") if m.get(f"eval/end_{k}")}
    resets = int(m.get("eval/reset_failed_episodes") or 0)
    if resets and len(ends) == 1:  # every failed reset ended so: what is left is the attempts'
        ends = {k: v - resets for k, v in ends.items()}
        return ", ".join(f"{v} {k}" for k, v in ends.items()) + f"; {resets} more failed at reset, not in n"
    named = ", ".join(f"{v} {k}" for k, v in ends.items())
    return f"{named}; {resets} of them at reset, not in n" if resets and named else named


def tokenizer_and_sampling(cfg: Any, path: str) -> tuple[Any, Any]:
    """The tokenizer (model.tokenizer, else the model's folder `path`) and the sampling parameters of `cfg`.

    Raises:
        ConfigError: the tokenizer cannot be loaded (model.tokenizer names no tokenizer), or a model.stop_tokens
            entry is not one of its tokens (a preset of another model family: model=qwen2_5 on a llama checkpoint).
            Both were tracebacks from transformers or the sampling setup after the engine had started. Or a
            model.chat_template_kwargs key that is a likely misspelling of a variable the chat template reads
            (roll_core.pipelines.template_kwargs; a key it merely does not read is a warning). Or
            infer_engine.structured on a chat template whose generation prompt leaves <think> open
            (roll_core.pipelines.structured_thinking).
    """
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as exc:  # transformers: a missing folder or repo id is an OSError
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        raise ConfigError(
            f"{key}={source}: no tokenizer could be loaded from it ({exc}): point {key} at a folder or hub id "
            "holding the model's tokenizer"
        ) from exc
    from roll_core.pipelines.template_kwargs import check_template_kwargs

    check_template_kwargs(tokenizer, cfg.model.chat_template_kwargs, model_path=path)  # a misspelt key was ignored
    from roll_core.pipelines.structured_thinking import refuse_structured_thinking

    refuse_structured_thinking(tokenizer, cfg, model_path=path)  # a constrained reasoning block never closes
    try:
        return tokenizer, sampling_params(cfg, tokenizer)
    except ValueError as exc:  # a stop token the tokenizer does not have
        raise ConfigError(f"{exc} (the model settings, e.g. model=<preset>, must be the evaluated model's)") from exc


def sample_rows(collector: Any, task: Any, n: int) -> tuple[list[dict[str, Any]], dict[str, int], dict[str, int]]:
    """(one record per response, the problems skipped per reason (SKIP_REASONS: each reason's count, 0 included),
    the reward's failure counters) of `n` responses to each of the prompts collector's held-out problems, sampled as
    its `evaluate` samples."""
    from roll_core.pipelines.collectors.prompts import resume_aborted
    from roll_core.pipelines.rollout import BadPictures, assemble, encode_prompt, picture_token_ids, problem_fields
    from roll_core.protocol import Batch
    from roll_core.seeds import Purpose, derive_seed

    cfg, tokenizer = collector.cfg, collector.tokenizer
    limit = cfg.model.max_prompt_length
    processor = getattr(collector, "processor", None)  # a vision-language model's (the prompts collector's)
    ids, mms, kept = [], [], []
    bad_pictures = 0
    for i, problem in enumerate(collector.eval_set):
        try:
            toks, length, mm = encode_prompt(tokenizer, task, problem, limit, cfg.model.chat_template_kwargs, processor)
        except BadPictures as exc:
            log.warning("problem %s skipped: its pictures: %s", problem.id, exc)
            bad_pictures += 1
            continue
        if toks is None:
            log.warning("problem %s skipped: %d prompt tokens > model.max_prompt_length=%d", problem.id, length, limit)
            continue
        ids.append(toks)
        mms.append(mm)
        kept.append((i, problem))
    too_long = len(collector.eval_set) - len(kept) - bad_pictures
    if not kept:
        raise ConfigError(f"every held-out prompt exceeds model.max_prompt_length={limit}: raise it")
    prompts = Batch(fields={"prompt_ids": ids, **problem_fields([p for _, p in kept], task)})
    prompts["eval_index"] = [i for i, _ in kept]
    if processor is not None:
        prompts["mm_inputs"] = mms
    params = collector.sampling.replace(
        temperature=collector.eval_temperature, seed=derive_seed(cfg.pipeline.seed, Purpose.EVAL)
    )
    gen = collector.infer.generate(prompts, params, n=n)
    # The training run's evaluation resumes the rows the engine aborted on its own; scored as they were, their cut
    # answers counted as the model's mistakes (module docstring).
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cut = frozenset(picture_token_ids(tokenizer)) if processor is not None else frozenset()
    most = cfg.pipeline.max_idle_aborts  # the engine's idle aborts of a row in a row before it is refused
    gen, refused, resumed = resume_aborted(
        collector.infer, prompts, gen, params, n, pad, cut, max_idle_aborts=most, tokenizer=tokenizer
    )
    if resumed:
        log.info("%d response(s) the engine aborted were resumed from their partial output", resumed)
    repeated = prompts.repeat_interleave(n)  # a problem's n responses are contiguous, in sample order
    repeated["eval_sample"] = [j for _ in kept for j in range(n)]
    refused_rows = set(refused)
    repeated["eval_refused"] = [i in refused_rows for i in range(len(repeated))]
    try:
        batch = assemble(tokenizer, repeated, gen)  # drops (and logs) rows whose prompt fills the engine's context
    except ValueError as exc:  # every prompt did: one line from the CLI (its message names the keys to change)
        raise ConfigError(f"nothing to evaluate: {exc}") from exc
    # Problems whose prompt fills the engine's context lost every row in `assemble`: skipped, as the long ones.
    lost = len(kept) - len(set(batch["eval_index"]))
    skipped = {"prompt_length": too_long, "engine_context": lost, "bad_pictures": bad_pictures}
    scored = collector.scoring.score(batch)
    unscored = scored["reward_failed"].tolist() if "reward_failed" in scored else [False] * len(batch)
    extract = answer_extractor(task)
    read = None if extract is None else answer_reader(extract)
    if extract is None:
        log.warning("%s names no extract_answer (task or reward): maj@n is not reported", type(task).__name__)
    lengths = batch["response_mask"].sum(-1).tolist()
    reasons = batch["finish_reason"] if "finish_reason" in batch else ["stop"] * len(batch)
    extract_errors = 0
    rows: list[dict[str, Any]] = []
    for r, text in enumerate(scored["response_text"]):
        meta = batch["metadata"][r]
        # never graded: counted as wrong and in the metrics' `failed`
        failed = failure(batch["eval_refused"][r], unscored[r])
        row = {
            "index": batch["eval_index"][r],
            "problem": batch["problem_id"][r],
            "domain": meta.get("domain"),
            "difficulty": difficulty_of(meta),
            "sample": batch["eval_sample"][r],
            "response": text,
            "answer": batch["answer"][r],
            "reward": float(scored["scores"][r]),
            # a refused row's cut response is no answer: its grade (a \boxed{} written before the cut) is not one,
            # nor is the grade beside a score the reward failed to give (NaN)
            "correct": 0.0 if failed else float(scored["correct"][r]),
            "formatted": float(scored["formatted"][r]),
            "length": int(lengths[r]),
            "finish_reason": reasons[r],
            "failed": failed,
        }
        # a `correct` that is no grade (0.5, NaN): a failed row, as a training run's evaluation counts it
        row = dict(graded_row(row))
        if extract is not None and row["failed"] == "engine":
            row["extracted"] = None  # what a refused row holds is no finished answer: it does not vote
        elif read is not None:
            try:
                row["extracted"] = read(text, meta)
            except Exception as exc:  # a response the extractor chokes on has no answer; counted, never fatal
                extract_errors += 1
                row["extracted"] = None
                log.debug("extract_answer failed on a response: %s", exc)
        rows.append(row)
    counters = {k: int(v) for k, v in scored.meta.get("reward_counters", {}).items()}
    if extract_errors:
        counters["extract_errors"] = extract_errors
        log.warning("extract_answer raised on %d response(s): they count as no answer in maj@n", extract_errors)
    return rows, skipped, counters
