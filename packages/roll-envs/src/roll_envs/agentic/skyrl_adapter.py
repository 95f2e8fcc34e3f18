"""SkyRL-Gym environments (`skyrl:<id>`, e.g. `skyrl:gsm8k_multi_turn`) under roll's `Env` contract.

SkyRL-Gym (`pip install roll-envs[skyrl]`) is not Gymnasium-shaped: an environment is built per dataset row
(`skyrl_gym.make(id, env_config=..., extras=row_extras)`, the extras carrying e.g. the reward spec), started with
`init(prompt_messages)`, and `step(text)` returns a dict of chat-message observations, reward, done and metadata.
The adapter gives it roll's shape: `rows` (or a JSONL `data_file`) are the dataset, `{"prompt": str | messages,
"extras": {...}}` per line; `reset(seed)` picks a row and builds a fresh environment for it: a held-out seed
(>= `eval_seed_offset`, env.eval_seed_offset's default) picks from the held-out rows (`eval_rows` /
`eval_data_file`, else the rows whose stable hash falls below `eval_fraction`), any other seed from the rest,
`seed % len(...)`; the two never share a row (held-out success measures generalisation: a training row that is a
held-out row but for whitespace in its strings is left out of training, counted in `also_held_out` and logged, as
env=file does), and a held-out seed without held-out rows is an error naming what to set;
observations are the new messages' contents joined, system messages too (`_text`); `done` is a truncation when the
environment's own turn limit (`max_turns`) of more than one turn ended the episode without success, else a
termination: a single-turn environment's (`max_turns` 1, SkyRL-Gym's default: gsm8k, aime) wrong answer is its
terminal state, not a time limit (it read as truncated, so every failure of a single-turn task counted as a
truncation in the end-reason metrics); success = terminated with reward >= `success_reward`.
What the environment returns is checked (a ValueError naming it, which roll's env manager counts as an environment
error): `init` returns (messages, metadata); `step` a mapping whose "reward" is a finite real number and whose
"done" is a bool or 0/1 (NumPy scalars are read; `bool()` read the string "False" as done, `float()` of None raised
a bare TypeError); observations are a message, a list of messages (mappings with a "content", or strings), a string
or None, a content a string or a list of text parts.
Empty observations: a row's prompt must be a non-blank string or chat messages with text (one message, or a list
of them), checked when the rows are read (a ValueError naming the rows: a single message was read as the list of
its keys, an empty prompt asked the model nothing); a first observation (what `init` returns) with no text is a
ValueError at reset, as the model would be asked nothing. A step that goes on with no observation (an empty string
or list, None: SkyRL-Gym's search environment does this when its tool finds nothing) gives the model an empty user
turn before its next reply, as SkyRL-Gym gives it no new message: counted in `empty_observations` and logged once
per instance; a step that ends the episode with none reads "The episode is over.".
SkyRL-Gym has no invalid-action notion (its environments score a malformed reply 0 and go on), so `invalid_action`
is False but for one reply: the environment reads the reply after its reasoning (the text after the last `</think>`,
roll_envs.rewards.judge.final_text, as roll's built-ins read actions: SkyRL-Gym parses replies itself, and an answer
weighed in the reasoning was read as the answer), and a reply whose `<think>` block is never closed has none: it is
an invalid action (reward 0, as SkyRL-Gym scores a malformed reply; the environment is not stepped, the turn counts
towards its `max_turns`). The trajectory keeps the whole reply (roll records the model's tokens). Stepping a
finished episode returns a note and reward 0.
SkyRL-Gym environments are closed (`close()`): the one an episode used when the next reset replaces it, the probe
built to read the turn limit, and the current one at `close()` (roll's env manager calls it). A close that raises
while replacing is logged and counted in `close_errors` (the new episode goes on); `close()` itself raises it.

Model-written code runs only in roll's sandbox (roll_envs.sandbox). SkyRL-Gym environments that execute the
model's code themselves (`RUNS_MODEL_CODE`: `lcb` execs it in a fork of this process, `searchcode` runs
`python -c` as this user, `rlm` execs it in this process; a program read /etc/passwd and wrote host files through
`lcb`; `text2sql` runs the model's SQL with sqlite3 on the database files opened read-write, and one statement,
`ATTACH DATABASE '<path>' AS x`, creates a file at any path this user can write: roll cannot make SkyRL open
them read-only) are refused with a ValueError unless `allow_unsandboxed_execution_i_understand_the_risk=True` (then
loudly logged); for code tasks use roll's own (the `code` tool, code rewards), which run in the sandbox.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from roll_core.agentic.step_values import checked_flag, checked_reward
from roll_envs.agentic.gem_adapter import UNCLOSED_THINK, check_code_execution
from roll_envs.agentic.openai_agent import split_rows
from roll_envs.rewards.judge import final_text

log = logging.getLogger(__name__)

#: Entry-point modules of SkyRL-Gym environments that execute the model's code outside roll's sandbox (module
#: docstring), by what they do with it.
RUNS_MODEL_CODE = {
    "skyrl_gym.envs.lcb": "execs it in a forked child of this process",
    "skyrl_gym.envs.searchcode": "runs it with `python -c` as this user",
    "skyrl_gym.envs.rlm": "execs it in this process",
    # Each statement runs in a transaction that is rolled back, but on a read-write connection that roll cannot
    # make read-only (SkyRL opens it): ATTACH creates files anywhere (seen), a write holds the database's lock.
    "skyrl_gym.envs.sql": "runs its SQL on the database files opened read-write; ATTACH creates files anywhere",
}


def _read_rows(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _prompt_problem(prompt: Any) -> str | None:
    """Why a row's prompt cannot start an episode, or None: it must be a non-blank string, or chat messages (one
    message, or a non-empty list of them: mappings with a "role" and a "content") with some non-blank text."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is blank (the model would be asked nothing)"
    messages = [prompt] if isinstance(prompt, Mapping) else prompt
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"is {type(prompt).__name__} {prompt!r:.60}, not a string or chat messages"
    if not all(isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
        return f"{prompt!r:.60} holds an item that is not a chat message (a mapping with 'role' and 'content')"
    if not any(isinstance(m["content"], str) and m["content"].strip() for m in messages):
        return "has no message with text (the model would be asked nothing)"
    return None


def _check_rows(rows: list[dict[str, Any]], source: str) -> None:
    """ValueError naming the rows (1-based, the first five) whose prompt or extras cannot start an episode (a
    single message as the prompt was read as its keys, an empty one asked the model nothing, extras None raised a
    bare TypeError at the episode's reset)."""
    bad = []
    for i, row in enumerate(rows, 1):
        why = _prompt_problem(row["prompt"]) if isinstance(row, Mapping) and "prompt" in row else None
        if not isinstance(row, Mapping) or "prompt" not in row:
            bad.append(f"row {i} has no 'prompt'")
        elif why is not None:
            bad.append(f"row {i}'s prompt {why}")
        elif not isinstance(row.get("extras") or {}, Mapping):
            bad.append(f"row {i}'s extras {row['extras']!r:.60} are not a mapping")
    if bad:
        raise ValueError(f"{source}: {len(bad)} rows cannot start an episode: " + "; ".join(bad[:5]))


class SkyRLEnv:
    """One SkyRL-Gym environment id over a list of dataset rows; see the module docstring."""

    def __init__(
        self,
        env_id: str,
        rows: list[dict[str, Any]] | None = None,
        data_file: str | None = None,
        env_config: dict[str, Any] | None = None,
        success_reward: float = 1.0,
        seed: int | None = None,
        eval_rows: list[dict[str, Any]] | None = None,
        eval_data_file: str | None = None,
        eval_fraction: float = 0.0,
        eval_seed_offset: int = 1_000_000,
        allow_unsandboxed_execution_i_understand_the_risk: bool = False,
    ) -> None:
        from roll_envs.config import SKYRL

        SKYRL.require()
        import skyrl_gym

        if (rows is None) == (data_file is None):
            raise ValueError("SkyRLEnv needs exactly one of rows=[{'prompt': ..., 'extras': {...}}] or data_file=")
        if data_file is not None:
            rows = _read_rows(data_file)
        assert rows is not None
        if not rows or any("prompt" not in r for r in rows):
            raise ValueError("SkyRLEnv rows must be non-empty and each have a 'prompt' (and usually 'extras')")
        if eval_rows is not None and eval_data_file is not None:
            raise ValueError("SkyRLEnv takes at most one of eval_rows= and eval_data_file=")
        held = _read_rows(eval_data_file) if eval_data_file is not None else eval_rows
        _check_rows(rows, f"SkyRLEnv({env_id}) " + (data_file or "rows"))
        if held is not None:
            _check_rows(held, f"SkyRLEnv({env_id}) " + (eval_data_file or "eval_rows"))
        # env=file's rule, as env=openai_agent splits its rows (split_rows): a training row that is a held-out row
        # but for whitespace is left out, counted and logged (an exact-JSON check trained on "Q?\n" while holding
        # out "Q?"); the hash is the row's JSON as before, so a resumed run keeps its split.
        counts: dict[str, int] = {}
        train, held = split_rows(
            rows,
            held,
            eval_fraction=eval_fraction,
            eval_size=len(rows) + len(held or ()),  # no cap: every held-out row is a held-out seed's choice
            source=f"SkyRLEnv({env_id})" + (f" {data_file}" if data_file else ""),
            path=data_file,
            eval_path=eval_data_file,
            counts=counts,
        )
        self.also_held_out = counts.get("also_held_out", 0)
        self.unused_held_out = counts.get("unused_held_out", 0)  # (0: every held-out row is a held-out seed's)
        self.held_out, self.eval_seed_offset = held, int(eval_seed_offset)
        if env_id not in skyrl_gym.envs.registration.registry:
            known = ", ".join(sorted(skyrl_gym.envs.registration.registry))
            raise ValueError(f"unknown SkyRL-Gym environment {env_id!r}; registered: {known}")
        spec = skyrl_gym.envs.registration.registry[env_id]
        check_code_execution(
            "SkyRL-Gym", env_id, spec.entry_point, RUNS_MODEL_CODE, allow_unsandboxed_execution_i_understand_the_risk
        )
        self.env_id, self.rows, self.env_config = env_id, train, dict(env_config or {})
        self.success_reward = float(success_reward)
        self._make, self._seeds = skyrl_gym.make, random.Random(seed)
        self.env: Any = None
        self._done, self._last, self._turn = True, "", 0
        self._end = (False, True)  # (terminated, truncated) of the step that ended the episode
        self.close_errors = 0
        self.empty_observations = 0  # steps that went on with no observation (module docstring)
        probe = self._make(env_id, env_config=self.env_config, extras=dict(rows[0].get("extras") or {}))
        self.max_steps = int(getattr(probe, "max_turns", 0) or 0) or None
        self._close_quietly(probe, "the probe")

    def _close_quietly(self, env: Any, which: str) -> None:
        """Close a SkyRL-Gym environment roll no longer uses; one that raises is logged and counted, not raised."""
        try:
            close = getattr(env, "close", None)
            if callable(close):
                close()
        except Exception as exc:
            self.close_errors += 1
            log.warning("%s: closing %s raised %s: %s (counted)", self.env_id, which, type(exc).__name__, exc)

    def close(self) -> None:
        """Close the current SkyRL-Gym environment, if any (its close's error is raised: the caller counts it)."""
        env, self.env, self._done = self.env, None, True
        close = getattr(env, "close", None)
        if callable(close):  # (an environment not built on SkyRL-Gym's BaseTextEnv may have none)
            close()

    @property
    def label(self) -> str:
        """The environment as error messages name it."""
        return f"SkyRL-Gym environment {self.env_id!r}"

    def _text(self, messages: Any) -> str:
        """The observation's messages as one text, in order, whatever their role: roll gives the policy an
        environment's observation as the turn's user message, and a system message (a row's system prompt, a
        notice an environment adds mid-episode) left out never reached it. Empty contents are skipped; a message
        that is not one (module docstring) is a ValueError (it raised a bare AttributeError, or read as its repr)."""
        if isinstance(messages, str):
            return messages
        if isinstance(messages, Mapping):  # one message, not in a list
            messages = [messages]
        if not isinstance(messages, (list, tuple)) and messages is not None:
            raise ValueError(f"{self.label}: observations {messages!r:.80} are not a list of chat messages")
        texts = (m if isinstance(m, str) else self._content(m) for m in messages or [])
        return "\n\n".join(t for t in texts if t)

    def _content(self, message: Any) -> str:
        content = message.get("content") if isinstance(message, Mapping) else message
        if content is None or isinstance(content, str):
            return content or ""
        if isinstance(content, (list, tuple)):  # OpenAI content parts: only text ones can reach a text policy
            parts = [p if isinstance(p, str) else p.get("text") if isinstance(p, Mapping) else None for p in content]
            if all(isinstance(p, str) for p in parts):
                return "\n".join(p for p in parts if p)
        raise ValueError(
            f"{self.label}: the observation message {message!r:.80} is not a chat message with text content "
            "(a mapping whose 'content' is a string or a list of text parts)"
        )

    def _info(self, success: bool = False) -> dict[str, Any]:
        return {"success": success, "state": f"{self._last}\n[turn {self._turn}]", "invalid_action": False}

    def _invalid(self) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """An unclosed `<think>`: reward 0, the environment not stepped; at its turn limit the episode is truncated."""
        limit = int(getattr(self.env, "max_turns", 0) or 0)
        truncated = limit > 0 and self._turn >= limit
        obs = f"Invalid action: {UNCLOSED_THINK}\n\n{self._last}"
        if truncated:
            self._done, self._end = True, (False, True)
            obs += f"\n\nThe turn limit ({limit}) is reached; the episode is over."
        return obs, 0.0, False, truncated, {**self._info(), "invalid_action": True}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        seed = int(seed) if seed is not None else self._seeds.getrandbits(32)
        if seed >= self.eval_seed_offset:
            if not self.held_out:
                raise ValueError(
                    f"{self.env_id}: held-out seed {seed} but no held-out rows (they would be training rows): give "
                    "+env.env_kwargs.eval_data_file=<file> (or eval_rows), or +env.env_kwargs.eval_fraction=<f> "
                    "(> 0), or env.eval_size=0"
                )
            row = self.held_out[(seed - self.eval_seed_offset) % len(self.held_out)]
        else:
            row = self.rows[seed % len(self.rows)]
        prompt = row["prompt"]  # (checked: _check_rows)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:  # one message (it was read as the list of its keys), or a list of them
            messages = [prompt] if isinstance(prompt, Mapping) else list(prompt)
        extras = dict(row.get("extras") or {})
        # No step reaches the new environment before its init has answered (a failed init left the last
        # episode's "not done" in place, and a step went to an environment never started).
        self._done, self._end = True, (False, True)
        old, self.env = self.env, self._make(self.env_id, env_config=self.env_config, extras=extras)
        if old is not None:  # it was dropped without close: what it held stayed open for the run
            self._close_quietly(old, "the previous episode's environment")
        started = self.env.init(messages)
        # A list of two messages (init returning the messages alone) is no (messages, metadata): refused, not split.
        if (
            not isinstance(started, (tuple, list))
            or len(started) != 2
            or isinstance(started[0], Mapping)
            or not (started[1] is None or isinstance(started[1], Mapping))
        ):
            raise ValueError(f"{self.label}: init returned {started!r:.80}; it must return (messages, metadata)")
        first = self._text(started[0])
        if not first.strip():
            raise ValueError(
                f"{self.label}: init returned no text for seed {seed}'s row ({started[0]!r:.80}): the first "
                "observation is the model's task, and an empty one asks it nothing"
            )
        self._done, self._turn, self._last = False, 0, first
        return self._last, {**self._info(), "seed": seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.env is None:
            raise RuntimeError("SkyRLEnv.step() called before reset()")
        if self._done:
            return "The episode is over; no further actions are taken.", 0.0, *self._end, self._info()
        text = final_text(action if isinstance(action, str) else str(action))
        self._turn += 1
        if text is None:
            return self._invalid()
        out = self.env.step(text)
        if not isinstance(out, Mapping) or "reward" not in out or "done" not in out:
            raise ValueError(
                f"{self.label}: step returned {out!r:.80}; it must return a mapping with 'observations', 'reward' "
                "and 'done' (SkyRL-Gym's BaseTextEnvStepOutput)"
            )
        reward, done = checked_reward(out["reward"], self.label), checked_flag(out["done"], "'done'", self.label)
        self._last = self._text(out.get("observations")) or ("The episode is over." if done else "")
        success = done and reward >= self.success_reward
        limit = int(getattr(self.env, "max_turns", 0) or 0)
        # Past the limit without the environment's say too: invalid turns (not stepped) never reached its count. A
        # single-turn environment's own end is its terminal state (module docstring), not its turn limit.
        truncated = not success and limit > 0 and self._turn >= limit and (not done or limit > 1)
        self._done, self._end = done or truncated, (done and not truncated, truncated)
        if not self._last and not self._done:  # documented (module docstring): an empty user turn, counted
            self.empty_observations += 1
            if self.empty_observations == 1:
                log.warning(
                    "%s returned no observation on a step that does not end the episode: the model's next turn "
                    "follows an empty user message (counted in empty_observations; said once per instance)",
                    self.label,
                )
        return self._last, reward, done and not truncated, truncated, self._info(success)
