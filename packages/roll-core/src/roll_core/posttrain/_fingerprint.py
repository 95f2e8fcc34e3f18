"""A tokenizer's identity as a string (`tokenizer_fingerprint`, described in roll_core.posttrain.tokenize, which
re-exports it): what decides token ids, hashed independently of how a library version serialises the tokenizer."""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Texts whose ids show what a tokenizer's normalizer, pre-tokenizer and post-processor do: case, accents and
#: combining marks, compatibility forms (NFKC), whitespace runs, digit grouping, contractions, several scripts,
#: characters a byte-level or byte-fallback model splits, zero-width characters and code.
FINGERPRINT_PROBES = (
    "Hello, world! The QUICK brown fox's jumps: 12345 + 67.89 = 1e3 -- don't, I'll, we've, 1,000,000",
    "  leading spaces\tand\ttabs\n\nnew lines\r\n  trailing  \n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m e\u0301 \ufb01 \u2460 "
    "\uff21\uff22 \u00bd x\u00b2 \u2126 \u00df",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002 \u3053\u3093\u306b\u3061\u306f \uc548\ub155 \u0645\u0631\u062d\u0628\u0627 "
    "\u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947 \u041f\u0440\u0438\u0432\u0435\u0442",
    "emoji \U0001f600\U0001f44d\U0001f3fd \u200b zero\u200dwidth \u00a0nbsp \U0001d54f \ufffd",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n```json\n{\"k\": null}\n```",
)
#: Added tokens shown inside text (a probe each side of every one) when a tokenizer has at most this many.
_PROBED_ADDED = 1024


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the ids a tokenizer gives any text and conversation, and of nothing else.

    Hashed: the vocabulary (token -> id, added tokens included); the tokenisation model's data and settings (BPE
    merges as token pairs, Unigram scores, unk token, byte fallback, ...: defaults left out); each added token's
    content, id and matching flags (special, lstrip, rstrip, single_word, normalized); the ids of the bos, eos,
    unk, sep, cls and mask roles; the chat template; and the ids of `FINGERPRINT_PROBES` and of the added tokens
    inside text, with and without the special tokens the tokenizer adds: the normalizer, pre-tokenizer and
    post-processor are compared by what they do, not by how a library version serialises them.

    Not hashed, so equal tokenizers keep equal fingerprints across transformers / tokenizers upgrades and saves:
    the serialised JSON's layout (tokenizers 0.20 writes merges as pairs, newer versions add keys at their
    default), the decoder (text from ids, not ids), padding / truncation settings and the pad token (padding is
    never attended nor trained).
    """
    vocab = sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    flags = ("special", "lstrip", "rstrip", "single_word", "normalized")
    added_spec = sorted((int(i), str(t), *(bool(getattr(t, f, False)) for f in flags)) for i, t in added.items())
    contents = [str(t) for _, t in sorted(added.items())][:_PROBED_ADDED]
    probes = [*FINGERPRINT_PROBES, "".join(f" a{c}b " for c in contents)]

    def ids(text: str, specials: bool) -> list[int]:
        # verbose=False: a probe longer than model_max_length is no model input (no "longer than" warning)
        return [int(x) for x in tokenizer.encode(text, add_special_tokens=specials, verbose=False)]

    parts = {
        "vocab": vocab,
        "model": _model_spec(tokenizer),
        "added": added_spec,
        "roles": {r: getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "unk", "sep", "cls", "mask")},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "probes": [[ids(t, False), ids(t, True)] for t in probes],
    }
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]


def _model_spec(tokenizer: Any) -> dict[str, Any] | None:
    """A fast tokenizer's tokenisation model in a version-independent form (None for a slow tokenizer: its
    vocabulary and probes stand for it): settings without their defaults (None, false, ""), BPE merges as pairs
    (tokenizers < 0.20 wrote "a b" strings), Unigram's scores; the vocabulary itself is hashed from `get_vocab`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = json.loads(backend.to_str()).get("model") or {}
    spec = {k: v for k, v in model.items() if k not in ("vocab", "merges") and v is not None and v is not False}
    spec = {k: v for k, v in spec.items() if v != ""}
    if "merges" in model:
        spec["merges"] = [_merge_pair(m) for m in model["merges"]]
    if model.get("type") == "Unigram":
        spec["scores"] = [float(score) for _, score in model.get("vocab", [])]
    return spec


def _merge_pair(merge: Any) -> list[str]:
    """A BPE merge as [left, right], whichever way tokenizers serialised it."""
    if isinstance(merge, str):
        parts = merge.split(" ")
        return parts if len(parts) == 2 else [merge]
    return [str(x) for x in merge]


def legacy_tokenizer_fingerprint(tokenizer: Any) -> str:
    """The fingerprint roll wrote before `tokenizer_fingerprint` hashed a version-independent form: a hash of the
    serialised tokenizer JSON (it changes with the tokenizers version that serialises it). Kept only so that
    distillation files stamped with it by the same library versions still load."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec: Any = json.loads(backend.to_str())
        for runtime in ("truncation", "padding"):  # set per call by transformers, not part of the tokenizer
            spec.pop(runtime, None)
    else:
        spec = sorted(tokenizer.get_vocab().items())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    roles = {
        name: getattr(tokenizer, name, None)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
    }
    parts = {
        "model": spec,
        "added": sorted((int(i), str(t), bool(getattr(t, "special", False))) for i, t in added.items()),
        "roles": {k: str(v) if v is not None else None for k, v in roles.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]
