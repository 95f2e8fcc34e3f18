"""Any program that speaks the OpenAI chat API as an agentic task (`pipeline=agent env=openai_agent`).

The program is either
- a function, `env.program=my_pkg.agent:run`, called per episode as `run(client: openai.OpenAI, task: dict)` with
  a client whose base URL is the episode's session on roll's endpoint (roll_core.agentic.openai_server); it returns
  the episode's reward (a number), or None after reporting it with `report_reward(client, value)`; or
- a command line, `env.command=[python,agent.py]`, run per episode as a subprocess with OPENAI_BASE_URL,
  OPENAI_API_KEY, ROLL_REWARD_URL and ROLL_TASK (the row as JSON, also on its stdin; a row over 64 KiB is on stdin
  only, ROLL_TASK then empty: Linux refuses an environment string over 128 KiB) in its environment; it
  reports its reward by printing a number as its last line of output or by POSTing {"reward": x} to
  ROLL_REWARD_URL. A non-zero exit status is a failed episode (its stderr's tail is logged). Its output is read
  as UTF-8, bytes that are not replaced (a tool's binary output in a log fails nothing). The command runs in a
  process group of its own: at the episode timeout the whole group is killed (a launcher such as `uv run` or a
  shell wrapper leaves the real agent running otherwise), whether the command's own timeout fires or the
  collector's (`cancel_episode`).

The endpoint is local (127.0.0.1), so it is reached without the environment's HTTP proxy: `report_reward` and the
program's client ignore HTTP(S)_PROXY, and a command gets 127.0.0.1 and localhost added to NO_PROXY / no_proxy (a
cluster's HTTP_PROXY without them sent every request of every episode to the proxy, which cannot reach this host's
loopback: each episode failed with a connection error).

Task rows (each a JSON object handed to the program as it is) come from a data file (`env.path`: JSONL/JSON lines,
Parquet, a datasets folder) or a generator (`env.generator=module:function`, called with `env.generator_kwargs`,
returning a list of dicts); a datasets folder's split is chosen as env=file chooses it (`env.split`, `env.eval_split`:
roll_envs.tasks._datasets_folder). The held-out rows are `env.eval_path`'s, else a stable-hash fraction of the rows
(`env.eval_fraction`, at most `env.eval_size`); a training row that is a held-out row but for whitespace in its
strings is left out of training, counted (`also_held_out`) and logged, as env=file does (`split_rows`). Limits:
turns, tokens per turn, context, and the episode's wall time (`episode_timeout_s`); what happens on history rewrites
and failed episodes is the collector's (roll_core.pipelines.collectors.agents).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError, Extra

log = logging.getLogger(__name__)

OPENAI = Extra(
    "openai", "env.program=<module:function> (the program gets an openai.OpenAI client)", "openai", "roll-envs[agents]"
)


@dataclass
class OpenAIAgentEnvConfig:
    """An agent program against roll's OpenAI-compatible endpoint (pipeline=agent)."""

    _target_: str = "roll_envs.agentic.openai_agent.OpenAIAgentTask"
    name: str = "openai_agent"
    # The program as module:function, called fn(client: openai.OpenAI, task: dict) -> float | None.
    program: str | None = None
    # Or a command line run per episode (OPENAI_BASE_URL, OPENAI_API_KEY, ROLL_REWARD_URL, ROLL_TASK set).
    command: list[str] | None = None
    # Task rows: a data file (JSONL / Parquet / datasets folder) ...
    path: str | None = None
    # ... or module:function returning a list of dicts (called with generator_kwargs).
    generator: str | None = None
    generator_kwargs: dict[str, Any] = field(default_factory=dict)
    # Held-out rows; null: a stable-hash fraction of the rows.
    eval_path: str | None = None
    # Split of a datasets folder `path` to train on; null: its only split, or `train` (several splits and none
    # `train`: an error naming them).
    split: str | None = None
    # Split of a datasets folder `eval_path` to hold out; null: its only split, or the one beside `train`.
    eval_split: str | None = None
    eval_fraction: float = 0.2
    eval_size: int = 32
    # Assistant turns (requests) per episode at most.
    max_turns: int = 8
    # Tokens one assistant turn may generate (a request's max_tokens may only lower it).
    max_tokens_per_turn: int = 128
    # Tokens of a whole trajectory at most.
    max_context_length: int = 2048
    # Wall seconds an episode may take; then its session closes and it counts as failed (timeout).
    episode_timeout_s: float = 120.0
    # Tool-call syntax of the model family: hermes (Qwen, Hermes) | none | module:Class.
    tool_parser: str = "hermes"
    # A request that rewrites earlier messages: restart (the trajectory starts again from it) | refuse (HTTP 400).
    on_rewrite: str = "restart"
    # A failed episode (raised, timed out, no reward): score (trained with failure_reward) | drop.
    on_failure: str = "score"
    failure_reward: float = 0.0
    # An episode whose reward is at least this counts as a success (episode/success_rate, eval/accuracy).
    success_reward: float = 1.0
    # The API key the program is given (the endpoint listens on 127.0.0.1 only and checks none).
    api_key: str = "roll"
    # The model name the endpoint reports (any name is accepted in requests).
    model_name: str = "roll"
    # Keyword arguments of every chat-template rendering (e.g. {enable_thinking: false} for Qwen3).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Neither given is refused when the task is built (a preset leaves both to the command line).
        if self.program is not None and self.command is not None:
            raise ValueError("give the agent as env.program=module:function or env.command=[...], not both")
        if self.path is not None and self.generator is not None:
            raise ValueError("give the task rows as env.path=<file> or env.generator=module:function, not both")
        if min(self.max_turns, self.max_tokens_per_turn, self.max_context_length) < 1:
            raise ValueError("env.max_turns, max_tokens_per_turn and max_context_length must be >= 1")
        if self.max_tokens_per_turn >= self.max_context_length:
            raise ValueError("env.max_tokens_per_turn must be below env.max_context_length")
        if self.episode_timeout_s <= 0:
            raise ValueError("env.episode_timeout_s must be > 0")
        if self.on_rewrite not in ("restart", "refuse"):
            raise ValueError(f"env.on_rewrite={self.on_rewrite!r} must be restart or refuse")
        if self.on_failure not in ("score", "drop"):
            raise ValueError(f"env.on_failure={self.on_failure!r} must be score or drop")
        if self.eval_size < 0 or not 0 <= self.eval_fraction < 1:
            raise ValueError("env.eval_size must be >= 0 and env.eval_fraction in [0, 1)")
        from roll_envs.config import _check_split_keys

        _check_split_keys(self)

    def check_installed(self) -> None:
        from roll_core.agentic.openai_server import AIOHTTP

        AIOHTTP.require()
        if self.program is not None:
            OPENAI.require()


def report_reward(client: Any, reward: float) -> None:
    """POST the episode's reward to its session (for programs that do not return it)."""
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/reward"
    request = urllib.request.Request(
        url, data=json.dumps({"reward": reward}).encode(), headers={"Content-Type": "application/json"}
    )
    # No proxy: the endpoint is on this host's loopback (module docstring).
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30):
        pass


#: Hosts a command's NO_PROXY / no_proxy gets (the endpoint's address, and the name some clients resolve it to).
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def no_proxy_env(env: dict[str, str]) -> dict[str, str]:
    """NO_PROXY and no_proxy of `env` with `LOCAL_HOSTS` added (each kept as set, the hosts appended once)."""
    out = {}
    for key in ("NO_PROXY", "no_proxy"):
        hosts = [h.strip() for h in env.get(key, "").split(",") if h.strip()]
        out[key] = ",".join([*hosts, *(h for h in LOCAL_HOSTS if h not in hosts)])
    return out


def _load(ref: str, key: str) -> Any:
    import importlib

    module, _, name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}={ref!r}: cannot load {module}.{name} ({exc})") from exc


class OpenAIAgentTask:
    """Task rows, the agent program, and episode limits of `pipeline=agent` (see the module docstring)."""

    is_agent_program = True

    def __init__(
        self,
        name: str = "openai_agent",
        program: str | None = None,
        command: list[str] | None = None,
        path: str | None = None,
        generator: str | None = None,
        generator_kwargs: dict[str, Any] | None = None,
        eval_path: str | None = None,
        eval_fraction: float = 0.2,
        eval_size: int = 32,
        max_turns: int = 8,
        max_tokens_per_turn: int = 128,
        max_context_length: int = 2048,
        episode_timeout_s: float = 120.0,
        tool_parser: str = "hermes",
        on_rewrite: str = "restart",
        on_failure: str = "score",
        failure_reward: float = 0.0,
        success_reward: float = 1.0,
        api_key: str = "roll",
        model_name: str = "roll",
        chat_template_kwargs: dict[str, Any] | None = None,
        split: str | None = None,
        eval_split: str | None = None,
    ) -> None:
        if not program and not command:
            raise ConfigError("pipeline=agent needs the agent: env.program=module:function or env.command=[...]")
        if program and ":" not in program:
            raise ConfigError(f"env.program={program!r}: write module:function")
        if not path and not generator:
            raise ConfigError("env=openai_agent needs task rows: env.path=<file> or env.generator=module:function")
        self.name = name
        self.program = _load(program, "env.program") if program else None
        self._http: Any = None
        self._lock = threading.Lock()
        self._running: dict[str, subprocess.Popen] = {}  # base_url -> the command running that episode
        if self.program is not None:
            OPENAI.require()
            import openai  # noqa: F401  # imported once here, not by the first step's episode threads at once
        self.command = list(command or [])
        self.max_turns, self.max_tokens_per_turn, self.max_context_length = (
            max_turns,
            max_tokens_per_turn,
            max_context_length,
        )
        self.episode_timeout_s, self.tool_parser, self.on_rewrite = episode_timeout_s, tool_parser, on_rewrite
        self.on_failure, self.failure_reward, self.success_reward = on_failure, failure_reward, success_reward
        self.api_key, self.model_name = api_key, model_name
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if generator:
            rows = _load(generator, "env.generator")(**(generator_kwargs or {}))
            source = f"env.generator={generator}"
        else:
            rows, source = _file_rows(str(path), "env.path", split, "env.split"), f"env.path={path}"
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{source} must give a non-empty list of task rows (JSON objects)")
        if (split is not None and not path) or (eval_split is not None and not eval_path):
            raise ConfigError("env.split / env.eval_split name splits of env.path / env.eval_path, which are not set")
        held = _file_rows(eval_path, "env.eval_path", eval_split, "env.eval_split", held=True) if eval_path else None
        counts: dict[str, int] = {}
        self._train, self._eval = split_rows(
            rows,
            held,
            eval_fraction=eval_fraction,
            eval_size=eval_size,
            source=source,
            path=path,
            eval_path=eval_path,
            counts=counts,
        )
        # Training rows left out as a held-out row but for whitespace, and held-out rows past eval_size, neither
        # trained nor evaluated (split_rows): the run's data counts (roll_core.interfaces.tasks.DataCounts).
        self.also_held_out = counts.get("also_held_out", 0)
        self.unused_held_out = counts.get("unused_held_out", 0)

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        """`count` training rows drawn with `seed` (distinct while the split has that many)."""
        rng = random.Random(seed)
        if count <= len(self._train):
            return rng.sample(self._train, count)
        return [rng.choice(self._train) for _ in range(count)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return list(self._eval)

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        """Run the program once on `row` against the session at `base_url` (see the module docstring)."""
        if self.program is not None:
            import openai

            client = openai.OpenAI(
                base_url=base_url,
                api_key=self.api_key,
                max_retries=0,
                timeout=self.episode_timeout_s,
                http_client=self._http_client(),
            )
            return self.program(client, row)  # not closed: the HTTP connection pool is shared
        return self._run_command(base_url, reward_url, row)

    def _http_client(self) -> Any:
        """One HTTP client (connection pool, TLS setup) for every episode's openai client: making one per episode
        costs more than the tiny model's turns."""
        with self._lock:
            if self._http is None:
                import openai

                # trust_env=False: no HTTP(S)_PROXY for the local endpoint (module docstring).
                self._http = openai.DefaultHttpxClient(trust_env=False)
            return self._http

    def close(self) -> None:
        """Close the programs' HTTP client (its keep-alive connections stayed open after the run, until garbage
        collection); a later episode opens a new one. Called by the collector when it closes."""
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()

    def _run_command(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        text = json.dumps(row)
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": self.api_key,
            "ROLL_REWARD_URL": reward_url,
            # Linux caps one environment string at 128 KiB (E2BIG failed every episode of a large row): stdin only
            "ROLL_TASK": text if len(text.encode()) <= MAX_ENV_TASK_BYTES else "",
            **no_proxy_env(dict(os.environ)),  # the endpoint past the cluster's HTTP proxy (module docstring)
        }
        # A session of its own (a new process group): killing only the direct child left a launcher's agent running
        # after its episode, and after the run. Output as UTF-8 with replacement: a stray byte failed the episode.
        proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
        with self._lock:
            self._running[base_url] = proc
        try:
            stdout, stderr = proc.communicate(text, timeout=self.episode_timeout_s)
        except subprocess.TimeoutExpired as exc:
            _kill_group(proc)
            from roll_core.pipelines.collectors.agents import EpisodeTimeout

            raise EpisodeTimeout(f"{self.command[0]} outlived env.episode_timeout_s={self.episode_timeout_s}") from exc
        except BaseException:  # interrupted: nothing the episode started outlives it (as subprocess.run kills)
            _kill_group(proc)
            raise
        finally:
            with self._lock:
                self._running.pop(base_url, None)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(self.command)} exited {proc.returncode}: {stderr[-500:]}")
        lines = [line.strip() for line in stdout.splitlines() if line.strip()]
        try:
            return float(lines[-1]) if lines else None
        except ValueError:
            return None  # no number printed: the reward was POSTed, or there is none (counted by the collector)

    def cancel_episode(self, base_url: str) -> None:
        """Kill the process group of the command running the episode at `base_url` (the collector's episode timeout
        fired); nothing for a program= episode or one that already ended."""
        with self._lock:
            proc = self._running.get(base_url)
        if proc is not None:
            _kill_group(proc, reap=False)  # the episode's thread reaps it (its communicate returns)


def _kill_group(proc: subprocess.Popen, reap: bool = True) -> None:
    """SIGKILL the process group `proc` leads (it was started with start_new_session), then (`reap`) collect it.
    Only the episode's own thread reaps `proc`: until then its pid, the group id, cannot name another process."""
    if proc.returncode is None:  # not reaped (poll() is not called here: it would reap it)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass
    if not reap:
        return
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a process that left the group holds the pipes: stop reading them
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


#: The largest row (as JSON) also passed in ROLL_TASK; larger ones reach the command on its stdin only.
MAX_ENV_TASK_BYTES = 64 * 1024


def row_key(row: dict[str, Any]) -> str:
    """A task row's text for the held-out hash: its JSON with sorted keys (unchanged, so a resumed run keeps its
    split)."""
    return json.dumps(row, sort_keys=True, default=str)


def _collapsed(value: Any) -> Any:
    """`value` with the whitespace of every string in it collapsed (runs to one space, none at the ends)."""
    if isinstance(value, str):
        return " ".join(value.split())
    if isinstance(value, Mapping):  # (a config's rows are DictConfig / ListConfig)
        return {k: _collapsed(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [_collapsed(v) for v in value]
    return value


@dataclass(frozen=True)
class _Row:
    """A task row as roll_envs.tasks.base.held_out_split reads a problem: `prompt` is the row's JSON with its
    strings' whitespace collapsed, so `loose_key` finds whitespace twins. (`row_key`'s JSON would not do: it
    escapes a newline as the two characters `\\n`, which no whitespace collapsing removes.)"""

    prompt: str
    row: dict[str, Any] = field(compare=False)

    @classmethod
    def of(cls, row: dict[str, Any]) -> _Row:
        return cls(json.dumps(_collapsed(row), sort_keys=True, default=str), row)


def split_rows(
    rows: list[dict[str, Any]],
    held: list[dict[str, Any]] | None,
    *,
    eval_fraction: float,
    eval_size: int,
    source: str,
    path: str | None = None,
    eval_path: str | None = None,
    counts: dict[str, int] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, held-out) task rows by env=file's rule (roll_envs.tasks.base.held_out_split): with `held` (the
    rows of `eval_path`) every row trains but those also held out; without, rows whose stable hash (`row_key`)
    falls below `eval_fraction` are held out. Either way a training row that is a held-out row but for whitespace
    in its strings ({"task": "Q?\\n"} and {"task": "Q?"}: one task to the agent) is left out of training, logged
    once and counted in `counts["also_held_out"]`, so the two sets never share a task; the hash itself is
    unchanged (a resumed run keeps its split). `path` and `eval_path` naming one file is an evaluation set: every
    row is both. The held-out list is cut to `eval_size`; the hash split's rows beyond it are neither trained nor
    evaluated, logged and counted in `counts["unused_held_out"]` (0 with `held`, as held_out_split counts). A
    ConfigError (naming `path`, else `source`) when nothing is left to train on."""
    from roll_envs.tasks.base import held_out_split

    # One rule with env=file's: only the hash text differs, a row's JSON (`row_key`, unchanged: a resumed run keeps
    # its split), where its loose key (whitespace twins) is `_Row.prompt` (newlines escaped in `row_key` would
    # hide the twins).
    train, kept = held_out_split(
        [_Row.of(r) for r in rows],
        None if held is None else [_Row.of(r) for r in held],
        eval_fraction=eval_fraction,
        eval_size=eval_size,
        path=path or source,
        eval_path=eval_path,
        counts=counts,
        key=lambda w: row_key(w.row),
    )
    return [w.row for w in train], [w.row for w in kept]


def _file_rows(
    path: str, key: str, split: str | None = None, split_key: str | None = None, *, held: bool = False
) -> list[dict[str, Any]]:
    """The rows of `key`'s file or datasets folder (`split`, set by `split_key`, and `held` choose a folder's split
    as env=file does: roll_envs.tasks._datasets_folder)."""
    from roll_envs.tasks.dataset import _read_rows

    if not Path(path).exists():
        raise ConfigError(f"{key}={path}: no such file or folder")
    rows, bad, _ = _read_rows(Path(path), split, split_key, held=held)
    if bad:
        raise ConfigError(f"{key}={path}: unreadable rows {bad[:5]}")
    return [r for _, r in rows]
