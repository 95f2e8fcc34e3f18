"""MLflow names for roll's metric keys and config params (roll_core.trackers.mlflow), and MLflow's limits on them.

A key MLflow refuses has its refused characters and path-like parts replaced (`mlflow_key`); two keys may then read
the same (`a/b=c` and `a/b_c`), and MLflow would show one series holding both keys' points (one param overwriting
the other). `KeyNames` keeps every key's name distinct: the later key gets a deterministic suffix, with a warning.
Config params join nested keys with dots, so a literal dotted key (`a.b`) reads as the nested one (`a: {b: ...}`):
`flatten_config` keeps both, the literal one suffixed, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

log = logging.getLogger("roll_core.trackers.mlflow")
#: How a param value longer than MLflow's limit ends.
PARAM_CUT_NOTE = " ...[cut: the config.yaml artifact holds the whole value]"
# MLflow's limits (mlflow.utils.validation): param and tag value length, key length.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")
#: The suffix of a name that another key already has: "-" and this many hex digits of the key's SHA-1.
_DIGEST = 8


def _key_part(part: str) -> str:
    """A `/`-separated part of a key that a path would rewrite (empty, `.`, `..`) as underscores."""
    return "_" * max(len(part), 1) if part in ("", ".", "..") else part


def mlflow_key(key: str) -> str:
    """`key` as MLflow accepts it for a metric or param: characters it refuses become `_`, as does a part that a
    path would rewrite (MLflow refuses "/loss", "a//b", "a/", "a/./b", "a/../b", "..x": each names another path),
    at most 250 long. Not one-to-one: `KeyNames` keeps the names of distinct keys distinct."""
    clean = "/".join(_key_part(part) for part in _BAD_KEY_CHARS.sub("_", key).split("/"))
    if clean.startswith(".."):
        clean = "_" + clean[1:]
    clean = clean[:MAX_KEY]
    if clean.endswith("/"):  # the cut may leave an empty, "." or ".." last part
        clean = clean[:-1] + "_"
    head, slash, last = clean.rpartition("/")
    return head + slash + _key_part(last)


class KeyNames:
    """Each key's MLflow name, distinct per key, given at the key's first appearance and kept.

    The name is `clean(key)` (`mlflow_key(key)` for MLflow); when another key already has it, it is that name cut
    to fit and ended with `-<the first 8 hex digits of the key's SHA-1>` (deterministic: a replay or a resume that
    sees the keys in the same order names them the same), and a warning says so once. Among keys first seen
    together (one step's metrics, one config), those MLflow takes as they are claim their names first, so `a/b_c`
    keeps its name beside `a/b=c`. `reserved` names are never given to a key (a metric of roll's own).

    Another backend with its own rules passes them: `clean` (a key as that backend takes it, at most `max_len`
    long; mlflow_key by default), `backend` (its name in the messages) and `logger` (its own)."""

    def __init__(
        self,
        kind: str,
        reserved: Iterable[str] = (),
        *,
        clean: Callable[[str], str] | None = None,
        max_len: int = MAX_KEY,
        backend: str = "MLflow",
        logger: logging.Logger = log,
    ) -> None:
        self.kind = kind  # "metric" or "param", for messages
        self.clean, self.max_len, self.backend, self.log = clean or mlflow_key, max_len, backend, logger
        self.names: dict[str, str] = {}
        self.owners: dict[str, str | None] = dict.fromkeys(reserved)  # name -> the key that has it (None: roll's)

    def names_of(self, keys: Iterable[str]) -> dict[str, str]:
        """{key: its name in the backend} of `keys`; new keys are named (see the class docstring)."""
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self.names]
        for key in sorted(new, key=lambda k: self.clean(k) != k):  # stable: valid names first, else as given
            self._name(key)
        return {k: self.names[k] for k in keys}

    def _name(self, key: str) -> None:
        name = self.clean(key)
        if name in self.owners:
            digest = hashlib.sha1(key.encode()).hexdigest()
            taken = name
            for n in range(_DIGEST, len(digest) + 1):  # a longer digest in the (astronomical) case it is taken too
                name = self.clean(f"{taken[: self.max_len - n - 1]}-{digest[:n]}")
                if name not in self.owners:
                    break
            else:
                raise ValueError(f"{self.backend}: no distinct name for {self.kind} {key!r}")
            owner = self.owners[taken]
            self.log.warning(
                "%s: %s %r is logged as %r (%r already names %s)",
                self.backend,
                self.kind,
                key,
                name,
                taken,
                f"a reserved {self.kind} (the backend's or roll's)" if owner is None else repr(owner),
            )
        elif name != key and self.kind == "metric":  # (a param's name is in the params MLflow shows)
            self.log.info(
                "%s: %s %r is logged as %r (a name %s refuses)", self.backend, self.kind, key, name, self.backend
            )
        self.names[key], self.owners[name] = name, key


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _flat(config: Mapping[str, Any], path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:
    """(the key path, the value as param text) of each leaf of `config` (an empty mapping is a leaf)."""
    for key, value in config.items():
        here = (*path, str(key))
        if isinstance(value, Mapping) and value:
            yield from _flat(value, here)
            continue
        text = _value(dict(value) if isinstance(value, Mapping) else value)
        if len(text) > MAX_PARAM_VALUE:
            text = text[: MAX_PARAM_VALUE - len(PARAM_CUT_NOTE)] + PARAM_CUT_NOTE
        yield here, text


def _joined_names(paths: list[tuple[str, ...]], prefix: str) -> dict[tuple[str, ...], str]:
    """{key path: its param name}: the path joined with dots, distinct per path. A literal dotted key (`a.b: 1`)
    joins as a nested one (`a: {b: 2}`) does: of the paths that read the same, the one with the most parts (the
    nested one; the config's order among equals) keeps the name, each other one is the name and
    `-<the first 8 hex digits of the SHA-1 of its path as JSON>`, with a warning (one param overwrote the other,
    without a word)."""
    by_name: dict[str, list[tuple[str, ...]]] = {}
    for path in paths:
        by_name.setdefault(prefix + ".".join(path), []).append(path)
    names = {same[0]: name for name, same in by_name.items() if len(same) == 1}
    for name, same in by_name.items():
        if len(same) == 1:
            continue
        keeper, *others = sorted(same, key=len, reverse=True)  # (stable: the config's order among equals)
        names[keeper] = name
        for path in others:
            moved = f"{name}-{hashlib.sha1(json.dumps(list(path)).encode()).hexdigest()[:_DIGEST]}"
            if moved in by_name or moved in names.values():  # (astronomical: a key named as the suffixed name)
                raise ValueError(f"MLflow: no distinct param name for the config's key path {list(path)}")
            names[path] = moved
            log.warning(
                "MLflow: the config's key %r is logged as %r: the param of its path %s reads as that of %s "
                "(both are kept)",
                name,
                moved,
                list(path),
                list(keeper),
            )
    return names


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: nested keys joined with dots, leaves as text (lists as JSON text), keys named
    by `KeyNames` (valid, and distinct per key), values over MLflow's 6000 characters cut with PARAM_CUT_NOTE at
    the end. A literal dotted key and the nested keys it reads as (`a.b` and `a: {b: ...}`) are two params: the
    nested one's is `a.b`, the literal one's is suffixed, with a warning (`_joined_names`)."""
    leaves = list(_flat(config, ()))
    joined = _joined_names([path for path, _ in leaves], prefix)
    flat = {joined[path]: text for path, text in leaves}
    names = KeyNames("param").names_of(flat)
    return {names[k]: v for k, v in flat.items()}
