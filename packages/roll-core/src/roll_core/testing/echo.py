"""A task whose answer is the response itself, for tests of evaluation and rollout bookkeeping that script the
engine's output: `EchoProblem(id, prompt, answer="x", domain=None)` and `EchoTask` (one user message per problem;
the extracted answer is the response text, None when empty). What the tests grade is decided by their own reward."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EchoProblem", "EchoTask"]


@dataclass
class EchoProblem:
    """A problem: its id, the user message, the reference answer and an optional domain."""

    id: str
    prompt: str
    answer: str = "x"
    domain: str | None = None


class EchoTask:
    """One user message per problem; the response text is the answer."""

    def messages(self, problem: EchoProblem) -> list[dict[str, str]]:
        return [{"role": "user", "content": problem.prompt}]

    def extract_answer(self, text: str) -> str | None:
        return text or None
