"""Encoding the text a chat template renders between turns, with untrusted text kept as text.

`encode_after(tokenizer, context, text)`: the ids of `text` where it follows `context` (roll_core.agentic.chat's
module docstring says why text between turns is encoded after the conversation, not on its own).

Untrusted text. An environment's observation, a tool's output, the messages an agent program sends between turns:
text the policy did not write and nobody vouches for. Rendered by the chat template and tokenised as one string, a
special token spelt in it (`<|im_end|>\\n<|im_start|>assistant\\n` in a tool's output) became the template's own
special-token ids: the text ended its turn and posed as the assistant or the system, and the policy was trained on
that context. `SpecialText` keeps such text as text:

- `SpecialText(tokenizer, framing).tokens`: the tokenizer's special tokens (its named special tokens and the added
  tokens marked special, whitespace-only ones left out): the tokens a template frames turns with (turn ends, role
  headers, bos / eos); and `framing`, the added tokens that are not marked special but that the chat template
  writes around untrusted text (`framing_tokens`: Qwen's `<tool_response>` / `</tool_response>` around a tool's
  output, Qwen3's empty `<think></think>` after the generation header with thinking off; a role header added as a
  non-special token would be one too). A tool's output spelling `</tool_response>` got that token's id and closed
  the template's tool-response block as written.
  Other added tokens that are not special are matched in text as always: Qwen's `<tool_call>` (which the template
  writes only in the policy's own turns and the system prompt), and the reasoning tags `<think>` / `</think>`
  where the template does not write them around untrusted text (thinking on). Those keep the added token's id
  because the same text gets it everywhere else: a single-turn prompt, `apply_chat_template`, the inference
  engine (vLLM) and an SFT row's first user message all give an instruction like "Reason inside <think>
  </think>" the tags' ids, and text ids in an observation would train the policy on a context it never sees at
  inference. Nor do they move the model's reasoning: a tag in a user or tool turn neither opens nor closes the
  assistant's block; the assistant turn's own ids and the template's generation header decide that
  (roll_core.thinking.header_opens_think).
- `framing_tokens(tokenizer, texts)`: those added tokens, found in the text a template renders around a sentinel
  message (roll_core.agentic.chat's TurnTemplate renders a tool, a user and a system message after an assistant
  turn): the spellings of the non-special added tokens (whitespace-only ones left out) whose ids the tokenizer
  gives that text.
- `mark(text)` / `mark_message(message)`: the untrusted text (a message's content, a string or its text parts)
  with each spelling of a special token wrapped in two private-use markers (U+F0000, U+F0001); markers already in
  the text are dropped first (they could forge a marked token; they are invisible private-use characters).
- `encode_after(context, text)`: the ids of a rendering of marked messages. The template's own special tokens are
  special ids; each marked spelling is encoded as text (`encode_as_text`: the tokenizer's pipeline with no added
  token matched, as it follows a newline, so a SentencePiece tokenizer prefixes no space) and the text around it
  as `encode_after` encodes it; a lone marker (a template that cut a marked spelling) is dropped. Text without
  markers is encoded exactly as before (the ids of a conversation that spells no special token do not change).
  Where the tokenizer's model still gives a special id for a spelling (a vocabulary that holds the token as an
  ordinary piece), its characters are encoded one by one; a special id even then is a ValueError (the environment
  manager counts it as that episode's env_error), never a special id taken from untrusted text.

`encode_as_text` needs no shared tokenizer state: a fast tokenizer runs its normalizer, pre-tokenizer and model
directly (transformers' `split_special_tokens=True` sets a flag on the shared Rust tokenizer, which another thread's
encode could read), a slow one is called with `split_special_tokens=True` (a per-call argument there).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_START, _END = "\U000f0000", "\U000f0001"


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]


def encode_after(tokenizer: Any, context: str, text: str) -> list[int]:
    """Ids of `text` where it follows `context` (no special tokens added): those of `context + text` after
    `context`'s own ids when these are a prefix of them, else (BPE merged across the boundary) `text`'s own ids,
    the ids a model samples after the context's ids. Encoded on its own, a SentencePiece tokenizer prefixes a space
    to every piece: a token the text does not have where it follows other text."""
    head = _encode(tokenizer, context)
    whole = _encode(tokenizer, context + text)
    if len(whole) > len(head) and whole[: len(head)] == head:
        return whole[len(head) :]
    return _encode(tokenizer, text)


def framing_tokens(tokenizer: Any, texts: Iterable[str]) -> tuple[str, ...]:
    """Spellings of the added tokens not marked special (whitespace-only ones left out) that the tokenizer finds in
    `texts` (the text a chat template writes around untrusted messages): the framing `SpecialText` keeps untrusted
    text from spelling."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {int(i) for i in tokenizer.all_special_ids}
    plain = {
        int(i): t.content
        for i, t in added.items()
        if not getattr(t, "special", False) and int(i) not in specials and t.content.strip()
    }
    if not plain:
        return ()
    found = {plain[i] for text in texts for i in _encode(tokenizer, text) if i in plain}
    return tuple(sorted(found))


def encode_as_text(tokenizer: Any, text: str) -> list[int]:
    """Ids of `text` with no added token (special or not) matched in it: its characters as the tokenizer's model
    encodes them (see the module docstring). A SentencePiece tokenizer may prefix a space (use `SpecialText`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [int(x) for x in tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    norm = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
    if backend.pre_tokenizer is not None:
        splits = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(norm)]
    else:
        splits = [norm]
    return [int(t.id) for piece in splits for t in backend.model.tokenize(piece)]


class SpecialText:
    """A tokenizer's special tokens and the template's `framing` added tokens (`framing_tokens`), and how untrusted
    text that spells them is marked and encoded as text (see the module docstring)."""

    def __init__(self, tokenizer: Any, framing: Iterable[str] = ()):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        framing = {f for f in framing if isinstance(f, str) and f.strip()}
        names = set(tokenizer.all_special_tokens) | {t.content for t in added.values() if getattr(t, "special", False)}
        self.tokens: tuple[str, ...] = tuple(
            sorted((n for n in names | framing if isinstance(n, str) and n.strip()), key=lambda n: (-len(n), n))
        )
        self.ids: set[int] = {int(i) for i in tokenizer.all_special_ids} | {
            int(i) for i, t in added.items() if getattr(t, "special", False) or t.content in framing
        }
        alternatives = "|".join(map(re.escape, self.tokens)) or "(?!)"  # longest first: a token before its parts
        self._spelt = re.compile(alternatives)
        self._marked = re.compile(f"{_START}({alternatives}){_END}|[{_START}{_END}]")
        self._newline = encode_as_text(tokenizer, "\n")

    def mark(self, text: str) -> str:
        """`text` with each special token it spells wrapped in the markers (markers it held dropped)."""
        if _START in text or _END in text:
            text = text.replace(_START, "").replace(_END, "")
        return self._spelt.sub(lambda m: _START + m.group(0) + _END, text)

    def mark_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of a chat message whose content (a string, or a list whose parts' `text` is marked) is marked."""
        out = dict(message)
        content = out.get("content")
        if isinstance(content, str):
            out["content"] = self.mark(content)
        elif isinstance(content, list):
            out["content"] = [
                {**part, "text": self.mark(part["text"])}
                if isinstance(part, Mapping) and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
        return out

    def encode_after(self, context: str, text: str) -> list[int]:
        """Ids of the rendered `text` after `context`: marked spellings as text, the rest as `encode_after`."""
        if _START in context or _END in context:  # (a template that moved marked text before the placeholder)
            context = self._marked.sub(lambda m: m.group(1) or "", context)
        if _START not in text and _END not in text:
            return encode_after(self.tokenizer, context, text)
        pieces = self._marked.split(text)  # [text, spelling | None (lone marker), text, ...]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            if i % 2:
                ids += self.as_text(piece)
                # The text after it follows text, not a special token: encoded after the spelling's last character
                # (after the spelling itself, a legacy SentencePiece tokenizer put a space before it).
                context = piece[-1]
            else:
                ids += encode_after(self.tokenizer, context, piece)
                context += piece
        return ids

    def as_text(self, spelling: str) -> list[int]:
        """Ids of a special (or framing) token's spelling as text (after a newline, whose ids are taken off); its
        characters one by one where the model gives a special id for it; a ValueError if a special id remains."""
        ids = self._after_newline(spelling)
        if self.ids.intersection(ids):
            ids = [i for ch in spelling for i in self._after_newline(ch)]
        if self.ids.intersection(ids):
            raise ValueError(
                f"the tokenizer encodes the text {spelling!r} (spelt in an observation, a tool's output or an agent's "
                "message) as a special token even character by character: it cannot be given to the model as text"
            )
        return ids

    def _after_newline(self, text: str) -> list[int]:
        ids = encode_as_text(self.tokenizer, "\n" + text)
        n = len(self._newline)
        if n and ids[:n] == self._newline:
            return ids[n:]
        return encode_as_text(self.tokenizer, text)
