"""The task interface: a fixed, seeded list of training problems, a disjoint held-out list, and a reward.

Contract: `train_set()` and `eval_set()` are deterministic for a given config (same seed, same problems, same order)
and never share a problem, so held-out accuracy measures generalisation, not memorisation. A problem's `prompt` is
the (last) user message; `context` the chat turns a data row puts before it (its own system message, earlier
user/assistant turns); the pipeline applies the model's chat template to `messages()`. `score()` delegates to the
task's reward and returns a `RewardResult` with counted failures. A problem may carry pictures (`images`: anything
roll_core.multimodal.load_image takes); its prompt then places them with `<image>` markers (or they come first), and
the pipeline feeds them to a vision-language model (a text model given pictures is an error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# one definition of a near-duplicate for the RL tasks and post-training's rows (imported from here too)
from roll_core.near_duplicates import image_key, loose_key, stable_fraction
from roll_envs.rewards.base import Reward, RewardResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """One prompt with its ground truth. `id` is stable across runs (used for dedup and held-out splits).
    `domain` routes the row in a multi-domain run and names its metrics; `metadata` is everything else a reward may
    need (a data row's other columns, a generated problem's constraints): rewards that declare `metadata` get
    `{**metadata, "domain": domain}`. `images`: the problem's pictures in prompt order (paths, bytes,
    `{"bytes", "path"}` dicts, PIL images or arrays; see roll_core.multimodal.load_image), empty for text.
    `context`: `{"role", "content"}` text messages before the prompt (a chat-messages data row's system message
    and earlier turns), empty for a plain prompt."""

    id: str
    prompt: str
    answer: str
    domain: str = "math"
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    images: Sequence[Any] = field(default_factory=tuple, compare=False, hash=False, repr=False)
    context: Sequence[Mapping[str, str]] = field(default_factory=tuple, compare=False, hash=False, repr=False)


def held_out_split(
    problems: list[Any],
    held: list[Any] | None,
    *,
    eval_fraction: float,
    eval_size: int,
    path: str | None,
    eval_path: str | None = None,
    counts: dict[str, int] | None = None,
    key: Callable[[Any], str] | None = None,
) -> tuple[list[Any], list[Any]]:
    """(train, held-out) of a file-backed task: with `held` (the rows of env.eval_path) every row of `problems`
    trains but those also in `held`; without, problems whose stable hash (`stable_fraction(key(problem))`, `key`
    is `split_key` unless given: env=openai_agent and skyrl:<id> hash a row's JSON) falls below `eval_fraction`
    are held out, and training rows that repeat a held-out row but for whitespace are left out too (the hash of
    the raw prompt put "Q?" and "Q?\n" on different sides: a held-out problem also trained on). Either way a row
    is "also held out" when its `loose_key` (prompt with whitespace collapsed, and pictures) is a held-out row's:
    such rows are dropped from training with one warning and counted in `counts["also_held_out"]` (when `counts`
    is given), so the two sets never share a problem. `split_key` itself is unchanged: a resumed run keeps its
    split. The held-out list is cut to `eval_size` (training does not depend on it); the hash split's rows beyond it
    are neither trained nor evaluated, counted in `counts["unused_held_out"]` (0 with `held`: env.eval_path's rows
    were never training rows) and logged. A ConfigError when nothing is
    left to train on. env.path and env.eval_path naming the same file is an evaluation set (roll-eval --data):
    every row is both, with a warning."""
    from roll_core.errors import ConfigError

    if held is not None and path and eval_path and _same_file(path, eval_path):
        log.warning("%s is both env.path and env.eval_path: an evaluation set (its rows also train)", path)
        if counts is not None:  # nothing left out
            counts["also_held_out"] = counts["unused_held_out"] = 0
        return list(problems), held[:eval_size]
    unused = 0
    if held is None:
        hash_key = key or split_key
        in_held = [stable_fraction(hash_key(p)) < eval_fraction for p in problems]
        train = [p for p, h in zip(problems, in_held, strict=True) if not h]
        held = [p for p, h in zip(problems, in_held, strict=True) if h]
        if len(held) > eval_size:  # the split is by hash (stable whatever eval_size): the rest is idle, say so
            log.warning(
                "%s: %d rows fell in the held-out split (env.eval_fraction=%g) and env.eval_size=%d evaluates the "
                "first %d: the other %d are neither trained nor evaluated (raise env.eval_size or lower "
                "env.eval_fraction to use them)",
                path,
                len(held),
                eval_fraction,
                eval_size,
                eval_size,
                len(held) - eval_size,
            )
            unused = len(held) - eval_size
        held_keys = {loose_key(p) for p in held}  # (all of them: the split is eval_size's business, not training's)
        near = [p for p in train if loose_key(p) in held_keys]  # exact repeats already share a side
        if near:
            train = [p for p in train if loose_key(p) not in held_keys]
            log.warning(
                "%s: %d of its %d rows repeat a held-out row's prompt but for whitespace: left out of training (a "
                "held-out problem that is trained on measures nothing)",
                path,
                len(near),
                len(problems),
            )
        left_out = len(near)
    else:
        evaluated = {loose_key(p) for p in held}
        train = [p for p in problems if loose_key(p) not in evaluated]
        left_out = len(problems) - len(train)
        if left_out:
            log.warning(
                "%s: %d of its %d rows are also in env.eval_path: left out of training (a held-out problem "
                "that is trained on measures nothing)",
                path,
                left_out,
                len(problems),
            )
    if counts is not None:
        counts["also_held_out"] = left_out
        counts["unused_held_out"] = unused
    if not train:
        raise ConfigError(
            f"{path}: every row fell in the held-out split; lower env.eval_fraction or give env.eval_path"
        )
    return train, held[:eval_size]


def eval_file_name(name: str, path: str | Path, eval_path: str | Path) -> str:
    """The id prefix of env.eval_path's rows: `name`, or `<name>:eval` when env.path is another file of the same
    file name (train/data.jsonl, test/data.jsonl). A file row's id names its file by its name only: both files'
    line 5 was `data:data.jsonl:5`, a held-out problem with a training problem's id (in rollout dumps,
    evaluation records and anything keyed by id)."""
    if Path(eval_path).name == Path(path).name and not _same_file(str(path), str(eval_path)):
        return f"{name}:eval"
    return name


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def split_key(problem: Any) -> str:
    """What decides a file row's split: its prompt, and for rows with pictures the pictures too (rows asking the
    same question about different pictures are different problems; the same question about the same picture is
    one problem and never lands in both splits)."""
    images = getattr(problem, "images", None) or ()
    if not images:
        return problem.prompt
    return problem.prompt + "\x00" + "\x00".join(image_key(im) for im in images)


#: Text that opens a prompt already rendered by a chat template (ChatML/Qwen, Llama 3, DeepSeek, Gemma, Llama 2 and
#: Mistral, Phi-3/Zephyr). The pipeline applies the model's template to `Task.messages()`, so such a prompt was
#: templated twice: the model saw a user turn holding a whole rendered chat, its own turn markers as plain text.
CHAT_TEMPLATE_MARKERS = (
    "<|im_start|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "<\uff5cUser\uff5c>",
    "<start_of_turn>",
    "<bos><start_of_turn>",
    "<s>[INST]",
    "<s> [INST]",
    "[INST]",
    "<|user|>",
    "<|system|>",
)


def templated_marker(text: str) -> str | None:
    """The chat-template marker that `text` opens with (`CHAT_TEMPLATE_MARKERS`, after leading white space), or
    None for a plain prompt."""
    head = text.lstrip()
    return next((m for m in CHAT_TEMPLATE_MARKERS if head.startswith(m)), None)


class Task:
    """Base class: subclasses fill `_train` and `_eval` and set `reward`."""

    name: str = "task"
    system_prompt: str | None = None

    def __init__(self, reward: Reward) -> None:
        self.reward = reward
        self._train: list[Problem] = []
        self._eval: list[Problem] = []
        # Worked examples shown before each question as (user, assistant) chat turns: small models learn the
        # answer format from one example far more reliably than from an instruction.
        self.examples: list[tuple[str, str]] = []
        # Bad rows skipped while loading data files: (file, row number, reason); generated tasks have none.
        self.skipped: list[tuple[str, int, str]] = []
        # Training rows left out because a held-out row is the same problem (held_out_split's "also_held_out"):
        # file tasks only; generated tasks draw disjoint splits.
        self.also_held_out = 0
        # Held-out rows neither trained nor evaluated (held_out_split's "unused_held_out", DataCounts): file tasks
        # set it; None for generated tasks (they draw only the held-out problems they evaluate).
        self.unused_held_out: int | None = None

    def split_held_out(self, problems: list[Any], held: list[Any] | None, **kwargs: Any) -> tuple[list[Any], list[Any]]:
        """`held_out_split(problems, held, **kwargs)`, its counts kept as this task's `also_held_out` and
        `unused_held_out` (what a run reports: roll_core.interfaces.tasks.DataCounts)."""
        counts: dict[str, int] = {}
        train, evaluated = held_out_split(problems, held, counts=counts, **kwargs)
        self.also_held_out = counts.get("also_held_out", 0)
        self.unused_held_out = counts.get("unused_held_out", 0)
        return train, evaluated

    @property
    def skipped_rows(self) -> dict[str, int]:
        """Bad rows skipped per data file ({} when none): for the run's metrics and summary."""
        out: dict[str, int] = {}
        for file, _, _ in self.skipped:
            out[file] = out.get(file, 0) + 1
        return out

    def train_set(self) -> list[Problem]:
        """Training problems in a fixed order (the pipeline shuffles per epoch with its own seed)."""
        return self._train

    def eval_set(self) -> list[Problem]:
        """Held-out problems, disjoint from `train_set()`."""
        return self._eval

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages for a problem: system prompt if any, worked examples, the row's earlier turns
        (`context`), then the user prompt. The system prompt is `system_prompt` (env.system_prompt: a setting
        beats the data), else the row's own system message; there is never more than one (chat templates refuse
        a second). The pipeline applies the model's chat template to these messages: a prompt must be the raw
        user text (file rows opening with a chat template's markers, `templated_marker`, are skipped at load)."""
        context = [dict(m) for m in getattr(problem, "context", None) or ()]
        system = self.system_prompt
        if context and context[0].get("role") == "system":
            own = context.pop(0)
            system = system or own["content"]
        msgs = [{"role": "system", "content": system}] if system else []
        for question, answer in self.examples:
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return [*msgs, *context, {"role": "user", "content": problem.prompt}]

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> RewardResult:
        """Score responses against their problems' answers."""
        return self.reward.score(responses, [p.answer for p in problems])
