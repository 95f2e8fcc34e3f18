"""Sokoban: push every box onto a target. Procedural levels from a seed, solvable by construction.

Generation (as in the standard RL Sokoban generators, e.g. gym-sokoban): carve a connected room by a random walk
inside a walled rectangle, put the boxes on targets (the solved state) and the player on a free floor cell, then
play *backwards*: the player walks randomly and, moving away from an adjacent box, may pull it along. Every pull is a
push played in reverse, so the reversed walk is a forward solution; the level is the state of the walk (within the
first `max_steps` moves) whose boxes are furthest from their targets. Hence every level is solvable in at most
`max_steps` moves and never starts solved. `solve()` (breadth-first search) finds shortest solutions; tests use it
to check solvability independently of the generator.

Actions: up, down, left, right (any case) or U, D, L, R. Walking into a wall or pushing a box into a wall or another
box is illegal (invalid action: nothing changes, `invalid_penalty`). Rewards: +1 on the step that solves the level,
`step_penalty` (default 0) on every legal step, and optional shaping of +/-`shaping` per box pushed onto/off a
target (default 0: off).
Legend (ASCII, shown in every observation): `#` wall, `_` floor, `X` target, `O` box, `*` box on target,
`P` player, `S` player on a target.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from roll_envs.agentic.base import DIRECTIONS, IllegalAction, Outcome, TextEnv, parse_direction

Pos = tuple[int, int]
LEGEND = "Legend: # wall, _ floor, X target, O box, * box on target, P player, S player on a target."
_CHARS = {"#": "wall", "_": "floor", "X": "target", "O": "box", "*": "box+target", "P": "player", "S": "player+target"}
_RANK_STATES = 20_000
_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}


def _add(p: Pos, d: tuple[int, int]) -> Pos:
    return (p[0] + d[0], p[1] + d[1])


@dataclass(frozen=True)
class Level:
    """A Sokoban position: walls, targets, boxes and the player, as (row, column) cells. Border cells are walls."""

    width: int
    height: int
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos

    @property
    def solved(self) -> bool:
        return self.boxes == self.targets

    def render(self, boxes: frozenset[Pos] | set[Pos] | None = None, player: Pos | None = None) -> str:
        """The grid in the legend's characters (optionally with other boxes / player positions)."""
        boxes = self.boxes if boxes is None else boxes
        player = self.player if player is None else player
        rows = []
        for r in range(self.height):
            row = []
            for c in range(self.width):
                p = (r, c)
                if p in self.walls:
                    row.append("#")
                elif p == player:
                    row.append("S" if p in self.targets else "P")
                elif p in boxes:
                    row.append("*" if p in self.targets else "O")
                else:
                    row.append("X" if p in self.targets else "_")
            rows.append("".join(row))
        return "\n".join(rows)

    @classmethod
    def from_text(cls, text: str) -> Level:
        """Parse a grid in the legend's characters (rows of equal width; exactly one player)."""
        rows = [r for r in text.strip().splitlines() if r.strip()]
        walls, targets, boxes, players = set(), set(), set(), []
        for r, line in enumerate(rows):
            for c, ch in enumerate(line):
                if ch not in _CHARS:
                    raise ValueError(f"unknown character {ch!r} at row {r}, column {c}; {LEGEND}")
                kind = _CHARS[ch]
                if kind == "wall":
                    walls.add((r, c))
                if "target" in kind:
                    targets.add((r, c))
                if kind.startswith("box"):
                    boxes.add((r, c))
                if kind.startswith("player"):
                    players.append((r, c))
        if len(players) != 1 or len(boxes) != len(targets) or not boxes:
            raise ValueError(f"need one player and as many boxes as targets (>0): {len(players)}, {len(boxes)}")
        _check_enclosed(rows, walls, players[0])
        return cls(max(map(len, rows)), len(rows), frozenset(walls), frozenset(targets), frozenset(boxes), players[0])


def _check_enclosed(rows: list[str], walls: set[Pos], player: Pos) -> None:
    """Refuse a level whose walls do not enclose the player: moves are unbounded, so an open edge (or a cell past a
    shorter row's end) let the player and boxes walk off the grid (rendered nowhere, and the solver searched an
    unbounded plane until its state limit)."""
    seen, todo = {player}, [player]
    while todo:
        r, c = todo.pop()
        if not (0 <= r < len(rows) and 0 <= c < len(rows[r])):
            where = f"row {r}, column {c}"
            raise ValueError(f"the level's walls do not enclose the player: it can leave the grid at {where}")
        for d in DIRECTIONS.values():
            nxt = _add((r, c), d)
            if nxt not in walls and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)


def _push(walls: frozenset[Pos], boxes: frozenset[Pos], player: Pos, move: str) -> tuple[Pos, frozenset[Pos]] | None:
    """(player, boxes) after a forward move, or None if the move is illegal."""
    d = DIRECTIONS[move]
    nxt = _add(player, d)
    if nxt in walls:
        return None
    if nxt in boxes:
        beyond = _add(nxt, d)
        if beyond in walls or beyond in boxes:
            return None
        return nxt, (boxes - {nxt}) | {beyond}
    return nxt, boxes


def solve(level: Level, max_states: int = 1_000_000) -> list[str] | None:
    """A shortest solution (list of moves) by breadth-first search; [] if already solved; None if unsolvable
    (or not solved within `max_states` explored states). Pushes into non-target corners are pruned (such a box can
    never move again)."""
    walls, targets = level.walls, level.targets

    def dead(p: Pos) -> bool:
        if p in targets:
            return False
        vertical = _add(p, (-1, 0)) in walls or _add(p, (1, 0)) in walls
        horizontal = _add(p, (0, -1)) in walls or _add(p, (0, 1)) in walls
        return vertical and horizontal

    start = (level.player, level.boxes)
    if level.solved:
        return []
    parents: dict[tuple[Pos, frozenset[Pos]], tuple[tuple[Pos, frozenset[Pos]], str] | None] = {start: None}
    queue = deque([start])
    while queue and len(parents) < max_states:
        state = queue.popleft()
        for move in DIRECTIONS:
            nxt = _push(walls, state[1], state[0], move)
            if nxt is None or nxt in parents:
                continue
            if nxt[1] != state[1] and any(dead(b) for b in nxt[1] - state[1]):
                continue
            parents[nxt] = (state, move)
            if nxt[1] == targets:
                path = []
                node: tuple[Pos, frozenset[Pos]] = nxt
                while parents[node] is not None:
                    node, m = parents[node]  # type: ignore[misc]
                    path.append(m)
                return path[::-1]
            queue.append(nxt)
    return None


def _carve(rng: random.Random, width: int, height: int, cells: int) -> set[Pos]:
    """A connected set of `cells` interior floor cells made by a random walk with occasional turns."""
    interior = [(r, c) for r in range(1, height - 1) for c in range(1, width - 1)]
    moves = list(DIRECTIONS.values())
    pos, d = rng.choice(interior), rng.choice(moves)
    floor = {pos}
    for _ in range(100 * len(interior)):  # bounded; a rectangle is covered long before this
        if len(floor) >= cells:
            break
        if rng.random() < 0.35:
            d = rng.choice(moves)
        nxt = _add(pos, d)
        if 1 <= nxt[0] < height - 1 and 1 <= nxt[1] < width - 1:
            pos = nxt
            floor.add(pos)
        else:
            d = rng.choice(moves)
    return floor


def _reverse_walk(
    rng: random.Random, walls: frozenset[Pos], targets: frozenset[Pos], floor: list[Pos], max_moves: int
) -> tuple[int, Pos, frozenset[Pos], list[str]] | None:
    """Play backwards from the solved state for up to `max_moves` moves; returns (score, player, boxes, forward
    moves in reverse order) of the walk's state with the highest score, or None if no box ever left its target."""
    boxes = set(targets)
    free = [p for p in floor if p not in boxes]
    # Start next to a box when possible (where the last push of a solution leaves the player), so walks pull.
    beside = [p for p in free if any(_add(p, d) in boxes for d in DIRECTIONS.values())]
    player = rng.choice(beside or free)
    reverse: list[str] = []
    best = None
    for _attempt in range(8 * max_moves):
        if len(reverse) >= max_moves:
            break
        name = rng.choice(list(DIRECTIONS))
        d = DIRECTIONS[name]
        nxt = _add(player, d)
        if nxt in walls or nxt in boxes:
            continue
        behind = _add(player, (-d[0], -d[1]))
        if behind in boxes and rng.random() < 0.8:  # pull the box along (a push, played backwards)
            boxes.remove(behind)
            boxes.add(player)
        player = nxt
        reverse.append(_OPPOSITE[name])
        off = [b for b in boxes if b not in targets]
        # Boxes off target times their total distance to the nearest target (gym-sokoban's "swaps x displacement").
        score = len(off) * sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in targets) for b in boxes)
        if off and (best is None or score > best[0]):
            best = (score, player, frozenset(boxes), list(reverse))
    return best


def generate_level(
    rng: random.Random, width: int = 6, height: int = 6, num_boxes: int = 1, max_moves: int = 20, min_moves: int = 4
) -> tuple[Level, list[str]]:
    """A level solvable in at most `max_moves` moves, and a solution of it (the shortest when BFS finds it within
    `_RANK_STATES` states, else the replayed backward walk).

    Levels whose shortest solution has at least `min_moves` moves are preferred: up to 50 rooms are tried, and the
    hardest level found is used if none reaches it (narrow rooms often let a box move only a cell or two).
    """
    interior = (width - 2) * (height - 2)
    cells = min(interior, max(int(0.7 * interior), 2 * num_boxes + 4))
    if width < 3 or height < 3 or num_boxes < 1 or cells < num_boxes + 2 or max_moves < 1:
        raise ValueError(f"cannot make a {width}x{height} level with {num_boxes} box(es) in {max_moves} moves")
    best: tuple[int, int, Level, list[str], list[str] | None] | None = None
    for _room in range(50):
        floor = _carve(rng, width, height, cells)
        if len(floor) < num_boxes + 2:
            continue
        walls = frozenset((r, c) for r in range(height) for c in range(width) if (r, c) not in floor)
        ordered = sorted(floor)
        targets = frozenset(rng.sample(ordered, num_boxes))
        # Several backward walks per room, ranked by shortest solution length (small levels are solved by BFS in
        # microseconds; past `_RANK_STATES` states the walk's length stands in for it), then by the walk's score.
        for _walk in range(8):
            found = _reverse_walk(rng, walls, targets, ordered, max_moves)
            if found is None:
                continue
            score, start, start_boxes, reverse = found
            level = Level(width, height, walls, targets, start_boxes, start)
            shortest = solve(level, max_states=_RANK_STATES)
            rank = len(shortest) if shortest is not None else len(reverse)
            if best is None or (rank, score) > best[:2]:
                best = (rank, score, level, reverse, shortest)
        if best is not None and best[0] >= min(min_moves, max_moves):
            break
    if best is None:
        raise RuntimeError(f"no {width}x{height} level with {num_boxes} box(es) after 50 rooms")
    _, _, level, reverse, shortest = best
    if shortest is not None:
        return level, shortest
    solution, pos, boxes = [], level.player, level.boxes
    for move in reversed(reverse):  # replay forward; stop as soon as the level is solved
        pushed = _push(level.walls, boxes, pos, move)
        if pushed is None:  # cannot happen: each backward step is a legal forward step
            raise RuntimeError(f"generator bug: the backward walk is not replayable at move {move}")
        pos, boxes = pushed
        solution.append(move)
        if boxes == level.targets:
            return level, solution
    raise RuntimeError("generator bug: the reversed walk does not solve the level")


class SokobanEnv(TextEnv):
    """Sokoban on procedural levels; see the module docstring."""

    name: ClassVar[str] = "sokoban"

    def __init__(
        self,
        width: int = 6,
        height: int = 6,
        num_boxes: int = 1,
        max_steps: int = 20,
        invalid_penalty: float = -0.1,
        step_penalty: float = 0.0,
        shaping: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty, seed=seed)
        generate_level(random.Random(0), width, height, num_boxes, max_steps)  # fail now on impossible sizes
        self.width, self.height, self.num_boxes = width, height, num_boxes
        self.step_penalty, self.shaping = float(step_penalty), float(shaping)
        self.level: Level | None = None
        #: A solution of the current level known from its generation (not necessarily the shortest).
        self.reference_solution: list[str] = []
        self.player: Pos = (0, 0)
        self.boxes: frozenset[Pos] = frozenset()

    def _new_episode(self, rng: random.Random) -> None:
        self.level, self.reference_solution = generate_level(
            rng, self.width, self.height, self.num_boxes, self.max_steps
        )
        self.player, self.boxes = self.level.player, self.level.boxes

    def current_level(self) -> Level:
        """The current position as a `Level` (for `solve()`)."""
        assert self.level is not None, "call reset() first"
        return Level(self.width, self.height, self.level.walls, self.level.targets, self.boxes, self.player)

    def _state_key(self) -> str:
        assert self.level is not None
        return self.level.render(self.boxes, self.player)

    def _render(self) -> str:
        assert self.level is not None
        on = len(self.boxes & self.level.targets)
        return f"{self._state_key()}\n{LEGEND}\nBoxes on targets: {on}/{len(self.boxes)}."

    def _parse(self, action: str) -> str | None:
        return parse_direction(action)

    def _apply(self, action: str) -> Outcome:
        assert self.level is not None
        moved = _push(self.level.walls, self.boxes, self.player, action)
        if moved is None:
            ahead = _add(self.player, DIRECTIONS[action])
            what = "a wall" if ahead in self.level.walls else "a box that cannot be pushed (wall or box behind it)"
            raise IllegalAction(f"moving {action} runs into {what}")
        targets = self.level.targets
        before = len(self.boxes & targets)
        self.player, self.boxes = moved
        after = len(self.boxes & targets)
        reward = self.step_penalty + self.shaping * (after - before)
        if self.boxes == targets:
            return Outcome(reward + 1.0, terminated=True, success=True, message=f"You moved {action}. Solved!")
        return Outcome(reward, message=f"You moved {action}.")

    def expert_reply(self) -> str | None:
        """The first move of a solution of the current position (the solver's)."""
        plan = solve(self.current_level())
        if not plan:
            return None
        return f"Following my plan to push the box onto the target, I move {plan[0]}. \\boxed{{{plan[0]}}}"

    def _action_format(self) -> str:
        return "one of up, down, left, right (any case) or the letters U, D, L, R"

    def _rules(self) -> str:
        return (
            f"You are playing Sokoban on a {self.width}x{self.height} grid. {LEGEND} You move one cell per step; "
            "walking into a box pushes it one cell further if that cell is free (floor or target). Boxes cannot be "
            "pulled, and you cannot push two boxes at once. Solve the level by putting every box on a target "
            "(reward 1). Avoid pushing a box into a corner that is not a target: it can never be moved again."
        )

    def _example(self) -> str:
        return "The box is left of a target and I stand left of the box, so I push it right. \\boxed{right}"
