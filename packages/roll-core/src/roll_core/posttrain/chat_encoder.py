"""Chat rows to token ids through a tokenizer's chat template: `ChatEncoder` (moved out of
roll_core.posttrain.tokenize, which re-exports it and uses it for `messages` rows and message-list
`prompt_completion` rows).

Contract: `ChatEncoder(tokenizer, chat_template_kwargs).encode(messages, trained, tools)` gives (prompt ids, response
ids, 0/1 mask) laid out as below, or raises roll_core.posttrain.rows.SkipRow with the reason a row cannot be trained
as given (counted by the caller); a tokenizer without a chat template, or with neither an end-of-turn token nor eos, is
a ConfigError when the encoder is made. The messages are the checked values of roll_core.posttrain.row_values.

Chat layout (the same an agentic RL trajectory has, so SFT trains exactly what sampling produces): the prompt is
`TurnTemplate.initial_messages` of the messages before the first trained assistant turn; each assistant turn is its
rendered text (the template's rendering of that turn as the conversation's last message, minus the turn's closing:
Qwen3's `<think>` block kept, Llama 3's trimming applied) encoded after the rendered conversation before it
(`encode_after`), plus the end-of-turn token (the template's end-of-turn special token, else the tokenizer's eos: what
sampling stops on and the model must learn to emit; a turn the template ends with an alternative end token, Llama
3.1's `<|eom_id|>` after a built-in tool call, ends with that one); between turns, `TurnTemplate.continuation` (the
rest of the closing, the next messages, the next generation header) with mask 0, and between two assistant turns in a
row the first's closing and the next one's header. An assistant turn whose text the template drops in part (a
`<think>` block it strips) is skipped (`template_drops_content`): trained as rendered, the model would learn to answer
without it. Mask 1 covers exactly the trained assistant turns' ids and their end-of-turn tokens; untrained assistant
turns after the first trained one are context (mask 0); messages after the last trained turn are dropped (a blank
untrained turn is context too, as the template renders it: typically a bare end of turn). An assistant turn to train
that is blank (empty or whitespace text, no tool calls) is skipped (`empty`), whatever the template renders for it
(ChatML a bare end-of-turn token, Qwen3 an empty think block): the model would learn to end its turn without
answering; so is blank text of a prompt, completion or preference response. A template that does not render what a row
gives it is a counted skip, not a row trained without it: the row's `tools` (`template_drops_tools`: the model would
call tools it was never shown) or the tool calls of an assistant turn after the prompt (`template_drops_tool_calls`:
the model would learn to announce a call and end its turn without making it). Whether a template renders tools
and tool calls at all is probed once per tokenizer, template and template arguments (on probe messages, cached),
not per row; a row whose prompt lacks one of its tools' names, or a turn whose rendering lacks one of its calls'
names, is skipped alike (a template that renders them only in some conversations). A name counts where the
template adds it for the tools, not where a message spells it (a user asking to "use add"): a prompt whose
messages (or whose template's own text) may spell a name is rendered without its tools too, and must spell every
name more often with them. Probe results are looked up by the template the tokenizer has at each lookup. A tool
call's `arguments` given as JSON text is parsed to the object it spells when the template `tojson`s arguments
(Qwen2.5's, Llama 3.1's): rendered as given, the model would learn escaped JSON in a string; text that is not JSON
is then a `wrong_type` skip. Templates that write text arguments as they are (Qwen3's, DeepSeek's) get the text.

Roles other than system / user / assistant / tool (Llama 3.1's `ipython` and GLM's `observation` tool results,
OpenAI's legacy `function` results and its `developer`, a data set's own role) are context wherever they stand, in
the prompt or between trained turns, as a `tool` message is (mask 0, never trained); the content of a tool result
(`TOOL_RESULT_ROLES`) is untrusted text in the prompt too (roll_core.agentic.chat: a special token it spells is
text). Each row holding such a role is rendered once with their contents replaced by sentinels, up to its last
trained turn: a template that raises on the role (Qwen's, Gemma's after an assistant turn) or drops it (renders no
sentinel) is a `template_drops_role` skip naming the role, not a `template_error`, nor a row trained without it.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Mapping
from typing import Any

from roll_core.agentic.chat import ALT_TURN_ENDS, TurnTemplate, encode_after
from roll_core.errors import ConfigError
from roll_core.posttrain.row_values import blank, tool_call_names
from roll_core.posttrain.rows import SkipRow

__all__ = ["TOOL_RESULT_ROLES", "ChatEncoder"]

#: Roles whose messages are a tool's output (OpenAI's `tool` and legacy `function`, Llama 3.1's `ipython`, GLM's
#: `observation`): untrusted text in a prompt, as between turns (module doc).
TOOL_RESULT_ROLES = ("tool", "function", "ipython", "observation")
_TEMPLATE_ROLES = ("system", "user", "assistant", "tool")  # the roles every chat template is written for
_ROLE_SENTINEL = "\u2063ROLL-ROLE-{}\u2063"

_PLACEHOLDER = "\u2063ROLL-SFT-ASSISTANT\u2063"
_ARGS_PROBE = '{"roll_probe": 1}'  # tool-call arguments as text: a template that tojsons them writes them quoted
_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {"name": "roll_probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
    }
]
_PROBE_CALL = {"id": "rollprobe", "type": "function", "function": {"name": "roll_probe", "arguments": {}}}
# tokenizer -> {(template, its arguments, special tokens) as JSON: {probe name: result}} (see ChatEncoder.renders)
_PROBES: weakref.WeakKeyDictionary[Any, dict[str, dict[str, bool | None]]] = weakref.WeakKeyDictionary()


def _probe_cache(
    tokenizer: Any, kwargs: Mapping[str, Any], own: dict[str, dict[str, bool | None]]
) -> dict[str, bool | None]:
    """The probe results of one tokenizer's current template with `kwargs` (shared by every ChatEncoder of it;
    `own`: an encoder's cache, for a tokenizer that cannot be weakly referenced). Keyed by the template string read
    now, at each lookup: a template set on the tokenizer after its encoder was made is probed anew (the encoder kept
    the results of the one it was made with)."""
    key = json.dumps(
        [tokenizer.chat_template, kwargs, getattr(tokenizer, "special_tokens_map", None)], sort_keys=True, default=repr
    )
    try:
        per_template = _PROBES.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: probed once per encoder instead
        per_template = own
    return per_template.setdefault(key, {})


class ChatEncoder:
    """Chat rows to (prompt ids, response ids, mask) through one tokenizer's chat template (see module doc)."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the tokenizer has no chat template: chat rows need one (give a tokenizer with a template, or "
                "prompt/completion text rows with data.chat_template=false)"
            )
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self._own_probes: dict[str, dict[str, bool | None]] = {}  # see _probe_cache
        self.turns = TurnTemplate(tokenizer, chat_template_kwargs=self.kwargs)
        closing = self.turns.encode(self.turns.closing)
        if closing and closing[0] in self.turns.turn_end_ids:
            self.end_id = closing[0]  # ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn> ...
        elif tokenizer.eos_token_id is not None:
            self.end_id = int(tokenizer.eos_token_id)  # a template without an end-of-turn token: sampling stops on eos
        else:
            raise ConfigError("the tokenizer has neither an end-of-turn token in its chat template nor an eos token")
        last = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}], False)
        # What a template writes after the last assistant turn's content (e.g. "<|im_end|>\n"; Phi-3 adds eos).
        self.final_closing = last[last.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        # (closing text, end-of-turn id) an assistant turn may end with: the usual one, and a template's alternative
        # end in its place (Llama 3.1's <|eom_id|> after a built-in tool call, with builtin_tools set): that turn was
        # a template_mismatch skip, and the model must learn to end it with <|eom_id|>, what it samples there.
        self.closings = [(self.final_closing, self.end_id)]
        end_text = tokenizer.decode([self.end_id])
        if end_text and self.final_closing.startswith(end_text):
            for alt in ALT_TURN_ENDS.get(end_text, ()):
                alt_id = tokenizer.convert_tokens_to_ids(alt)
                if alt_id in self.turns.turn_end_ids:  # (a special token of this tokenizer: Llama 3.0 has none)
                    self.closings.append((alt + self.final_closing[len(end_text) :], int(alt_id)))

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> str:
        kwargs = dict(self.kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def assistant_ids(self, history: list[dict[str, Any]], message: dict[str, Any], tools: Any = None) -> list[int]:
        """Ids of one assistant turn as the model would generate it after `history`: the template's rendering of
        the turn (as the conversation's last message) without its closing, then the end-of-turn id. A blank turn
        (context: `encode` refuses a blank one to train) may render to no text: its ids are the end-of-turn id."""
        before = self._render(history, True, tools)
        full = self._render([*history, message], False, tools)
        closing, end_id = next(((c, i) for c, i in self.closings if full.endswith(c)), (None, self.end_id))
        if not full.startswith(before) or closing is None:
            same = next((k for k, (a, b) in enumerate(zip(before, full)) if a != b), min(len(before), len(full)))
            raise SkipRow(
                "template_mismatch",
                "the chat template renders the conversation before this assistant turn differently with the turn "
                f"after it (the generation prompt ends {before[same:][:40]!r} where the turn has "
                f"{full[same:][:40]!r}: e.g. a header that opens <think> for a turn whose reasoning the template "
                "drops), so the turn's text cannot be isolated",
            )
        text = full[len(before) : len(full) - len(closing)]
        if message.get("tool_calls"):
            # a template without tool support renders the text alone (ChatML, Phi-3). Probed once (`renders`); a
            # call whose name is not in the turn's rendering is not rendered either (the name in the turn's text
            # alone proves nothing: the text may well name the function, hence the probe)
            renders = self.renders("tool_calls")
            if renders is None:  # the probe could not tell: the same turn without its calls, as this row has it
                bare = {k: v for k, v in message.items() if k != "tool_calls"}
                renders = self._render([*history, {**bare, "content": bare.get("content") or ""}], False, tools) != full
            if not renders or not all(name in text for name in tool_call_names(message)):
                raise SkipRow(
                    "template_drops_tool_calls",
                    f"the chat template does not render this assistant turn's call of {tool_call_names(message)}: "
                    "trained as rendered, the model would end its turn without making the call. Use a template "
                    "with tool support",
                )
        if not text and not blank(message):
            raise SkipRow("empty", "an assistant turn renders to no text")
        content = message.get("content")
        if isinstance(content, str) and not _kept(content, text):
            raise SkipRow(
                "template_drops_content",
                "the chat template drops part of this assistant turn (its <think> reasoning, say): training on what "
                "it renders would teach the model to answer without it. Use a template that keeps it (Qwen3's "
                "keeps the last turn's), or rows without it",
            )
        return [*(encode_after(self.tokenizer, before, text) if text else []), end_id]

    def renders(self, what: str) -> bool | None:
        """Whether the template renders `what` at all, probed once per tokenizer, template and template arguments on
        probe messages (None when the probe conversation fails to render: each row is then checked on its own):
        `tools` (the schemas in a prompt), `tool_calls` (an assistant turn's calls), `tojson` (a call's text
        arguments written quoted, `| tojson`: Qwen2.5's, Llama 3.1's)."""
        probes = _probe_cache(self.tokenizer, self.kwargs, self._own_probes)  # the template set now
        if what not in probes:
            probes[what] = self._probe(what)
        return probes[what]

    def _probe(self, what: str) -> bool | None:
        try:
            if what == "tools":
                return self._render([_PROBE_USER], True, _PROBE_TOOLS) != self._render([_PROBE_USER], True)
            bare = {"role": "assistant", "content": ""}
            if what == "tool_calls":
                turn = {**bare, "tool_calls": [_PROBE_CALL]}
                return self._render([_PROBE_USER, turn], False) != self._render([_PROBE_USER, bare], False)
            if what == "tojson":
                call = {"type": "function", "function": {"name": "roll_probe", "arguments": _ARGS_PROBE}}
                text = self._render([_PROBE_USER, {**bare, "tool_calls": [call]}], False)
                return json.dumps(_ARGS_PROBE, ensure_ascii=False) in text
        except Exception:  # the probe messages do not suit this template: tojson no, the others row by row
            return False if what == "tojson" else None
        raise ValueError(f"unknown template probe {what!r}")

    def tojsons_arguments(self) -> bool:
        """Whether the template writes a tool call's text `arguments` quoted (`| tojson`: Qwen2.5's, Llama 3.1's)."""
        return bool(self.renders("tojson"))

    def _parse_arguments(self, message: dict[str, Any]) -> dict[str, Any]:
        """The message with its tool calls' JSON-text `arguments` parsed, where the template tojsons them."""
        calls = [(c, isinstance(c.get("function"), Mapping)) for c in message.get("tool_calls") or ()]
        text_args = any(isinstance((c["function"] if n else c).get("arguments"), str) for c, n in calls)
        if not text_args or not self.tojsons_arguments():
            return message
        out = []
        for call, nested in calls:
            function = dict(call["function"] if nested else call)
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError as exc:
                    text = function["arguments"][:60]
                    why = f"a tool call's arguments are text that is not JSON ({exc.msg}): {text!r}"
                    raise SkipRow("wrong_type", why + "; the chat template writes them as JSON") from None
            out.append({**call, "function": function} if nested else function)
        return {**message, "tool_calls": out}

    def _prompt_has_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], ids: list[int]) -> bool:
        """Whether a prompt (`messages`, its `ids`) shows its tools: the template renders tools (`renders`), and
        every tool's name is in what the template adds for them: the prompt rendered with its tools spells the name
        more often than without them. A name the messages or the template's own text may spell (a user asking to
        "use add", an earlier call of it, a tool named like a header) proved nothing when looked up in the whole
        prompt: a template that shows tools only in some conversations trained the row without them. Only then is
        the prompt rendered without its tools; otherwise the name in the prompt can only come from its tools."""
        renders = self.renders("tools")
        if renders is False:
            return False
        functions = [t["function"] if isinstance(t.get("function"), Mapping) else t for t in tools]
        names = [f["name"] for f in functions if isinstance(f.get("name"), str) and f["name"]]
        if renders and names and not self._may_spell(messages, names):
            text = self.tokenizer.decode(ids)
            return all(name in text for name in names)
        shown, bare = self._render(messages, True, tools), self._render(messages, True)
        if not names:
            return shown != bare
        return all(shown.count(name) > bare.count(name) for name in names)

    def _may_spell(self, messages: list[dict[str, Any]], names: list[str]) -> bool:
        """Whether a prompt may spell one of its tools' `names` without its tools: a message's text (content, tool
        calls) or the template's arguments hold it, or the template's own text holds it as a word."""
        given = json.dumps([messages, self.kwargs], ensure_ascii=False, default=repr)
        template = str(self.tokenizer.chat_template or "")
        word = "|".join(re.escape(n) for n in names)
        return any(n in given for n in names) or re.search(rf"(?<![\w-])(?:{word})(?![\w-])", template) is not None

    def _check_roles(self, context: list[dict[str, Any]], tools: Any) -> None:
        """A `template_drops_role` skip when the template does not render a message of a role other than
        `_TEMPLATE_ROLES` in `context` (the conversation before the last trained turn): rendered with each such
        message's content a sentinel, it raises (and renders those messages as user turns), or leaves a sentinel
        out. A template that raises either way is left to `encode` (its `template_error`: not the role's doing)."""
        odd = [i for i, m in enumerate(context) if m["role"] not in _TEMPLATE_ROLES]
        if not odd:
            return
        roles = sorted({context[i]["role"] for i in odd})
        probe = [{**m, "content": _ROLE_SENTINEL.format(i)} if i in odd else m for i, m in enumerate(context)]
        try:
            text = self._render(probe, True, tools)
        except Exception as exc:
            as_user = [{"role": "user", "content": m["content"]} if i in odd else m for i, m in enumerate(probe)]
            try:
                self._render(as_user, True, tools)
            except Exception:
                return
            raise SkipRow(
                "template_drops_role",
                f"the chat template cannot render a message of role {' or '.join(map(repr, roles))} here "
                f"({type(exc).__name__}: {str(exc)[:120]}; the row renders with user turns in their place). Use a "
                "template that renders the role (Llama 3.1's renders ipython tool results, GLM's observation ones), "
                "or write the messages in a role this one renders ('tool' for a tool's output)",
            ) from None
        dropped = [i for i in odd if _ROLE_SENTINEL.format(i) not in text]
        if dropped:
            i = dropped[0]
            raise SkipRow(
                "template_drops_role",
                f"the chat template drops message {i} of role {context[i]['role']!r} (it renders no turn for it): "
                "trained without it, the model would answer a context it was never shown. Use a template that "
                "renders the role, or write the messages in a role this one renders ('tool' for a tool's output)",
            )

    def encode(
        self, messages: list[dict[str, Any]], trained: list[bool], tools: Any = None
    ) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, mask) of a conversation; `trained[i]` says whether assistant message i is
        trained (ignored for other roles)."""
        idx = [i for i, m in enumerate(messages) if m["role"] == "assistant" and trained[i]]
        if not idx:
            roles = sorted({m["role"] for m in messages})
            marked = " (each is marked train: false / weight: 0)" if "assistant" in roles else ""
            why = f"no assistant message to train on{marked}: the roles are {roles}; expected 'assistant' turns after "
            raise SkipRow("no_assistant_turn", why + "'system' / 'user' / 'tool' ones (ShareGPT's 'gpt' after 'human')")
        first, last = idx[0], idx[-1]
        if first == 0:
            raise SkipRow("no_prompt", "the conversation starts with the assistant turn to train: it has no prompt")
        clean = [self._parse_arguments({k: v for k, v in m.items() if k not in ("train", "weight")}) for m in messages]
        self._check_roles(clean[:last], tools)
        try:
            prompt = self.turns.initial_messages(clean[:first], tools, untrusted_roles=TOOL_RESULT_ROLES)
            if tools and not self._prompt_has_tools(clean[:first], tools, prompt):
                raise SkipRow(
                    "template_drops_tools",
                    f"the chat template does not render the row's {len(tools)} tool schema(s): the model would "
                    "learn to call tools its prompt never shows. Use a template with tool support",
                )
            response: list[int] = []
            mask: list[int] = []
            previous: list[int] = []
            i = first
            while i <= last:
                if clean[i]["role"] == "assistant":
                    if trained[i] and blank(clean[i]):
                        # some templates render it as a bare end of turn (Qwen3 an empty think block before it):
                        # the model would learn to end its turn without answering
                        raise SkipRow("empty", f"assistant message {i} to train is blank ({clean[i]['content']!r})")
                    ids = self.assistant_ids(clean[:i], clean[i], tools)
                    response += ids
                    mask += [int(trained[i])] * len(ids)
                    previous = ids
                    i += 1
                    if i <= last and clean[i]["role"] == "assistant":
                        # two assistant turns in a row: the first's closing and the next one's header between them,
                        # as the template renders them (the model never continues right after its end of turn)
                        between = self.turns.continuation([], tools, response_ids=previous)
                        response += between
                        mask += [0] * len(between)
                    continue
                j = i
                while clean[j]["role"] != "assistant":
                    j += 1
                ids = self.turns.continuation(clean[i:j], tools, response_ids=previous)
                response += ids
                mask += [0] * len(ids)
                i = j
        except SkipRow:
            raise
        except Exception as exc:  # jinja errors, TurnTemplate's ValueErrors (roles a template cannot continue)
            raise SkipRow("template_error", f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        return prompt, response, mask


def _kept(content: str, rendered: str) -> bool:
    """Whether an assistant message's text survives its rendering: the reasoning of a `<think>...</think>` block and
    the answer after it each appear (templates may re-space them), or the stripped content does."""
    if "</think>" in content:
        reasoning, _, answer = content.partition("</think>")
        reasoning = reasoning.replace("<think>", "").strip()
        return (not reasoning or reasoning in rendered) and (not answer.strip() or answer.strip() in rendered)
    return content.strip() in rendered
