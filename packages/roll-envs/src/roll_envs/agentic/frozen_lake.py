"""FrozenLake: walk from the start (top left) to the goal (bottom right) without falling into a hole.

Maps are drawn from the seed: every cell other than start and goal is a hole with probability `hole_prob`, and a
map is redrawn until a breadth-first search finds a path from start to goal of at most `max_steps` moves, so every
instance is solvable within the episode (with certainty when `slipperiness` is 0).

Moves: up, down, left, right (any case) or U, D, L, R. A move off the board is illegal (invalid action: nothing
changes, `invalid_penalty`). With `slipperiness` p > 0 a legal move goes to one of the two perpendicular directions
with probability p (p/2 each), drawn from the episode's own RNG (seeded from the reset seed, separate from the map's
RNG, so maps do not depend on p); a slip off the board leaves the player in place. info["slipped"] tells.
Rewards: 1 on reaching the goal (terminated, success); 0 on falling into a hole (terminated, not a success);
0 otherwise. Legend: `P` player, `S` start, `F` frozen (safe), `H` hole, `G` goal.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, ClassVar

from roll_envs.agentic.base import DIRECTIONS, IllegalAction, Outcome, TextEnv, parse_direction

Pos = tuple[int, int]
LEGEND = "Legend: P you, S start, F frozen (safe), H hole, G goal."
_SIDEWAYS = {"up": ("left", "right"), "down": ("left", "right"), "left": ("up", "down"), "right": ("up", "down")}


def shortest_path(size: int, holes: set[Pos] | frozenset[Pos], start: Pos = (0, 0)) -> list[str] | None:
    """Moves of a shortest hole-free path from `start` to the goal (bottom right), or None if there is none."""
    goal = (size - 1, size - 1)
    parents: dict[Pos, tuple[Pos, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        p = queue.popleft()
        if p == goal:
            path = []
            while parents[p] is not None:
                p, move = parents[p]  # type: ignore[misc]
                path.append(move)
            return path[::-1]
        for move, d in DIRECTIONS.items():
            q = (p[0] + d[0], p[1] + d[1])
            if 0 <= q[0] < size and 0 <= q[1] < size and q not in holes and q not in parents:
                parents[q] = (p, move)
                queue.append(q)
    return None


def generate_map(rng: random.Random, size: int = 4, hole_prob: float = 0.2, max_moves: int = 20) -> frozenset[Pos]:
    """Hole cells of a map with a path from start to goal of at most `max_moves` moves."""
    for _ in range(10_000):
        holes = frozenset(
            (r, c)
            for r in range(size)
            for c in range(size)
            if (r, c) not in ((0, 0), (size - 1, size - 1)) and rng.random() < hole_prob
        )
        path = shortest_path(size, holes)
        if path is not None and len(path) <= max_moves:
            return holes
    raise ValueError(f"no {size}x{size} map with hole_prob={hole_prob} is solvable in {max_moves} moves; lower it")


class FrozenLakeEnv(TextEnv):
    """FrozenLake on seeded random maps; see the module docstring."""

    name: ClassVar[str] = "frozen_lake"

    def __init__(
        self,
        size: int = 4,
        slipperiness: float = 0.0,
        hole_prob: float = 0.2,
        max_steps: int = 20,
        invalid_penalty: float = -0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty, seed=seed)
        if size < 2:
            raise ValueError(f"size must be >= 2, got {size}")
        if not 0.0 <= slipperiness <= 1.0 or not 0.0 <= hole_prob < 1.0:
            raise ValueError(f"need 0 <= slipperiness <= 1 and 0 <= hole_prob < 1, got {slipperiness}, {hole_prob}")
        if 2 * (size - 1) > max_steps:
            raise ValueError(f"a {size}x{size} lake needs at least {2 * (size - 1)} moves; max_steps={max_steps}")
        self.size, self.slipperiness, self.hole_prob = size, float(slipperiness), float(hole_prob)
        self.holes: frozenset[Pos] = frozenset()
        self.player: Pos = (0, 0)
        self.goal: Pos = (size - 1, size - 1)
        self._slip_rng = random.Random(0)
        self._slipped = False

    def _new_episode(self, rng: random.Random) -> None:
        self.holes = generate_map(rng, self.size, self.hole_prob, self.max_steps)
        self.player = (0, 0)
        # Slips have their own stream: the map of a seed is the same whatever the slipperiness.
        self._slip_rng = random.Random(f"frozen_lake/slip/{self.seed}")
        self._slipped = False

    def _state_key(self) -> str:
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                p = (r, c)
                if p == self.player:
                    row += "P"
                elif p in self.holes:
                    row += "H"
                elif p == self.goal:
                    row += "G"
                else:
                    row += "S" if p == (0, 0) else "F"
            rows.append(row)
        return "\n".join(rows)

    def _render(self) -> str:
        return f"{self._state_key()}\n{LEGEND}"

    def _parse(self, action: str) -> str | None:
        return parse_direction(action)

    def _inside(self, p: Pos) -> bool:
        return 0 <= p[0] < self.size and 0 <= p[1] < self.size

    def _apply(self, action: str) -> Outcome:
        d = DIRECTIONS[action]
        if not self._inside((self.player[0] + d[0], self.player[1] + d[1])):
            raise IllegalAction(f"moving {action} leaves the lake")
        moved = action
        self._slipped = self.slipperiness > 0 and self._slip_rng.random() < self.slipperiness
        if self._slipped:
            moved = self._slip_rng.choice(_SIDEWAYS[action])
        d = DIRECTIONS[moved]
        target = (self.player[0] + d[0], self.player[1] + d[1])
        message = f"You moved {action}." if not self._slipped else f"You tried to move {action} but slipped {moved}."
        if self._inside(target):
            self.player = target
        else:
            message += " You bumped into the edge and stayed in place."
        if self.player in self.holes:
            return Outcome(0.0, terminated=True, success=False, message=message + " You fell into a hole!")
        if self.player == self.goal:
            return Outcome(1.0, terminated=True, success=True, message=message + " You reached the goal!")
        return Outcome(0.0, message=message)

    def expert_reply(self) -> str | None:
        """The first move of a shortest safe path from where the player stands."""
        path = shortest_path(self.size, self.holes, self.player)
        if not path:
            return None
        return f"Moving {path[0]} keeps me on a safe path to the goal. \\boxed{{{path[0]}}}"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._slipped = False
        obs, reward, terminated, truncated, info = super().step(action)
        info["slipped"] = self._slipped
        return obs, reward, terminated, truncated, info

    def _action_format(self) -> str:
        return "one of up, down, left, right (any case) or the letters U, D, L, R"

    def _rules(self) -> str:
        slip = (
            f" The ice is slippery: with probability {self.slipperiness:g} a move goes sideways instead."
            if self.slipperiness
            else " The ice is not slippery: every move goes where you say."
        )
        return (
            f"You are on a {self.size}x{self.size} frozen lake. {LEGEND} Walk from S (top left) to G (bottom right) "
            f"one cell per step without stepping into a hole H (falling in ends the episode with reward 0). "
            f"Reaching G gives reward 1.{slip}"
        )

    def _example(self) -> str:
        return "The cell to my right is frozen and leads toward the goal. \\boxed{right}"
