"""Procedurally generated arithmetic ("What is 47 + 25?") with seeded, disjoint train and held-out splits.

A problem belongs to the held-out split when a stable hash of its expression falls below `eval_fraction`, so
the split does not depend on the seed or on the sizes asked for; the seed only picks which problems are drawn.
Difficulty: `digits` per operand (1: 0-9, 2: 10-99, ...), `num_terms` operands, operators from `ops`.
`examples=k` shows k worked training problems ("2 + 3 = 5, so the answer is \\boxed{5}.") as earlier chat turns.
"""

from __future__ import annotations

import random
from pathlib import Path

from roll_core.seeds import Purpose, derive_seed
from roll_envs.rewards.base import Reward
from roll_envs.tasks.base import Problem, Task, stable_fraction

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticTask(Task):
    """Integer arithmetic with `+`, `-`, `*` (left to right with standard precedence, evaluated by Python)."""

    def __init__(
        self,
        reward: Reward,
        name: str = "arithmetic",
        digits: int = 1,
        num_terms: int = 2,
        ops: tuple[str, ...] | list[str] = ("+",),
        train_size: int = 2000,
        eval_size: int = 100,
        eval_fraction: float = 0.2,
        seed: int = 0,
        instruction: str = "Put the final answer in \\boxed{}.",
        system_prompt: str | None = None,
        examples: int = 0,
    ) -> None:
        super().__init__(reward)
        if digits < 1 or num_terms < 2:
            raise ValueError(f"need digits >= 1 and num_terms >= 2, got digits={digits}, num_terms={num_terms}")
        bad = [o for o in ops if o not in _OPS]
        if bad or not ops:
            raise ValueError(f"unsupported ops {bad or ops}; choose from {list(_OPS)}")
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.name, self.digits, self.num_terms, self.ops = name, digits, num_terms, list(ops)
        self.instruction, self.system_prompt = instruction, system_prompt
        lo, hi = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
        space = (hi - lo + 1) ** num_terms * len(self.ops) ** (num_terms - 1)
        self._train = self._draw(
            random.Random(seed), lo, hi, train_size, held_out=False, fraction=eval_fraction, space=space
        )
        held_out_rng = random.Random(derive_seed(seed, Purpose.HELD_OUT))
        self._eval = self._draw(held_out_rng, lo, hi, eval_size, held_out=True, fraction=eval_fraction, space=space)
        # Worked examples come from the training split, so no held-out answer is ever shown.
        examples_rng = random.Random(derive_seed(seed, Purpose.WORKED_EXAMPLES))
        shown = self._draw(examples_rng, lo, hi, examples, held_out=False, fraction=eval_fraction, space=space)
        # (The expression is the id after `<name>:`; split at the first colon, a name with one (env.name=a:b) put
        # "b:2 + 3 = 5" in every worked example.)
        self.examples = [
            (p.prompt, f"{p.id[len(name) + 1 :]} = {p.answer}, so the answer is \\boxed{{{p.answer}}}.") for p in shown
        ]

    @classmethod
    def conformance_task(cls, seed: int, workdir: Path) -> ArithmeticTask:
        """A small instance for roll_core.testing.tasks' suite (two-digit sums, one worked example)."""
        from roll_envs.rewards.math import MathReward

        return cls(MathReward(), digits=2, train_size=200, eval_size=40, seed=seed, examples=1)

    def _draw(
        self, rng: random.Random, lo: int, hi: int, n: int, *, held_out: bool, fraction: float, space: int
    ) -> list[Problem]:
        """Draw `n` problems of one split; distinct while the split has enough distinct problems."""
        out: list[Problem] = []
        seen: set[str] = set()
        distinct_cap = int(space * (fraction if held_out else 1 - fraction) * 0.9)
        attempts = misses = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * max(n, 1):
                raise ValueError(f"cannot draw {n} {'held-out' if held_out else 'training'} problems")
            terms = [rng.randint(lo, hi) for _ in range(self.num_terms)]
            ops = [rng.choice(self.ops) for _ in range(self.num_terms - 1)]
            expr = str(terms[0]) + "".join(f" {o} {t}" for o, t in zip(ops, terms[1:]))
            if (stable_fraction(expr) < fraction) != held_out:
                continue
            # Repeats once the split's distinct problems run out: the cap estimates how many it has (the hash split
            # may give it fewer), and a long run of repeats says they have run out whatever the estimate.
            if expr in seen and len(seen) < distinct_cap and misses < max(100, 10 * len(seen)):
                misses += 1
                continue
            if expr not in seen:
                misses = 0
            seen.add(expr)
            value = eval(expr, {"__builtins__": {}})  # our own generated expression: digits and + - * only
            out.append(
                Problem(
                    id=f"{self.name}:{expr}",
                    prompt=f"What is {expr}? {self.instruction}",
                    answer=str(value),
                    domain="math",
                )
            )
        return out
