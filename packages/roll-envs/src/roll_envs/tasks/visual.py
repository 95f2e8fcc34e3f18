"""A synthetic visual task (`env=visual`): questions whose answer is in a picture drawn at run time, for
vision-language policies.

Kinds (`env.kind`), each with a small answer space listed in the prompt (so chance is 1 / choices):
- `colour`: the picture is a grid of cells in `num_colours` colours; which colour covers most of it
  (the dominant colour has `dominance` of the cells, more than all the others together: never a tie);
- `count`: how many shapes (1 to `max_count`) are on a white picture;
- `position`: where the one shape is: left, right, top or bottom;
- `shape`: which shape it is: circle, square or triangle.

Problems are seeded (a problem's picture and answer come from its own random stream): the same config gives the
same problems, pictures included, on every machine. Training problems draw from `seed`, held-out ones from a
derived stream; a prompt names its picture's number (`Picture 12: ...`, distinct across the splits) so no
held-out prompt repeats a training one, and no held-out picture is a training picture (one drawn again is
redrawn). `blank=true` draws every picture empty (white, same size) and keeps the answers: the control of the
learning test (a policy that truly reads the picture learns `colour`; one that cannot see it stays at chance).
The reward (`VisualReward`, `env/reward=visual`) takes the last of the row's choices named in the response (whole
words, any case; a `\\boxed{}` answer wins) and scores 1 when it is the answer.

Pictures travel as RGB PIL images in `Problem.images`; the prompt starts with one `<image>` marker.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from roll_core.multimodal.images import digest
from roll_core.seeds import Purpose, derive_seed
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.tasks.base import Problem, Task

KINDS = ("colour", "count", "position", "shape")
#: The colours of `colour` (the first `num_colours` are used), each with a distinct first letter: with a
#: character tokenizer the first answer token alone decides the answer.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 130, 30),
    "cyan": (30, 200, 210),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
QUESTIONS = {
    "colour": "Which colour covers most of the picture?",
    "count": "How many shapes are in the picture?",
    "position": "Where is the shape in the picture?",
    "shape": "Which shape is in the picture?",
}
WHITE = (255, 255, 255)


class VisualTask(Task):
    """Questions about pictures drawn at run time (see the module docstring)."""

    def __init__(
        self,
        reward: Reward,
        name: str = "visual",
        kind: str = "colour",
        num_colours: int = 3,
        max_count: int = 4,
        size: int = 56,
        grid: int = 4,
        dominance: float = 0.75,
        blank: bool = False,
        train_size: int = 1000,
        eval_size: int = 100,
        seed: int = 0,
        system_prompt: str | None = None,
    ) -> None:
        super().__init__(reward)
        check_options(kind, num_colours, max_count, size, grid, dominance)
        self.dominance = dominance
        self.name, self.kind, self.system_prompt = name, kind, system_prompt
        self.num_colours, self.max_count, self.size, self.grid, self.blank = num_colours, max_count, size, grid, blank
        self.choices = choices_of(kind, num_colours, max_count)
        drawn: set[str] = set()  # the training pictures as drawn (before blank=true empties them)
        self._train = self._draw(random.Random(seed), train_size, first=1, record=drawn)
        held = random.Random(derive_seed(seed, Purpose.HELD_OUT))
        # A held-out picture is never a training one (a small space, kind=position, drew 54 of 100 again).
        self._eval = self._draw(held, eval_size, first=train_size + 1, avoid=drawn)

    @classmethod
    def conformance_task(cls, seed: int, workdir: Path) -> VisualTask:
        """A small instance for roll_core.testing.tasks' suite."""
        return cls(VisualReward(), train_size=200, eval_size=40, seed=seed)

    def conformance_response(self, problem: Problem) -> str:
        return f"It is {problem.answer}."

    def _draw(
        self, rng: random.Random, n: int, first: int, avoid: set[str] | None = None, record: set[str] | None = None
    ) -> list[Problem]:
        """`n` problems numbered from `first`; a picture in `avoid` (digests) is drawn again (up to 100 times: a
        space that small repeats); the pictures' digests go to `record`."""
        out = []
        for i in range(n):
            number = first + i
            # Each problem its own stream: a problem does not change when the sizes asked for change.
            own = random.Random(rng.getrandbits(64))
            answer, picture = DRAW[self.kind](self, own)
            for _ in range(100 if avoid else 0):
                if digest(picture) not in avoid:
                    break
                answer, picture = DRAW[self.kind](self, own)
            if record is not None:
                record.add(digest(picture))
            if self.blank:
                picture = new_picture(self.size)
            prompt = f"Picture {number}: {QUESTIONS[self.kind]} Answer with one of: {', '.join(self.choices)}. <image>"
            out.append(
                Problem(
                    id=f"{self.name}:{self.kind}:{number}",
                    prompt=prompt,
                    answer=answer,
                    domain=self.kind,
                    metadata={"choices": list(self.choices)},
                    images=(picture,),
                )
            )
        return out

    # ---- pictures -----------------------------------------------------------------------------------------
    def _colour(self, rng: random.Random) -> tuple[str, Any]:
        names = list(COLOURS)[: self.num_colours]
        answer = rng.choice(names)
        cells = self.grid * self.grid
        # The dominant colour holds more cells than all the others together: never a tie, whatever the draw.
        major = max(cells // 2 + 1, round(self.dominance * cells))
        others = [c for c in names if c != answer]
        colours = [answer] * major + [rng.choice(others) for _ in range(cells - major)]
        rng.shuffle(colours)
        from PIL import ImageDraw

        im = new_picture(self.size)
        draw, step = ImageDraw.Draw(im), self.size / self.grid
        for k, c in enumerate(colours):
            r, q = divmod(k, self.grid)
            box = (round(q * step), round(r * step), round((q + 1) * step) - 1, round((r + 1) * step) - 1)
            draw.rectangle(box, fill=COLOURS[c])
        return answer, im

    def _count(self, rng: random.Random) -> tuple[str, Any]:
        n = rng.randint(1, self.max_count)
        cells = rng.sample(range(self.grid * self.grid), n)  # one shape per cell: shapes never overlap
        im = new_picture(self.size)
        step = self.size / self.grid
        for k in cells:
            r, q = divmod(k, self.grid)
            box = (q * step + 1, r * step + 1, (q + 1) * step - 2, (r + 1) * step - 2)
            _shape(im, rng.choice(SHAPES), box, _ink(rng))
        return str(n), im

    def _position(self, rng: random.Random) -> tuple[str, Any]:
        where = rng.choice(POSITIONS)
        s, d = self.size, self.size / 4  # the shape's box is a quarter of the picture wide
        jitter = rng.uniform(-d / 2, d / 2)
        cx, cy = {
            "left": (d / 2 + 1, s / 2 + jitter),
            "right": (s - d / 2 - 1, s / 2 + jitter),
            "top": (s / 2 + jitter, d / 2 + 1),
            "bottom": (s / 2 + jitter, s - d / 2 - 1),
        }[where]
        im = new_picture(s)
        _shape(im, rng.choice(SHAPES), (cx - d / 2, cy - d / 2, cx + d / 2 - 1, cy + d / 2 - 1), _ink(rng))
        return where, im

    def _shape(self, rng: random.Random) -> tuple[str, Any]:
        kind = rng.choice(SHAPES)
        s = self.size
        side = rng.uniform(0.45, 0.8) * s
        x0, y0 = rng.uniform(0, s - side), rng.uniform(0, s - side)
        im = new_picture(s)
        _shape(im, kind, (x0, y0, x0 + side - 1, y0 + side - 1), _ink(rng))
        return kind, im


DRAW = {
    "colour": VisualTask._colour,
    "count": VisualTask._count,
    "position": VisualTask._position,
    "shape": VisualTask._shape,
}


def check_options(kind: str, num_colours: int, max_count: int, size: int, grid: int, dominance: float) -> None:
    """ValueError naming the env key of an option out of range."""
    if not 0.5 < dominance <= 1:
        raise ValueError(f"env.dominance={dominance} must be in (0.5, 1] (the dominant colour's share of the cells)")
    if kind not in KINDS:
        raise ValueError(f"env.kind={kind!r}: choose from {', '.join(KINDS)}")
    if not 2 <= num_colours <= len(COLOURS):
        raise ValueError(f"env.num_colours={num_colours} must be in [2, {len(COLOURS)}]")
    if not 2 <= max_count <= grid * grid:
        raise ValueError(f"env.max_count={max_count} must be in [2, env.grid**2={grid * grid}]")
    if size < 28 or grid < 2 or size // grid < 4:
        raise ValueError(f"env.size={size} must be >= 28 and env.grid={grid} >= 2 with cells of >= 4 pixels")


def choices_of(kind: str, num_colours: int, max_count: int) -> tuple[str, ...]:
    """The answer space of a kind (listed in every prompt)."""
    if kind == "colour":
        return tuple(list(COLOURS)[:num_colours])
    if kind == "count":
        return tuple(str(i) for i in range(1, max_count + 1))
    return POSITIONS if kind == "position" else SHAPES


def new_picture(size: int) -> Any:
    """An empty (white) RGB picture of `size` x `size`."""
    from roll_core.multimodal import PILLOW

    PILLOW.require()
    from PIL import Image

    return Image.new("RGB", (size, size), WHITE)


def _ink(rng: random.Random) -> tuple[int, int, int]:
    return COLOURS[rng.choice(list(COLOURS))]


def _shape(im: Any, kind: str, box: tuple[float, float, float, float], fill: tuple[int, int, int]) -> None:
    from PIL import ImageDraw

    draw = ImageDraw.Draw(im)
    x0, y0, x1, y1 = box
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


# ---- reward ---------------------------------------------------------------------------------------------------
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_WORD = re.compile(r"[a-z0-9]+")


class VisualReward(Reward):
    """1 (`correct_weight`) when the response names the right choice; `format_weight` when it names any."""

    def __init__(self, correct_weight: float = 1.0, format_weight: float = 0.0) -> None:
        self.correct_weight, self.format_weight = correct_weight, format_weight

    def extract_answer(self, text: str, choices: Sequence[str] | None = None) -> str | None:
        """The response's answer: the last `\\boxed{}` content if any, else the text; then the last of `choices`
        named in it as a whole word (any case), or without choices its last word. None when there is none."""
        boxes = _BOXED.findall(text[-4096:])  # an answer sits at the end; a huge response is not scanned whole
        tail = (boxes[-1] if boxes else text[-4096:]).lower()
        words = _WORD.findall(tail)
        if choices is None:
            return words[-1] if words else None
        wanted = {c.lower() for c in choices}
        named = [w for w in words if w in wanted]
        return named[-1] if named else None

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Score response i against answer i; row i's `choices` (metadata) bound what counts as an answer."""
        if len(responses) != len(answers) or (metadata is not None and len(metadata) != len(responses)):
            raise ValueError(f"{len(responses)} responses, {len(answers)} answers")
        scores, correct, formatted = [], [], []
        for i, (text, answer) in enumerate(zip(responses, answers)):
            choices = (metadata[i] or {}).get("choices") if metadata is not None else None
            got = self.extract_answer(text, choices)
            ok = float(got is not None and got == str(answer).strip().lower())
            fmt = float(got is not None)
            correct.append(ok)
            formatted.append(fmt)
            scores.append(self.correct_weight * ok + self.format_weight * fmt)
        return RewardResult(scores, correct, formatted)


@dataclass
class VisualRewardConfig:
    """Names the right choice (roll_envs.tasks.visual.VisualReward)."""

    _target_: str = "roll_envs.tasks.visual.VisualReward"
    # Score of the right answer.
    correct_weight: float = 1.0
    # Bonus for naming any of the choices (0 disables).
    format_weight: float = 0.0


@dataclass
class VisualEnvConfig:
    """Questions about pictures drawn at run time (vision-language models)."""

    _target_: str = "roll_envs.tasks.visual.VisualTask"
    name: str = "visual"
    # colour | count | position | shape.
    kind: str = "colour"
    # colour: how many colours (red, green, blue, yellow, purple, orange, cyan: the first K); chance is 1/K.
    num_colours: int = 3
    # count: shapes per picture at most (1..max_count).
    max_count: int = 4
    # Picture side in pixels (the tiny VLMs take 4 to 16 picture tokens: 56 px is 4).
    size: int = 56
    # Cells per side (colour cells; count places one shape per cell).
    grid: int = 4
    # colour: the dominant colour's share of the cells (above 0.5: never a tie; the rest in the other colours).
    dominance: float = 0.75
    # Empty pictures with the same answers: the control (nothing to see, reward stays at chance).
    blank: bool = False
    train_size: int = 1000
    eval_size: int = 100
    # Seed of the draw (the held-out problems use a derived stream).
    seed: int = 0
    system_prompt: str | None = None
    # The reward: a node of the env/reward group (this option's default is in its YAML's defaults list).
    reward: Any = MISSING

    def __post_init__(self) -> None:
        from roll_envs.config import reward_node

        if self.train_size < 1 or self.eval_size < 0:
            raise ValueError(f"env.train_size={self.train_size} must be >= 1 and env.eval_size >= 0")
        check_options(self.kind, self.num_colours, self.max_count, self.size, self.grid, self.dominance)
        self.reward = reward_node(self.reward, VisualRewardConfig)

    def check_installed(self) -> None:
        from roll_core.multimodal import PILLOW

        PILLOW.require()
