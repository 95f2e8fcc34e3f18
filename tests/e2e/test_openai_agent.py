"""`pipeline=agent`: an agent program written against the `openai` package (openai_agent_toy) runs unmodified
against roll's OpenAI-compatible endpoint and learns on the tiny model; every turn the trainer trained on is exactly
what the engine sampled in exactly the context the engine saw (tokens and behaviour log-probs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.testing import reward_curve

sys.path.insert(0, str(Path(__file__).parent))  # openai_agent_toy: env.program=openai_agent_toy:run


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "model=tiny",
        "pipeline=agent",
        "env=openai_agent",
        "env.program=openai_agent_toy:run",
        "env.generator=openai_agent_toy:tasks",
        "env.max_turns=4",
        "env.max_tokens_per_turn=6",
        "env.max_context_length=256",
        "env.eval_size=8",
        "env.episode_timeout_s=60",
        "algo=grpo",
        "algo.group_size=8",
        "algo.lr=1e-2",
        "pipeline.rollout_batch_size=4",
        "pipeline.max_steps=12",
        "pipeline.eval_every=12",
        "pipeline.progress=false",
        f"pipeline.output_dir={tmp_path}",
        "train_engine.micro_batch_size=16",
        *extra,
    ]


def _run(overrides: list[str]) -> tuple[list[dict[str, Any]], list[list[Any]], list[dict[str, torch.Tensor]]]:
    """Run in this process, recording each step's engine requests (with their outputs) and trained batch."""
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config
    from roll_core.tracking import Tracker

    cfg = load_config(overrides)
    pipeline = pipeline_class(cfg.pipeline.name)(cfg)
    requests: list[tuple[Any, Any]] = []
    steps: list[list[tuple[Any, Any]]] = []
    batches: list[dict[str, torch.Tensor]] = []
    infer, trainer = pipeline.roles.actor_infer, pipeline.trainer
    submit, update = infer.submit_request, trainer.update

    def recorded_submit(request: Any, route_key: str | None = None) -> Any:
        handle = submit(request, route_key=route_key)
        requests.append((request, handle))
        return handle

    def recorded_update(step: int, collected: Any, out: Any) -> None:
        batch = collected.batch
        keys = ("prompts", "attention_mask", "responses", "response_mask", "behaviour_logprobs", "turn_ids")
        batches.append({k: batch[k].clone() for k in keys})
        steps.append(list(requests))  # this step's engine requests (the weights changed since the last step)
        requests.clear()
        update(step, collected, out)

    infer.submit_request, trainer.update = recorded_submit, recorded_update
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    return Tracker.read_metrics(Path(pipeline.out) / "metrics.jsonl"), steps, batches


def test_an_openai_agent_program_learns_and_trains_on_exactly_the_sampled_turns(tmp_path: Path) -> None:
    history, requests, batches = _run(_overrides(tmp_path))
    steps = [h for h in history if h["step"] > 0 and "reward/mean" in h]
    evals = [h for h in history if "eval/accuracy" in h]
    r = reward_curve(history)
    assert len(r) == 12 and sum(r[-4:]) / 4 > sum(r[:4]) / 4 + 0.2, r
    assert all(h["episode/turns_mean"] >= 2 for h in steps)  # both judged turns ran (tool calls add turns)
    assert all(h["agent/failed_episodes"] == 0 and h["agent/history_rewrites"] == 0 for h in steps), steps[0]
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) < 1e-4
    assert steps[-1]["episode/success_rate"] > steps[0]["episode/success_rate"]
    # held-out rows before and after training (greedy): every episode ran, and the trained agent does better
    assert [h["step"] for h in evals] == [0, 12] and all(h["eval/n"] == 8 for h in evals)
    assert evals[0]["eval/failed_episodes"] == evals[1]["eval/failed_episodes"] == 0
    assert evals[1]["eval/reward"] > evals[0]["eval/reward"], evals

    # Every trained turn, read back from the batches the trainer got, is one engine request's output: the
    # engine's context was the row's prompt and everything before the turn, its tokens and log-probs are the
    # trained ones, and nothing else carries loss mask 1.
    assert len(batches) == len(requests) == 12
    turns = 0
    for batch, step_requests in zip(batches, requests):
        # (context, tokens) -> the log-probs the engine reported for them this step (the episodes of a group share
        # their first context and may sample the same tokens)
        sampled: dict[tuple[Any, Any], list[torch.Tensor]] = {}
        for req, handle in step_requests:
            out = handle.result()
            sampled.setdefault((tuple(req.prompt_ids), tuple(out.token_ids)), []).append(torch.tensor(out.logprobs))
        p = batch["prompts"].shape[1]
        for i in range(batch["responses"].shape[0]):
            prompt = batch["prompts"][i][batch["attention_mask"][i, :p].bool()].tolist()
            ids, mask, tids = batch["responses"][i], batch["response_mask"][i], batch["turn_ids"][i]
            for k in range(int(tids.max()) + 1):
                where = (tids == k).nonzero()[:, 0]
                start, n = int(where[0]), len(where)
                assert where.tolist() == list(range(start, start + n)) and mask[where].eq(1).all()
                key = (tuple(prompt + ids[:start].tolist()), tuple(ids[start : start + n].tolist()))
                assert key in sampled, f"row {i} turn {k}: not an engine output in its context"
                assert any(torch.equal(batch["behaviour_logprobs"][i, where], lp) for lp in sampled[key])
                turns += 1
            assert int(mask.sum()) == int((tids >= 0).sum())
    assert turns >= 2 * sum(len(b["responses"]) for b in batches) == 2 * 12 * 32


class _Scripted:
    """The request API answering "ok" (6 tokens of it, then EOS); a prompt ending in "hang" waits for an abort."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.hung = tokenizer, {}

    def submit_request(self, request: Any, route_key: str | None = None) -> Any:
        from concurrent.futures import Future

        from roll_core.interfaces import RequestOutput

        fut: Future = Future()
        if self.tokenizer.decode(request.prompt_ids).endswith("hang\n<|assistant|>"):
            self.hung[request.request_id] = (request, fut)
            return fut
        ids = self.tokenizer("ok", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        from roll_core.interfaces import RequestOutput

        if request_id not in self.hung:
            return False
        request, fut = self.hung.pop(request_id)
        fut.set_result(RequestOutput(request_id, request.prompt_ids, [], [], "abort"))
        return True


def _collector(task: Any, group_size: int, batch: int) -> Any:
    from types import SimpleNamespace

    from roll_core.interfaces import SamplingParams
    from roll_core.models import build_tiny_tokenizer
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.agents import agent_collectors

    tok = build_tiny_tokenizer()
    from roll_core.idle_aborts import MAX_IDLE_ABORTS

    pipe = SimpleNamespace(
        seed=0,
        rollout_batch_size=batch,
        async_ratio=0,
        eval_temperature=0.0,
        async_abort_timeout_s=60.0,
        max_idle_aborts=MAX_IDLE_ABORTS,
    )
    model = SimpleNamespace(chat_template_kwargs={})
    cfg = SimpleNamespace(pipeline=pipe, algo=SimpleNamespace(group_size=group_size), model=model)
    ctx = CollectorContext(cfg, None, _Scripted(tok), SamplingParams(max_new_tokens=8), tok, task, "tiny")
    agent_collectors.check(cfg, task)
    return agent_collectors(ctx)


def test_failing_agents_are_counted_and_scored_or_dropped_never_the_run() -> None:
    from roll_core.pipelines.metrics import StepLog
    from roll_envs.agentic.openai_agent import OpenAIAgentTask

    for policy in ("score", "drop"):
        task = OpenAIAgentTask(
            program="openai_agent_toy:flaky",
            generator="openai_agent_toy:tasks",
            generator_kwargs={"n": 4},
            eval_fraction=0.0,
            # The hanging agent waits this out; the others must finish within it on a loaded 2-core CI machine
            # (1 s timed out the two-turn agent once under load).
            episode_timeout_s=3.0,
            on_failure=policy,
            failure_reward=-1.0,
        )
        collector = _collector(task, group_size=1, batch=4)
        try:
            out = StepLog()
            collected = collector.next(1, out)
            # the timed-out episode's session is closed and its turn in flight aborted (nothing left running)
            assert not collector.sessions.sessions() and not collector.ctx.infer.hung
        finally:
            collector.close()
        assert {k: out[f"agent/failed_{k}"] for k in ("error", "timeout", "no_reward")} == {
            "error": 1.0,
            "timeout": 1.0,
            "no_reward": 1.0,
        }
        assert (
            out["agent/failed_episodes"] == 3 and out["agent/history_rewrites"] == 1 and out["agent/dropped_turns"] == 1
        )
        # the metrics describe what is trained: "drop" leaves the 3 failed episodes out of them, as of the batch
        want = ((-1.0 * 3 + 1.0) / 4, 0.25) if policy == "score" else (1.0, 1.0)
        assert (out["reward/mean"], out["episode/success_rate"]) == want, policy
        rewards = sorted(collected.scores.tolist())
        # The raising and the timed-out agents sampled no turn: nothing to train on either way; "score" trains the
        # episode without a reward with the failure reward, "drop" drops it.
        assert rewards == ([-1.0, 1.0] if policy == "score" else [1.0]), rewards
        assert out["data/dropped_episodes"] == (2 if policy == "score" else 3)


def test_a_command_line_agent_runs_as_a_subprocess() -> None:
    from openai_agent_toy import COMMAND

    from roll_core.pipelines.metrics import StepLog
    from roll_envs.agentic.openai_agent import OpenAIAgentTask

    task = OpenAIAgentTask(
        command=[sys.executable, "-c", COMMAND], generator="openai_agent_toy:tasks", generator_kwargs={"n": 8}
    )
    collector = _collector(task, group_size=2, batch=1)
    try:
        out = StepLog()
        collected = collector.next(1, out)
    finally:
        collector.close()
    assert out["agent/failed_episodes"] == 0 and collected.scores.tolist() == [0.25, 0.25]
    assert collected.batch["group_ids"].tolist() == [0, 0] and out["episode/turns_mean"] == 1.0


def test_closing_the_collector_closes_the_programs_http_client() -> None:
    """The HTTP client the task's programs share (one per task, reused by every episode) is closed with the
    collector: it never was, and its keep-alive connections to the endpoint stayed open after the run."""
    from roll_core.pipelines.metrics import StepLog
    from roll_envs.agentic.openai_agent import OpenAIAgentTask

    task = OpenAIAgentTask(
        program="openai_agent_toy:run", generator="openai_agent_toy:tasks", generator_kwargs={"n": 4}, eval_fraction=0
    )
    collector = _collector(task, group_size=2, batch=1)
    try:
        out = StepLog()
        collector.next(1, out)
        http = task._http
        assert out["agent/failed_episodes"] == 0 and http is not None and not http.is_closed
    finally:
        collector.close()
    assert http.is_closed


def test_a_command_gets_a_row_too_large_for_the_environment_on_stdin() -> None:
    """A 200 kB row (a long problem statement) reaches the command on stdin, ROLL_TASK empty: Linux refuses an
    environment string over 128 KiB, and every episode of such a row failed with E2BIG. A small row is in both."""
    import json

    from roll_envs.agentic.openai_agent import OpenAIAgentTask

    script = "import json, os, sys; row = json.load(sys.stdin); print(len(row['text']) + len(os.environ['ROLL_TASK']))"
    task = OpenAIAgentTask(
        command=[sys.executable, "-c", script], generator="openai_agent_toy:tasks", generator_kwargs={"n": 8}
    )
    urls = ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/reward")
    assert task._run_command(*urls, {"text": "x" * 200_000}) == 200_000.0
    assert task._run_command(*urls, {"text": "abc"}) == 3.0 + len(json.dumps({"text": "abc"}))


# A launcher (as a shell wrapper or `uv run agent.py` is): the agent ($0, a Python) is its child; it writes the
# agent's pid to $1 and waits for it. A shell, not a Python launcher: it writes the pid within milliseconds, where a
# Python's start on a loaded machine outlasted the 1 s and 1.5 s episode timeouts below (no agent, nothing tested).
LAUNCHER = '"$0" -c "import time; time.sleep(60); print(1.0)" & echo $! > "$1"; wait $!'


def _alive(pid: int) -> bool:
    """A process that runs (a zombie left for a PID 1 that does not reap is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _agent_pid(path: Path, timeout: float = 60.0) -> int:
    import time

    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, timeout: float = 30.0) -> bool:  # (left behind, the agent sleeps 60 s)
    import time

    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _kill(pid: int) -> None:
    import os
    import signal

    if _alive(pid):  # a failed test leaves no process behind
        os.kill(pid, signal.SIGKILL)


def test_a_timed_out_command_leaves_no_process_behind(tmp_path: Path) -> None:
    """At the command's episode timeout its whole process group is killed: killing the direct child only left the
    launcher's agent running after the episode (and after the run). The collector's own timeout does the same
    (`cancel_episode`), as the episode thread may still wait on the command."""
    from roll_core.pipelines.collectors.agents import EpisodeTimeout
    from roll_envs.agentic.openai_agent import OpenAIAgentTask

    urls = ("http://127.0.0.1:9/sessions/x/v1", "http://127.0.0.1:9/sessions/x/reward")
    pid_file = tmp_path / "own.pid"
    task = OpenAIAgentTask(
        command=["/bin/sh", "-c", LAUNCHER, sys.executable, str(pid_file)],
        generator="openai_agent_toy:tasks",
        episode_timeout_s=1.5,
    )
    try:
        with pytest.raises(TimeoutError) as exc:  # EpisodeTimeout is one
            task.run_episode(*urls, {"id": 0})
        pid = _agent_pid(pid_file)
        assert _gone(pid), "the agent outlived its episode"
    finally:
        _kill(_agent_pid(pid_file))
    assert isinstance(exc.value, EpisodeTimeout)

    # The collector's episode timeout fires while the command's own is far off (a task seen with a shorter one).
    from roll_core.pipelines.metrics import StepLog

    pid_file = tmp_path / "collector.pid"
    task.command[-1], task.episode_timeout_s = str(pid_file), 60.0
    collector = _collector(_ShortTimeout(task, 1.0), group_size=1, batch=1)
    try:
        out = StepLog()
        collector.next(1, out)
        assert out["agent/failed_timeout"] == 1.0
        assert _gone(_agent_pid(pid_file)), "the agent outlived the collector's episode timeout"
    finally:
        collector.close()
        _kill(_agent_pid(pid_file))


class _ShortTimeout:
    """A task whose episode timeout, as the collector reads it, is `timeout_s` (its command's own stays longer)."""

    def __init__(self, task: Any, timeout_s: float) -> None:
        self._task, self.episode_timeout_s = task, timeout_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def test_a_command_whose_output_is_not_utf8_still_reports_its_reward() -> None:
    """A program that logs a tool's binary output (bytes that are not UTF-8) and prints its reward: the episode
    failed with UnicodeDecodeError after exit 0. Such bytes are replaced, in stdout, stderr and error messages."""
    from roll_envs.agentic.openai_agent import OpenAIAgentTask

    write = "import sys; sys.stderr.buffer.write(b'tool: \\xff\\xfe binary\\n'); sys.stdout.buffer.write(b'\\xff\\n');"
    urls = ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/reward")
    task = OpenAIAgentTask(
        command=[sys.executable, "-c", write + " print(1.0)"], generator="openai_agent_toy:tasks", episode_timeout_s=20
    )
    assert task.run_episode(*urls, {"id": 0}) == 1.0
    task.command[-1] = write + " sys.exit(3)"
    with pytest.raises(RuntimeError, match="exited 3: tool: \ufffd\ufffd binary"):
        task.run_episode(*urls, {"id": 0})
