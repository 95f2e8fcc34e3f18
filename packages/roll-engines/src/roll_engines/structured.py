"""Structured outputs: the allowed-token masks of a JSON schema / regex constraint (outlines-core), for sampling
and for the trainer's replay.

Contract:
- A constraint (roll_core.interfaces.inference.StructuredOutput) becomes one regex: a regex as given, a JSON schema
  through outlines-core's `build_regex_from_schema`. The vLLM and SGLang adapters send that same regex, so every
  engine constrains the same language. A schema with a restricting keyword outlines-core drops silently (minimum,
  uniqueItems, a several-schema allOf, a keyword beside the one outlines-core reads there, a pattern or format whose
  text is not JSON, a oneOf whose branches are not shown exclusive, an empty enum / anyOf list, a required property
  holding a recursive $ref: roll_engines._structured_schema) is refused, not sampled from a larger language; an
  any-value `{}` below the root is sent grouped (outlines-core pasted its alternation into the text around it).
  A regex valid in Python but outside outlines-core's dialect (anchors, lookarounds,
  word boundaries, backreferences, ...: `_UNSUPPORTED_REGEX`) is refused naming the construct, and every regex is
  compiled once over a byte vocabulary, so that each engine's `check_sampling` fails on what vLLM / SGLang would fail
  on only when the request is submitted. Unicode classes ('\\d', '\\w', '\\s') follow Rust's tables, not Python's: they
  differ on a few characters outside ASCII.
- The token vocabulary is reduced exactly as vLLM's outlines backend does (token -> the bytes it decodes to; special
  tokens and EOS left out; EOS is allowed where the regex is complete), built once per tokenizer and cached; a
  compiled index is cached per (tokenizer, regex).
- `Matcher` walks one sequence: `keep(V)` is the (V,) bool mask of ids allowed next, `advance(token)` moves on
  (False when the token was not allowed: the trainer's replay counts it; the sampler fails the request with a
  `ConstraintViolation`, as it does when a state allows no id below the logits width V, which a tokenizer with ids
  the model has no logits for can cause: sampling from that row would ignore the constraint). Masks are cached per
  (regex, state), so a long response in a JSON string (one state, ~all tokens allowed) costs one mask, not one per
  token; allowed ids at or past V are dropped with a warning (once per vocabulary and V).
- The constraint's EOS in a complete match ends the constraint (`Matcher.done`): nothing is masked after it, as vLLM's
  outlines backend fills a full bitmask once its grammar terminated. Only `ignore_eos` generates past that EOS; its
  tokens are then the same unconstrained policy on every engine and in the replay.
- The constrained distribution at a step is softmax over the allowed ids of the logits (after temperature), the
  others masked (`mask_logits`). Sampling masks before top-k/top-p, so the engine's processed log-probs are those
  of the constrained distribution; `replay_mask` gives the trainer the same masks from the response tokens.
- Masked entries get the most negative finite float rather than -inf: softmax gives them exactly 0, and an entropy
  (p * logit summed) stays finite (0 * -inf would be NaN).

outlines-core is optional (`roll-engines[structured]`); a missing one is one line naming the extra.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from roll_core.errors import Extra
from roll_core.interfaces.inference import STRUCTURED_ENGINES, STRUCTURED_KEY, StructuredOutput, structured_from_rows
from roll_engines._structured_schema import byte_vocabulary, check_schema

log = logging.getLogger(__name__)

STRUCTURED = Extra(
    "outlines_core",
    "SamplingParams.structured (JSON schema / regex outputs)",
    "outlines-core",
    "roll-engines[structured]",
)

#: Engines that constrain decoding (roll's own names); others refuse a request that carries `structured`.
INFER_ENGINES = STRUCTURED_ENGINES
#: Training engines whose log-probs replay the constraint (fsdp2 shares the hf engine's forward).
TRAIN_ENGINES = ("hf", "fsdp2")


def refuse_constrained_batch(batch: Any, engine: str) -> None:
    """Raise for a batch with constrained rows on a training engine that cannot replay constraints: its log-probs
    would be of the unconstrained policy, a different one from the sampler's."""
    encoded = batch.get(STRUCTURED_KEY) if hasattr(batch, "get") else None
    if encoded is not None and bool(encoded.any()):
        raise ValueError(
            f"train_engine={engine} cannot compute log-probs under structured-output constraints (the batch's "
            f"{STRUCTURED_KEY!r} rows): use train_engine={' or '.join(TRAIN_ENGINES)}, or sample without "
            "SamplingParams.structured"
        )


def _outlines_core() -> Any:
    """outlines-core, or one line naming roll-engines[structured] when it is missing."""
    STRUCTURED.require()
    import outlines_core

    return outlines_core


#: Python `re` constructs outlines-core's regex dialect (Rust's regex syntax, compiled to a DFA; vLLM's outlines backend
#: and the trainer's replay use the same) cannot build, by re's parser op (and the assertion's code): refused by name
#: (`_refuse_unsupported_regex`) rather than with outlines-core's "error building NFA" inside vLLM or SGLang.
_ANCHOR = "the anchor {} (the whole response must match the regex: it is anchored already; remove it)"
_BOUNDARY = "the word boundary {} (a DFA cannot test one: spell the allowed text out)"
_LOOK = "a lookaround {} (a DFA cannot look ahead or behind: spell the allowed text out)"
_UNSUPPORTED_REGEX = {
    ("AT", "AT_BEGINNING"): _ANCHOR.format("'^'"),
    ("AT", "AT_BEGINNING_LINE"): _ANCHOR.format("'^'"),
    ("AT", "AT_BEGINNING_STRING"): _ANCHOR.format("'\\A'"),
    ("AT", "AT_END"): _ANCHOR.format("'$'"),
    ("AT", "AT_END_LINE"): _ANCHOR.format("'$'"),
    ("AT", "AT_END_STRING"): _ANCHOR.format("'\\Z'"),
    ("AT", "AT_BOUNDARY"): _BOUNDARY.format("'\\b'"),
    ("AT", "AT_NON_BOUNDARY"): _BOUNDARY.format("'\\B'"),
    ("ASSERT", 1): _LOOK.format("'(?=...)'"),
    ("ASSERT", -1): _LOOK.format("'(?<=...)'"),
    ("ASSERT_NOT", 1): _LOOK.format("'(?!...)'"),
    ("ASSERT_NOT", -1): _LOOK.format("'(?<!...)'"),
    ("GROUPREF", None): "a backreference ('\\1', '(?P=name)': not a regular language; list the alternatives)",
    ("GROUPREF_EXISTS", None): "a conditional group '(?(1)...|...)' (not a regular language; list the alternatives)",
    ("ATOMIC_GROUP", None): "an atomic group '(?>...)' (use a plain group)",
    ("POSSESSIVE_REPEAT", None): "a possessive quantifier ('*+', '++', '?+', '{m,n}+'; use a greedy one)",
}


def _unsupported_regex_construct(parsed: Any) -> str | None:
    """The first construct of a parsed Python regex (re's parser tree) outlines-core cannot build, described."""
    for op, av in parsed:
        name = op.name
        detail = av.name if name == "AT" else av[0] if name in ("ASSERT", "ASSERT_NOT") else None
        if (name, detail) in _UNSUPPORTED_REGEX:
            return _UNSUPPORTED_REGEX[name, detail]
        subs: list[Any] = []
        if name == "SUBPATTERN":
            subs = [av[3]]
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):
            subs = [av[2]]
        elif name == "BRANCH":
            subs = list(av[1])
        for sub in subs:
            found = _unsupported_regex_construct(sub)
            if found is not None:
                return found
    return None


def _refuse_unsupported_regex(regex: str) -> None:
    """ValueError naming the first construct of `regex` (valid for Python's `re`: StructuredOutput checked it)
    that outlines-core cannot build (`_UNSUPPORTED_REGEX`), or a nested set Python reads literally and outlines-core
    as a class (`[[:alpha:]]`: Python's FutureWarning; the two would constrain different languages)."""
    import warnings

    try:
        from re import _parser as sre_parser  # type: ignore[attr-defined]  # Python >= 3.11
    except ImportError:  # Python 3.10
        import sre_parse as sre_parser  # type: ignore[no-redef]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = sre_parser.parse(regex)
    construct = _unsupported_regex_construct(parsed)
    if construct is None and any(issubclass(w.category, FutureWarning) for w in caught):
        construct = (
            "a '[' or a set operation ('&&', '--', '||', '~~') inside a character class (Python reads it literally, "
            "outlines-core as a nested class or set operation: escape it)"
        )
    if construct is not None:
        raise ValueError(
            f"StructuredOutput.regex {regex[:200]!r}: {construct} is not supported by outlines-core's regex dialect "
            "(the constraint every engine and the trainer's replay compile)"
        )


@functools.lru_cache(maxsize=256)
def _regex(kind: str, text: str) -> str:
    oc = _outlines_core()
    if kind == "regex":
        _refuse_unsupported_regex(text)
        regex = text
    else:
        # Refused where outlines-core's regex would sample values the schema forbids (roll_engines._structured_schema)
        schema = check_schema(json.loads(text))
        try:
            regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
        except Exception as exc:  # outlines-core raises ValueError or its own errors for unsupported schemas
            raise ValueError(f"StructuredOutput.json_schema cannot be compiled: {exc}") from None
    try:
        oc.Index(regex, byte_vocabulary())
    except Exception as exc:  # what vLLM / SGLang would raise when the request is submitted
        what = f"StructuredOutput.regex {text[:200]!r}" if kind == "regex" else "StructuredOutput.json_schema"
        raise ValueError(
            f"{what} cannot be compiled by outlines-core ({exc}); its dialect is Rust's regex syntax (e.g. "
            "{0,n} not {,n}, \\x08 not [\\b], no (?#...) comments, inline flags i, m, s, x, U only)"
        ) from None
    return regex


def to_regex(constraint: StructuredOutput) -> str:
    """The regex a constraint stands for (a JSON schema through outlines-core), checked to compile as the engines
    will compile it (ValueError naming what is wrong: an unsupported regex construct, schema keyword); cached."""
    STRUCTURED.require()  # before the cache: a cached constraint must not hide a missing extra
    return _regex(*constraint.key())


# ---- vocabulary ------------------------------------------------------------------------------------------------


class ConstraintViolation(RuntimeError):
    """A constrained request the sampler cannot keep in its constraint: a state that allows no id within the model's
    logits width, or a sampled token the constraint does not allow. Its request fails with this error (its batch goes
    on) rather than returning a response the constraint does not hold for. `detail`: the message without the
    request's id (a `generate` caller never saw it; roll_engines.infer._rows.caller_error names the row instead)."""

    def __init__(self, request_id: str, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.detail = message if detail is None else detail


class TokenVocabulary:
    """outlines-core's Vocabulary of one tokenizer, and the facts masks need (EOS id, ids the tokenizer knows)."""

    def __init__(self, tokenizer: Any) -> None:
        oc = _outlines_core()
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("structured outputs need a tokenizer with an EOS token (eos_token_id is None)")
        self.tokens = _token_bytes(tokenizer)
        self.inner = oc.Vocabulary(int(self.eos_id), self.tokens)
        self.indexes: OrderedDict[str, Any] = OrderedDict()  # regex -> compiled Index (LRU)
        self.masks: OrderedDict[tuple[str, int, int], Tensor] = OrderedDict()  # (regex, state, V) -> keep (LRU)
        self.lock = threading.Lock()
        self.warned_widths: set[int] = set()  # logits widths V already warned about (ids >= V the regex allows)

    def keep(self, regex: str, index: Any, state: int, vocab_size: int) -> Tensor:
        """(V,) bool CPU mask of the ids `index` allows in `state` (ids >= V dropped); cached, 1024 most recent."""
        key = (regex, state, vocab_size)
        with self.lock:
            mask = self.masks.get(key)
            if mask is not None:
                self.masks.move_to_end(key)
                return mask
        ids = torch.tensor(list(index.get_allowed_tokens(state)), dtype=torch.long)
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        inside = ids < vocab_size
        mask[ids[inside]] = True
        if not bool(inside.all()) and vocab_size not in self.warned_widths:
            # The model has no logits for these ids (a tokenizer with tokens added past the model's vocabulary):
            # they are never sampled, so the constrained language loses them; a state left with no id is refused by
            # the sampler (ConstraintViolation), never sampled unmasked.
            self.warned_widths.add(vocab_size)
            log.warning(
                "structured outputs: the constraint allows token ids up to %d but the model's logits have only %d "
                "entries (a tokenizer with more tokens than the model's vocabulary?): ids >= %d are never allowed",
                int(ids.max()),
                vocab_size,
                vocab_size,
            )
        with self.lock:
            self.masks[key] = mask
            while len(self.masks) > 1024:
                self.masks.popitem(last=False)
        return mask

    def index(self, regex: str) -> Any:
        """The compiled outlines-core Index of `regex` over this vocabulary (cached, 64 most recent)."""
        with self.lock:
            if regex in self.indexes:
                self.indexes.move_to_end(regex)
                return self.indexes[regex]
        oc = _outlines_core()
        try:
            idx = oc.Index(regex, self.inner)
        except Exception as exc:
            raise ValueError(f"structured output regex {regex[:200]!r} cannot be compiled: {exc}") from None
        with self.lock:
            self.indexes[regex] = idx
            while len(self.indexes) > 64:
                self.indexes.popitem(last=False)
        return idx


_VOCABS: weakref.WeakKeyDictionary[Any, TokenVocabulary] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def vocabulary(tokenizer: Any) -> TokenVocabulary:
    """The TokenVocabulary of `tokenizer`, built once per tokenizer object (seconds for a 150k vocabulary)."""
    with _VOCABS_LOCK:
        vocab = _VOCABS.get(tokenizer)
        if vocab is None:
            vocab = _VOCABS[tokenizer] = TokenVocabulary(tokenizer)
        return vocab


def _token_bytes(tokenizer: Any) -> dict[bytes, list[int]]:
    """token bytes -> ids, reduced as vLLM's outlines backend (`_reduced_vocabulary`) does, so that the sets of
    allowed tokens agree with vLLM's: a token is the bytes of `convert_tokens_to_string([token])` (a leading space
    for SentencePiece's word marker); tokens decoding to invalid UTF-8 map back to raw bytes (Llama's `<0xXX>`
    byte tokens, GPT-2's byte-to-unicode alphabet); special tokens, EOS and tokens decoding to nothing are left out."""
    import re

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    unicode_to_bytes = {v: k for k, v in bytes_to_unicode().items()}
    byte_token = re.compile(r"^<0x[0-9A-F]{2}>$")
    replacement = re.compile(r"^.{0,6}\ufffd+.{0,6}$")
    specials = set(tokenizer.all_special_tokens)
    eos = tokenizer.eos_token_id
    out: dict[bytes, list[int]] = {}
    for token, idx in tokenizer.get_vocab().items():
        if token in specials or idx == eos:
            continue
        text = tokenizer.convert_tokens_to_string([token])
        if isinstance(token, str) and (token.startswith("\u2581") or token == "<0x20>"):
            text = " " + text  # HF's Llama tokenizers drop the space of a lone word-start token
        if not text:
            continue
        if isinstance(token, (bytes, bytearray)):
            raw = bytes(text)
        elif (text == "\ufffd" and token != "\ufffd") or ("\ufffd" in text and not replacement.match(text)):
            if byte_token.match(token):
                raw = bytes([int(token[3:5], 16)])
            else:
                vals = [unicode_to_bytes.get(c) for c in token]
                if None in vals:
                    log.warning("structured outputs: token %r (%d) has no byte form; it is never allowed", token, idx)
                    continue
                raw = bytes(vals)
        else:
            raw = text.encode("utf-8")
        out.setdefault(raw, []).append(idx)
    return out


# ---- one sequence ----------------------------------------------------------------------------------------------


class Matcher:
    """The constraint's state along one sequence: allowed ids next, advanced token by token."""

    def __init__(self, constraint: StructuredOutput, tokenizer: Any) -> None:
        self.vocab = vocabulary(tokenizer)
        self.constraint = constraint
        self.regex = to_regex(constraint)
        self.index = self.vocab.index(self.regex)
        self.state = self.index.get_initial_state()
        self.dead = False  # a token outside the allowed set was fed: the walk stopped there
        # The constraint's EOS ended a complete match: the constraint is over, every id allowed from here (vLLM's
        # outlines grammar `is_terminated` then, and vLLM stops masking; with ignore_eos generation goes on).
        self.done = False

    def allowed(self) -> list[int]:
        """Token ids allowed next (EOS only where the text so far is a complete match); [] once `done` (the
        constraint no longer applies: every id is allowed)."""
        return [] if self.done else list(self.index.get_allowed_tokens(self.state))

    def keep(self, vocab_size: int) -> Tensor:
        """(V,) bool CPU mask of `allowed()`, all True once `done` (shared, cached: do not modify)."""
        if self.done:
            return _everything(vocab_size)
        return self.vocab.keep(self.regex, self.index, self.state, vocab_size)

    def describe(self) -> str:
        """The constraint in a line, for errors: its kind and (the start of) its regex or schema text."""
        kind, text = self.constraint.key()
        return f"{kind} {text[:200]!r}"

    @property
    def final(self) -> bool:
        """The text so far matches the whole constraint (EOS is allowed)."""
        return bool(self.index.is_final_state(self.state))

    def advance(self, token: int) -> bool:
        """Move past `token`; False (and dead from then on) when it was not allowed. EOS in a complete match ends
        the constraint (`done`: every later token is allowed)."""
        if self.dead:
            return False
        if self.done:
            return True
        if token == self.vocab.eos_id and self.final:
            self.done = True
            return True
        nxt = self.index.get_next_state(self.state, int(token))
        if nxt is None:
            self.dead = True
            return False
        self.state = nxt
        return True


@functools.lru_cache(maxsize=8)
def _everything(vocab_size: int) -> Tensor:
    """(V,) all-True mask: a constraint that ended allows every id."""
    return torch.ones(vocab_size, dtype=torch.bool)


def mask_logits(logits: Tensor, rows: Sequence[int], keeps: Sequence[Tensor]) -> Tensor:
    """`logits` with every id outside `keeps[j]` masked in row `rows[j]` (a copy; other rows unchanged).

    Args:
        logits: (B, V) float logits (after temperature, if any).
        rows: row indices to constrain.
        keeps: per constrained row, a (V,) bool mask of the allowed ids (`Matcher.keep`).

    Returns:
        (B, V) logits; masked entries hold the dtype's most negative finite value.
    """
    if not rows:
        return logits
    keep = torch.ones(logits.shape, dtype=torch.bool)
    keep[list(rows)] = torch.stack(list(keeps))
    return logits.masked_fill(~keep.to(logits.device), torch.finfo(logits.dtype).min)


def replay_mask(
    constraint: StructuredOutput, tokenizer: Any, tokens: Sequence[int], vocab_size: int
) -> tuple[Tensor, int]:
    """The disallowed-token masks a sampler applied while generating `tokens` under `constraint`.

    Args:
        constraint: the row's constraint.
        tokens: the response tokens (n,), without padding.
        vocab_size: V, the model's logits width.

    Returns:
        ((k, V) bool, True where disallowed, for the first k positions; k) where k = n when every token was allowed,
        else the position of the first disallowed token (that token and what follows are left unmasked: the
        response was not sampled under this constraint, and -inf log-probs would poison the loss). Positions after
        the constraint's EOS in a complete match (ignore_eos) are all False: the constraint ended there.
    """
    m = Matcher(constraint, tokenizer)
    rows = []
    for tok in tokens:
        keep = m.keep(vocab_size)
        if not (0 <= int(tok) < vocab_size and bool(keep[int(tok)])):
            break
        rows.append(~keep)
        m.advance(int(tok))
    k = len(rows)
    return (torch.stack(rows) if rows else torch.zeros((0, vocab_size), dtype=torch.bool)), k


def constrain_logits(
    logits: Tensor, encoded: Tensor, responses: Tensor, response_mask: Tensor | None, tokenizer: Any
) -> tuple[Tensor, int]:
    """A training forward's logits masked, in each constrained row, as the sampler masked them.

    Args:
        logits: (b, R, V) float logits (after temperature) predicting the response tokens.
        encoded: (b, K) uint8, the batch's `structured` rows (roll_core.interfaces.inference.structured_rows).
        responses: (b, R) response token ids; response_mask: (b, R) 1 on real tokens (None: all R are real).

    Returns:
        ((b, R, V) logits, masked entries at the dtype's most negative finite value; unconstrained rows, padding and
        positions from a token its constraint never allowed are unchanged), number of rows with such a token.
    """
    _, r, v = logits.shape
    out, rejected = logits, 0
    floor = torch.finfo(logits.dtype).min
    for i, c in enumerate(structured_from_rows(encoded)):
        if c is None:
            continue
        n = int(response_mask[i].sum()) if response_mask is not None else r
        rows, k = replay_mask(c, tokenizer, responses[i, :n].tolist(), v)
        rejected += int(k < n)
        if k:
            if out is logits:  # one copy for the batch, masked row by row: a (b, R, V) mask was as big as the logits
                out = logits.clone()
            out[i, :k] = out[i, :k].masked_fill(rows.to(logits.device), floor)
    return out, rejected
