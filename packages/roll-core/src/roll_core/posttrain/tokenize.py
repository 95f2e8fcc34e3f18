"""SFT rows to token rows: a prompt, a response region and its loss mask, as a sampled trajectory would hold them.

Row forms (`detect_format` picks one per file from its columns, or `data.format` names it):
- `messages`: `{"messages": [{"role", "content"}, ...]}` (optional `tools` column: a list of tool schemas, or that
  list as JSON text; an assistant message's `tool_calls` likewise, each call naming its function). Every assistant
  message is trained unless it has `"train": false` or OpenAI's `"weight": 0` (a `train` that is not true, false or
  null, or a `weight` that is not 0 or 1, is a `wrong_type` skip); system / user / tool messages are context.
  ShareGPT rows alike (LLaMA-Factory's `sharegpt` format): a `conversations` column (when the row has no
  `messages`) of `{"from", "value"}` messages, read by roll_core.posttrain.row_values (human / gpt / system /
  function_call / observation; another `from` is an `unknown_role` skip), with its `system` and `tools` columns.
  What a row's values may hold (and each skip they give) is row_values' contract; this module tokenises them.
- `prompt_completion`: `{"prompt": str | messages, "completion": str | messages}` (TRL's standard and
  conversational forms). Text with `data.chat_template=true` becomes a user message and an assistant message;
  with false, the prompt's ids (the tokenizer's leading special tokens added, e.g. bos, unless the text already
  starts with them; none after it) then the completion's ids (`encode_after` the prompt) and eos (unless the text
  already ends with it).
  Message lists always go through the chat template; only the completion's assistant messages are trained.
- `tokens`: `{"prompt_ids": [...], "response_ids": [...], "response_mask"?: [...]}` (rollout-only output): no
  re-tokenisation; the ids must be in the vocabulary.

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

Ids after a context (`encode_after`): text is tokenised together with the text before it and the context's own ids
are taken off, when they are a prefix of the whole's (else, where BPE merges across the boundary, on its own: the ids
a model samples after the context's ids). Encoded on its own, a SentencePiece tokenizer prefixes a space to every
piece ("▁" before " It is 4": a token the text does not have, that the model would learn to emit first).

Length: a prompt longer than `max_prompt_length` is skipped (`prompt_too_long`); a response region longer than
`max_response_length` is cut (`TokenRow.truncated`), or skipped (`response_too_long`) when `data.truncate=false`.

`tokenizer_fingerprint(tokenizer)` hashes what decides token ids (the vocabulary, the tokenisation model's merges
and settings, the added and special tokens, the chat template, and the ids of probe texts for the normalizer,
pre-tokenizer and post-processor), not how a library version serialises them, so a teacher's and a student's
tokenizers can be compared by a string, and a file stamped with it stays valid across library upgrades.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_core.agentic.chat import ALT_TURN_ENDS, TurnTemplate, encode_after
from roll_core.errors import ConfigError
from roll_core.near_duplicates import loose_text
from roll_core.posttrain._fingerprint import FINGERPRINT_PROBES, legacy_tokenizer_fingerprint, tokenizer_fingerprint
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.row_values import (
    SHAREGPT_COLUMN,
    blank,
    check_ids,
    check_messages,
    check_text,
    check_tools,
    need,
    row_messages,
    tool_call_names,
    train_flag,
)
from roll_core.posttrain.rows import RawRow, SkipRow

# The fingerprint and the row value checks live in sibling modules (this one's size) and stay part of this module's
# API (row_values: what a row's columns may hold; this module: how they become ids).
__all__ = [
    "FINGERPRINT_PROBES",
    "SFT_FORMATS",
    "ChatEncoder",
    "SFTTokenizer",
    "TokenRow",
    "blank",
    "check_ids",
    "check_messages",
    "check_text",
    "check_tools",
    "detect_format",
    "legacy_tokenizer_fingerprint",
    "loose_prompt_keys",
    "need",
    "row_format",
    "tokenizer_fingerprint",
    "tool_call_names",
    "train_flag",
]

log = logging.getLogger(__name__)

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


SFT_FORMATS = ("messages", "prompt_completion", "tokens")


@dataclass
class TokenRow:
    """One tokenised example: `prompt_ids`, `response_ids` and the 0/1 loss `mask` over them, where it came from,
    `key` (its prompt ids exactly: pairing, and the hash that decides its held-out side; `loose_prompt_keys` says
    which prompts are one problem but for whitespace), `aligned` sequences (first dimension: one item per
    response token, e.g. a teacher's top-k as an (R, K) tensor) that are cut with the response, and `truncated`
    (the length limit cut its response)."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[int]
    where: str = ""
    key: str = ""
    aligned: dict[str, list[Any]] = field(default_factory=dict)
    truncated: bool = False


def loose_prompt_keys(tokenizer: Any, prompts: Sequence[Sequence[int]]) -> list[str]:
    """A near-duplicate key per prompt (token ids): prompts with equal keys are one problem to a model but for
    whitespace ("Q?" and "Q?\\n", a doubled space), as the RL tasks' held-out split sees them
    (roll_core.near_duplicates). Each run of text between the tokenizer's special and added tokens (ChatML's
    `<|im_start|>`, Llama 3's headers: where a template puts the message) is decoded and whitespace-collapsed
    (`loose_text`), so whitespace at a message's ends is gone too; the tokens themselves are kept by id.

    Why not `TokenRow.key` (the exact ids): "Q?" and "Q?\\n" tokenise to other ids, so they were counted as
    distinct prompts and could fall on both sides of a held-out split."""
    marks = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    runs: list[list[int]] = []  # every prompt's text runs, decoded in one call (a fast tokenizer batches them)
    shapes: list[list[int | None]] = []  # per prompt: a mark's id, or None for the next text run
    for ids in prompts:
        shape: list[int | None] = [None]
        runs.append([])
        for t in ids:
            t = int(t)
            if t in marks:
                shape += [t, None]
                runs.append([])
            else:
                runs[-1].append(t)
        shapes.append(shape)
    texts = iter(tokenizer.batch_decode(runs, clean_up_tokenization_spaces=False) if runs else [])
    # JSON of [text, id, text, ...]: a mark and a text that spells its id stay apart
    return [json.dumps([loose_text(next(texts)) if p is None else p for p in shape]) for shape in shapes]


# ---- format detection -------------------------------------------------------------------------------------------
def row_format(row: Mapping[str, Any], cfg: DataConfig) -> str | None:
    """The form a row's columns spell (None when none): preference and rollout before the SFT forms, since a
    rollout row has prompt_ids and response_ids too."""
    if cfg.chosen_key in row and cfg.rejected_key in row:
        return "preference"
    if cfg.prompt_ids_key in row and cfg.response_ids_key in row:
        return "rollout" if (cfg.reward_key in row or cfg.correct_key in row) else "tokens"
    if cfg.messages_key in row or SHAREGPT_COLUMN in row:
        return "messages"
    if cfg.prompt_key in row and cfg.completion_key in row:
        return "prompt_completion"
    return None


def detect_format(rows: Sequence[RawRow], cfg: DataConfig, allowed: Sequence[str], setting: str) -> str:
    """The form of one file's rows: `data.format` when set, else the most common form among its first 100 rows
    (a few bad rows do not decide it). A ConfigError naming the columns when no row has an allowed form."""
    if cfg.format != "auto":
        if cfg.format not in allowed:
            raise ConfigError(f"data.format={cfg.format!r} cannot feed this pipeline; it reads {', '.join(allowed)}")
        return cfg.format
    votes: dict[str, int] = {}
    for raw in rows[:100]:
        form = row_format(raw.row, cfg)
        if form == "rollout" and "rollout" not in allowed and "tokens" in allowed:
            form = "tokens"  # rollout-only output is also SFT / distillation token rows
        if form in allowed:
            votes[form] = votes.get(form, 0) + 1
    if not votes:
        keys = sorted({k for r in rows[:100] for k in r.row})[:20]
        raise ConfigError(
            f"{setting}: cannot tell the row form of {rows[0].file if rows else 'the file'} from its columns "
            f"{keys}; expected one of {', '.join(allowed)} (set data.format, or the data.*_key column names)"
        )
    return max(votes, key=lambda f: votes[f])


# ---- chat rendering ---------------------------------------------------------------------------------------------
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
        try:
            prompt = self.turns.initial_messages(clean[:first], tools)
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


# ---- SFT rows ---------------------------------------------------------------------------------------------------
def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _leading_specials(with_specials: list[int], text_ids: list[int]) -> list[int] | None:
    """The ids a tokenizer puts before a text's ids when it adds its special tokens (bos): those before the text's
    ids inside the ids with special tokens (None when they are not there whole)."""
    n = len(text_ids)
    for start in range(len(with_specials) - n + 1):
        if with_specials[start : start + n] == text_ids:
            return with_specials[:start]
    return None


def _kept(content: str, rendered: str) -> bool:
    """Whether an assistant message's text survives its rendering: the reasoning of a `<think>...</think>` block and
    the answer after it each appear (templates may re-space them), or the stripped content does."""
    if "</think>" in content:
        reasoning, _, answer = content.partition("</think>")
        reasoning = reasoning.replace("<think>", "").strip()
        return (not reasoning or reasoning in rendered) and (not answer.strip() or answer.strip() in rendered)
    return content.strip() in rendered


class SFTTokenizer:
    """SFT (and distillation) rows of one form to `TokenRow`s, with the length limits applied."""

    def __init__(self, tokenizer: Any, cfg: DataConfig, *, max_prompt_length: int, max_response_length: int) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.max_prompt, self.max_response = max_prompt_length, max_response_length
        self.vocab = len(tokenizer)
        self._chat: ChatEncoder | None = None

    @property
    def chat(self) -> ChatEncoder:
        if self._chat is None:
            self._chat = ChatEncoder(self.tokenizer, self.cfg.chat_template_kwargs)
        return self._chat

    def parse(self, raw: RawRow, form: str) -> TokenRow:
        """One row of form `form` to a TokenRow within the length limits (SkipRow otherwise)."""
        row = self.tokens(raw.row, form)
        row.where = raw.where
        return self.limit(row)

    def tokens(self, row: Mapping[str, Any], form: str) -> TokenRow:
        """The row's ids and mask before length limits."""
        cfg = self.cfg
        if form == "tokens":
            prompt = check_ids(need(row, cfg.prompt_ids_key), cfg.prompt_ids_key, self.vocab)
            response = check_ids(need(row, cfg.response_ids_key), cfg.response_ids_key, self.vocab)
            mask = [1] * len(response)
            if row.get(cfg.response_mask_key) is not None:
                mask = row[cfg.response_mask_key]
                bits = isinstance(mask, (list, tuple)) and all(
                    isinstance(m, (int, float)) and m in (0, 1) for m in mask
                )
                if not bits or len(mask) != len(response):  # nested lists too (a set of them raised TypeError)
                    raise SkipRow(
                        "bad_mask", f"{cfg.response_mask_key!r} must be 0/1, one per response id ({len(response)})"
                    )
                mask = [int(m) for m in mask]
            return TokenRow(prompt, response, mask, key=json.dumps(prompt))
        if form == "messages":
            messages = row_messages(row, cfg.messages_key)
            trained = [train_flag(m) for m in messages]
            return self.chat_row(messages, trained, row.get("tools"))
        if form == "prompt_completion":
            prompt, completion = need(row, cfg.prompt_key), need(row, cfg.completion_key)
            if isinstance(prompt, str) and isinstance(completion, str) and not cfg.chat_template:
                return self.raw_text(check_text(prompt, cfg.prompt_key), check_text(completion, cfg.completion_key))
            p = self.as_messages(prompt, cfg.prompt_key, "user")
            c = self.as_messages(completion, cfg.completion_key, "assistant")
            trained = [False] * len(p) + [train_flag(m) for m in c]
            return self.chat_row(p + c, trained, row.get("tools"))
        raise ValueError(f"not an SFT row form: {form!r} (one of {', '.join(SFT_FORMATS)})")

    def as_messages(self, value: Any, key: str, role: str) -> list[dict[str, Any]]:
        """Text as one message of `role`, or a message list checked."""
        if isinstance(value, str):
            return [{"role": role, "content": check_text(value, key)}]
        return check_messages(value, key)

    def chat_row(self, messages: list[dict[str, Any]], trained: list[bool], tools: Any) -> TokenRow:
        """A conversation through the chat template (`trained[i]`: assistant message i is trained)."""
        prompt, response, mask = self.chat.encode(messages, trained, check_tools(tools))
        return TokenRow(prompt, response, mask, key=json.dumps(prompt))

    def raw_text(self, prompt: str, completion: str) -> TokenRow:
        """Text without a template: the tokenizer's leading special tokens (bos) and the prompt's ids, then the
        completion's ids as they follow the prompt, then eos (see the module doc)."""
        tok = self.tokenizer
        if tok.eos_token_id is None:
            raise ConfigError("data.chat_template=false needs a tokenizer with an eos token to end each completion")
        eos = int(tok.eos_token_id)
        text_ids = _encode(tok, prompt)
        with_specials = list(tok(prompt, add_special_tokens=True)["input_ids"])
        lead = _leading_specials(with_specials, text_ids)
        if lead is None:  # a post-processor that rewrites the text's ids: take what it gives
            prompt_ids = with_specials
        else:
            if text_ids[: len(lead)] == lead:
                lead = []  # text pre-rendered with its bos: a second one is input the model never saw in training
            # only the leading ones: a post-processor that appends eos (add_eos_token) ended the prompt with eos
            prompt_ids = [*lead, *text_ids]
        response = encode_after(tok, prompt, completion)
        if not response or response[-1] != eos:  # a completion whose text ends with eos is not ended twice
            response.append(eos)
        return TokenRow(prompt_ids, response, [1] * len(response), key=json.dumps(prompt_ids))

    def limit(self, row: TokenRow) -> TokenRow:
        """The length limits: a long prompt is skipped, a long response cut (counted) or skipped."""
        if len(row.prompt_ids) > self.max_prompt:
            raise SkipRow(
                "prompt_too_long", f"{len(row.prompt_ids)} prompt tokens > max_prompt_length={self.max_prompt}"
            )
        if not row.prompt_ids:
            raise SkipRow("empty", "the prompt has no tokens (the first response token would have no context)")
        if len(row.response_ids) > self.max_response:
            if not self.cfg.truncate:
                raise SkipRow(
                    "response_too_long",
                    f"{len(row.response_ids)} response tokens > max_response_length={self.max_response} "
                    "(data.truncate=false)",
                )
            n = self.max_response
            row.response_ids, row.mask = row.response_ids[:n], row.mask[:n]
            row.aligned = {k: v[:n] for k, v in row.aligned.items()}
            row.truncated = True  # counted by the RowSource that keeps it (a row skipped after its cut is not)
        if not any(row.mask):
            raise SkipRow("no_trained_tokens", "no response token has loss mask 1")
        return row
