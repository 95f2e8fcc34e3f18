"""The tool call of a reply to roll_envs.agentic.tool_env.ToolUseEnv, in either of its two spellings.

- The env's own: `<tool>NAME: ARGUMENT</tool>` (where its blocks are: roll_envs.agentic._tool_syntax).
- The Hermes / Qwen form, what Qwen2.5 / Qwen3 and Hermes models write from their training:
  `<tool_call>{"name": NAME, "arguments": {"KEY": ARGUMENT}}</tool_call>`, read as the agent endpoint reads it
  (roll_core.agentic.hermes_syntax: JSON read to its end, blocks in the reasoning are no calls, `arguments` may also
  be the JSON text of an object). It is the same call as `<tool>NAME: ARGUMENT</tool>`: the env's tools take one
  text argument, so `arguments` must hold exactly one member whose value is a string (its key is the model's
  choice: `expression`, `code`, `query`), and that string, stripped as the `<tool>` form's argument is, is the
  argument. Anything else (no arguments, two members, a number) is an invalid call whose observation says so; it is
  never passed on as the answer (a Qwen model's calls were answers, `'</tool_call>' is not an action`, and with
  `max_answers: 1` the episode ended at its first call).

The reply's first block, of either form, is THE call; the blocks after it (of either form, closed or not) are
counted as ignored (`Call.ignored`). A reply with no block is no call (None): it goes to the wrapped environment.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from roll_core.agentic.hermes_syntax import HermesBlock, hermes_blocks
from roll_envs.agentic._tool_syntax import CLOSE, OPEN, find_calls

# The first `<tool>` block is THE call: searching for the first *well-formed* block ran a later call after a
# malformed one (`<tool>oops</tool> then <tool>calculator: 2+2</tool>` ran 2+2).
_CALL = re.compile(r"\s*([A-Za-z_][\w-]*)\s*:(.*)", re.DOTALL)

UNCLOSED = "Invalid tool call: the <tool> block is not closed; write <tool>NAME: ARGUMENT</tool>."
MALFORMED = "Invalid tool call: write exactly <tool>NAME: ARGUMENT</tool>."
_JSON_TYPES = {bool: "a boolean", list: "an array", dict: "an object", type(None): "null"}
HERMES_FORM = '<tool_call>{"name": NAME, "arguments": {"input": ARGUMENT}}</tool_call>'
HERMES_INVALID = (
    'Invalid tool call: a <tool_call> block holds one JSON object {"name": ..., "arguments": {...}} and ends with '
    f"</tool_call>; write {HERMES_FORM} or <tool>NAME: ARGUMENT</tool>."
)


@dataclass(frozen=True)
class Call:
    """The reply's first tool-call block: the tool's name and argument, or why it is no valid call."""

    name: str | None = None
    arg: str | None = None
    #: The observation for an invalid block (then name and arg are None).
    error: str | None = None
    #: Blocks after this one (not run).
    ignored: int = 0


def read_call(reply: str, hermes_form: bool = True) -> Call | None:
    """The reply's first tool call, in either form (only the `<tool>` one without `hermes_form`; module docstring);
    None when it has no block."""
    found = find_calls(reply)
    # (no call in a reply cut off while reasoning)
    hermes = hermes_blocks(reply) if hermes_form and found.answer is not None else []
    tool_at = -1 if not found.count else len(reply) - len(found.answer) + found.answer.index(OPEN)
    if hermes and (tool_at < 0 or hermes[0].start < tool_at):
        first = hermes[0]
        later_tools = find_calls(_outside(reply, hermes)).count if found.count else 0
        return _hermes_call(first, ignored=len(hermes) - 1 + later_tools)
    if tool_at < 0:
        return None
    ignored = found.count - 1
    if found.first is None:
        return Call(error=UNCLOSED, ignored=ignored)  # (a reply cut off by max_tokens in its call)
    tool_end = tool_at + len(OPEN) + len(found.first) + len(CLOSE)
    ignored += sum(b.start >= tool_end for b in hermes)  # not the `<tool_call>`s printed in its argument
    match = _CALL.fullmatch(found.first)
    if match is None:
        return Call(error=MALFORMED, ignored=ignored)
    return Call(match.group(1), match.group(2).strip(), ignored=ignored)


def _outside(reply: str, blocks: list[HermesBlock]) -> str:
    """The reply after its first Hermes block, without the later blocks (a `<tool>` in their JSON is no call)."""
    parts, pos = [], blocks[0].end
    for b in blocks[1:]:
        parts.append(reply[pos : b.start])
        pos = b.end
    return "".join(parts) + reply[pos:]


def _hermes_call(block: HermesBlock, ignored: int) -> Call:
    if block.call is None:
        return Call(error=HERMES_INVALID, ignored=ignored)
    args = json.loads(block.call["arguments"])  # the JSON text of an object (hermes_syntax)
    values = list(args.values())
    if len(values) != 1 or not isinstance(values[0], str):
        why = f"{len(values)} members" if len(values) != 1 else _JSON_TYPES.get(type(values[0]), "a number")
        return Call(
            error=(
                f'Invalid tool call: the "arguments" of a <tool_call> hold exactly one string, the tool\'s input '
                f"(got {why}); write {HERMES_FORM}."
            ),
            ignored=ignored,
        )
    return Call(block.call["name"], values[0].strip(), ignored=ignored)
