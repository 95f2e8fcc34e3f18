"""User data as a task: JSONL, Parquet or a Hugging Face `datasets` folder with prompt and answer columns; a `.json`
or `.jsonl` file holds JSON lines or one JSON array of rows (numbered from 1 like lines).

Bad rows (not UTF-8, not JSON or nested past Python's recursion limit, not an object, an object naming a key
twice with different values (`json` kept the last, unsaid: _repeated_keys), missing or empty prompt/answer,
non-text values, NaN answers, text holding a lone surrogate: a `\\ud800` escape, valid JSON but no Unicode
character, in the prompt, the answer or any other column; a prompt already chat-templated, opening with
`<|im_start|>` or another template's markers (base.templated_marker), which the pipeline would template again) are
skipped, counted and reported with their 1-based line (or row) numbers in `skipped` (per file in `skipped_rows`,
which the loop puts in the metrics and the run summary), and a summary is logged: never silently dropped, never a
crash halfway through a file. A file that is missing, unreadable as a whole (a JSON array over several lines nested
past the recursion limit), of an unknown kind, or left empty after skipping is a `ConfigError` naming the setting
(env.path / env.eval_path), so roll-train ends with one message and exit status 2, not a traceback. A `datasets`
folder holding several splits is read from the split env.split (env.eval_split) names, else its `train` split,
with a warning naming the others (as env.eval_path: its one split beside `train`); no `train` split and none named
is a ConfigError naming the splits (roll_envs.tasks._datasets_folder; it trained on the first saved). The held-out
split is `eval_path` when given, else a stable-hash fraction of the rows; training rows that are a held-out row's
problem but for whitespace in the prompt ("Q?" and "Q?\n") are left out of training, counted in `also_held_out` and
logged (base.held_out_split).

Pictures (vision-language data): the `images_key` column (default `images`; a lone `image` column too) holds a
row's pictures: a list, or one value, of paths (relative to the data file's folder), encoded bytes, base64 text
(bare or a `data:image/...;base64,` URI), `{"bytes", "path"}` dicts (what `datasets` writes to Parquet and what a
`datasets` folder's Image feature is read as: never decoded at load) or PIL images (roll_core.multimodal.images;
URLs are refused: a run fetches nothing).
The prompt places them with `<image>` markers (the common VLM RL row format, e.g. Geometry3K: `problem` text with
`<image>`, `images`, `answer`; in a chat row, the markers of all its user messages, in order); without markers they
come first (in the last user message). A row whose pictures cannot be read (missing file, bytes that are no
picture), whose markers disagree with its picture count, or with a marker in a system or assistant message is a
bad row like the others: skipped, counted, reported. Pictures are checked by their headers here (cheap) and
decoded when their prompt is built.
A prompt may also be a list of chat messages (verl's prepared rows): its last user message is the prompt and the
messages before it (the row's system message, earlier turns) its `context`, kept in the chat the model sees (a set
env.system_prompt replaces the row's system message); messages after it (an answer turn) are not shown. A message
that is not a `{"role": system|user|assistant, "content": text}` object makes the row bad. An `answer_key` with
dots reads a nested column (`reward_model.ground_truth`). A row's `domain` column (text) names its domain; a null
or empty one is no domain (the default's), another type makes the row bad. A leading UTF-8 byte order mark (files
saved by Windows editors) is ignored. A number answer is written in plain decimal, a whole one as an integer (3.0,
what an integer column with a null in it holds in pandas, Arrow and the files written from them, is "3"; its null
rows are skipped and counted as missing answers; a decimal column's 3.00 is "3" and 1.50 "1.5"); the other
columns of such an integer column with nulls, and the fields of struct columns that are one
(`{"meta": {"id": 3}}`), read as ints and None, not 3.0 and NaN (roll_core.int_columns), in the rows every file
task reads. A float32 (or float16) value reads as the decimals written (0.1, not 0.10000000149011612), in a flat
column or nested in lists, structs and maps (a struct answer, metadata columns).
"""

from __future__ import annotations

import collections
import decimal
import json
import logging
import math
import re
import struct
from pathlib import Path
from typing import Any

from roll_core.errors import ConfigError
from roll_core.int_columns import float_columns as _float_columns
from roll_core.int_columns import restore_int_columns
from roll_envs.rewards.base import Reward
from roll_envs.tasks._datasets_folder import encoded_rows as _encoded_rows
from roll_envs.tasks._datasets_folder import load_folder
from roll_envs.tasks._repeated_keys import RepeatedKeys, repeated_key, repeated_reason
from roll_envs.tasks.base import Problem, Task, eval_file_name, templated_marker

log = logging.getLogger(__name__)


def _rows(path: Path) -> tuple[list[tuple[int, Any]], list[tuple[int, str]]]:
    """(row number, row) pairs and (row number, reason) for rows that could not even be read (a datasets folder's
    split as training data without a setting naming it: roll_envs.tasks._splits)."""
    rows, bad, _ = _read_rows(path)
    return rows, bad


def _read_rows(
    path: Path, split: str | None = None, key: str | None = None, *, held: bool = False
) -> tuple[list[tuple[int, Any]], list[tuple[int, str]], str]:
    """_rows, and the label of the split in row ids ('' but for a datasets folder's non-`train` split of several);
    `split` (set by the config key `key`) names a datasets folder's split, `held` marks held-out data."""
    bad: list[tuple[int, str]] = []
    if split is not None and not path.is_dir():  # (a file has no splits: the setting would be ignored unsaid)
        raise ConfigError(f"{key}={split!r} names a split of a datasets folder, but {path} is a file: drop {key}")
    if path.is_dir():
        ds, label = load_folder(path, split, key, held=held)
        narrow = _narrow_columns(ds.data.schema)  # (datasets' rows have the Arrow table's nesting)
        rows = [(i + 1, _widened(row, narrow)) for i, row in enumerate(_encoded_rows(ds))]
        return restore_int_columns(rows, _float_columns(ds.data.schema)), bad, label
    if path.suffix == ".parquet":
        from roll_envs.config import PYARROW

        PYARROW.require()
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's own message does not say which setting pointed here
            raise ConfigError(f"{path}: cannot read it as Parquet ({exc}); check the file or env.path") from exc
        narrow = _narrow_columns(table.schema)
        rows = [(i + 1, _widened(row, narrow)) for i, row in enumerate(table.to_pylist())]
        return restore_int_columns(rows, _float_columns(table.schema)), bad, ""
    if path.suffix in (".jsonl", ".json"):
        # (A .jsonl file too: an array saved under that name lost every row but the last, like a .json file did.)
        keys = RepeatedKeys()  # (rows naming a key twice with different values: skipped, not last-one-wins)
        array = _json_array(path, keys)
        if array is not None:
            if keys.found:
                named = [(n, repeated_key(row)) for n, row in array]
                bad += [(n, repeated_reason(k)) for n, k in named if k is not None]
                array = [r for r, (_, k) in zip(array, named, strict=True) if k is None]
            return restore_int_columns(array), bad, ""
        keys.found.clear()  # (what a failed read as one array saw: the lines are decoded again)
        decoder = json.JSONDecoder(object_pairs_hook=keys)  # (one decoder: json.loads(line, hook) builds one a line)
        rows = []
        # Bytes, decoded line by line: one line that is not UTF-8 is a bad row, not a UnicodeDecodeError that ends
        # the whole file with neither its name nor a line number.
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    bad.append((lineno, f"not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"))
                    continue
                if not line.strip():
                    continue
                try:
                    if line.startswith("\ufeff"):  # (what json.loads says; a bare decoder says "Expecting value")
                        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", line, 0)
                    row = decoder.decode(line)
                    if keys.found:
                        bad.append((lineno, repeated_reason(keys.found[0])))
                        keys.found.clear()
                    else:
                        rows.append((lineno, row))
                except json.JSONDecodeError as exc:
                    bad.append((lineno, f"invalid JSON ({exc.msg})"))
                except RecursionError:  # (a bare RecursionError ended the whole load, naming no line)
                    bad.append((lineno, _TOO_DEEP))
        return restore_int_columns(rows), bad, ""
    raise ConfigError(
        f"unsupported data file {path} (env.path / env.eval_path): use .jsonl, .parquet or a datasets folder"
    )


# Arrow type names of the floats narrower than Python's -> their struct format.
_NARROW_FLOATS = {"float": "<f", "halffloat": "<e"}


def _children(t: Any) -> list[Any]:
    """The Arrow types nested in `t`: a struct's fields, a list's items, a map's keys and items; [] otherwise."""
    import pyarrow.types as pat

    if pat.is_struct(t):
        return [t.field(i).type for i in range(t.num_fields)]
    if pat.is_map(t):
        return [t.key_type, t.item_type]
    return [t.value_type] if hasattr(t, "value_type") and not pat.is_dictionary(t) else []


def _has_narrow(t: Any) -> bool:
    return str(t) in _NARROW_FLOATS or any(_has_narrow(c) for c in _children(t))


def _narrow_columns(schema: Any) -> dict[str, Any]:
    """Column -> Arrow type of the columns holding a float32/float16 value, flat or nested (lists, structs, maps)."""
    return {f.name: f.type for f in schema if _has_narrow(f.type)}


def _shortest(x: float, fmt: str) -> float:
    """The shortest decimal the narrow float type `fmt` rounds to the value `x` it holds."""
    for digits in range(1, 18):
        text = f"{x:.{digits}g}"
        try:
            if struct.unpack(fmt, struct.pack(fmt, float(text)))[0] == x:
                return float(text)
        except OverflowError:  # rounded past the type's largest value: more digits
            continue
    return x


def _widen(x: Any, t: Any) -> Any:
    """The value `x` of Arrow type `t` (as `to_pylist` gives it: a struct a dict, a list a list, a map a list of
    (key, item) pairs) with every float32/float16 value in it as its shortest decimal."""
    import pyarrow.types as pat

    if str(t) in _NARROW_FLOATS:
        return _shortest(x, _NARROW_FLOATS[str(t)]) if isinstance(x, float) and math.isfinite(x) else x
    if pat.is_struct(t) and isinstance(x, dict):
        types = {t.field(i).name: t.field(i).type for i in range(t.num_fields)}
        return {k: _widen(v, types[k]) if k in types else v for k, v in x.items()}
    if pat.is_map(t) and isinstance(x, list):
        return [(_widen(k, t.key_type), _widen(v, t.item_type)) for k, v in x]
    if isinstance(x, list) and _children(t):
        return [_widen(v, t.value_type) for v in x]
    return x


def _widened(row: dict[str, Any], narrow: dict[str, Any]) -> dict[str, Any]:
    """`row` with each float32/float16 value of its columns (`narrow`: column -> its Arrow type), flat or nested,
    as the shortest decimal that narrow type rounds to that value: 0.1 in a float32 column reads as
    0.10000000149011612 in Python, which became the answer "0.10000000149011612" that no correct response
    matched (a struct answer, `reward_model.ground_truth`, too)."""
    for key, kind in narrow.items():
        if key in row:
            row[key] = _widen(row[key], kind)
    return row


#: Why a JSON row (or file) nested deeper than Python's recursion limit is not read.
_TOO_DEEP = "invalid JSON (nested too deeply: past Python's recursion limit)"


def _json_array(path: Path, keys: RepeatedKeys) -> list[tuple[int, Any]] | None:
    """(element number, row) pairs of a `.json` or `.jsonl` file holding one JSON array of rows (decoded with the
    `keys` hook), or None for any other file (JSON lines). Read line by line, such a file lost every row but the
    last of an array written one object per line (the others end with a comma) and trained on that one: a warning
    was all that said so."""
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()  # (json.loads of bytes skips the BOM itself)
    if not head.startswith(b"["):
        return None
    try:
        value = json.loads(path.read_bytes(), object_pairs_hook=keys)
    except ValueError:  # (not UTF-8 too) a JSON-lines file whose first row is a list: read as lines, reported
        return None
    except RecursionError:  # nested past Python's recursion limit somewhere: a bare RecursionError named no file
        with open(path, "rb") as f:
            first = next((line for line in f if line.strip()), b"")
        try:
            json.loads(first)
        except json.JSONDecodeError:  # the first line is no JSON value of its own ("[", "[{...},"): one array
            raise ConfigError(
                f"{path}: cannot read it as a JSON array (nested too deeply: past Python's recursion limit); fix "
                "the file or check env.path / env.eval_path"
            ) from None
        except (ValueError, RecursionError):  # (not UTF-8; or the first line is the deep row itself)
            return None  # JSON lines (or a one-line array): read as lines, the deep row a counted bad row
        return None  # JSON lines whose first row is a list, a later row the deep one: read as lines, reported
    return [(i + 1, row) for i, row in enumerate(value)] if isinstance(value, list) else None


def _plain_number(x: float | decimal.Decimal) -> str:
    """A number as a plain decimal: str(0.00001) is '1e-05' and str(1e16) '1e+16', which no grader matches against
    a model's 0.00001 or 10000000000000000. A float holding a whole number is that integer ('3', not '3.0'): an
    integer column with a null in it is float64 in pandas, Arrow and the Parquet or JSON written from them, so the
    answer 3 read as '3.0', which any reward comparing text (a remote or custom one, a judge) held against the
    model's 3. A decimal (a Parquet decimal column's scale pads every value: NUMERIC(5, 2) holds 3 as 3.00) reads
    as the same number as a float would: '3', '1.5'."""
    if isinstance(x, int):
        return str(x)
    if isinstance(x, decimal.Decimal):  # (not normalize(): it rounds to 28 digits, and decimal128 holds 38)
        text = format(x, "f")
        text = text.rstrip("0").rstrip(".") if "." in text else text
        return "0" if text in ("-0", "0", "") else text
    number = decimal.Decimal(repr(x))  # repr: the shortest digits that round-trip, not binary noise
    if x.is_integer():
        return format(number.to_integral_value(), "f") if x else "0"  # (-0.0 too)
    return format(number, "f")


def load_problems(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    name: str = "data",
    domain: str = "math",
    images_key: str = "images",
    split: str | None = None,
) -> tuple[list[Problem], list[tuple[int, str]]]:
    """Read problems from a file; returns (problems, skipped) with skipped = [(row number, reason)]. `split`
    names the split of a datasets folder (roll_envs.tasks._splits)."""
    problems, skipped, _ = _load(path, prompt_key, answer_key, name, domain, images_key, split=split, key="split")
    return problems, skipped


def _load(
    path: str | Path,
    prompt_key: str,
    answer_key: str,
    name: str,
    domain: str,
    images_key: str,
    *,
    split: str | None = None,
    key: str | None = None,
    held: bool = False,
) -> tuple[list[Problem], list[tuple[int, str]], frozenset[str]]:
    """load_problems, plus the ids of the problems whose row names no domain (they have `domain`); `split`, `key`
    and `held` choose a datasets folder's split (roll_envs.tasks._splits)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"data file {path} does not exist")
    rows, skipped, label = _read_rows(path, split, key, held=held)
    problems = []
    defaulted: set[str] = set()
    seen_keys: set[str] = set()  # keys of the bad object rows, to name the columns a wrong prompt_key missed
    pictures = _image_keys(images_key)
    # Only JSON text can hold a lone surrogate (a `\ud800` escape): Parquet and `datasets` strings are UTF-8.
    check_text = not path.is_dir() and path.suffix in (".jsonl", ".json")
    for lineno, row in rows:
        if not isinstance(row, dict):
            skipped.append((lineno, f"row is {type(row).__name__}, not an object"))
            continue
        (prompt, context, why), answer = _chat_prompt(prompt_key, row.get(prompt_key)), _nested(row, answer_key)
        why = why or _text_problem(prompt_key, prompt, numbers=False) or _templated(prompt_key, prompt, context)
        if why is None:
            # Numbers are answers too (JSON 5 -> "5"); NaN/inf (JSON's NaN extension, a float column) are not.
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = _plain_number(answer) if math.isfinite(answer) else answer
            elif isinstance(answer, decimal.Decimal) and answer.is_finite():  # a Parquet decimal column (SQL exports)
                answer = _plain_number(answer)
            why = _text_problem(answer_key, answer, numbers=True)
        images: list[Any] = []
        metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, "domain", *pictures)}
        why = why or (_metadata_problem(metadata) if check_text else None)
        own_domain, why = _row_domain(row) if why is None else (None, why)
        if why is None:
            images, why = _row_images(row, images_key, prompt, context, path.parent)
        if why is not None:
            skipped.append((lineno, why))
            seen_keys.update(row)
            continue
        ident = f"{name}:{path.name}{label}:{lineno}"
        if own_domain is None:
            defaulted.add(ident)
        problems.append(
            Problem(
                id=ident,
                prompt=prompt,
                answer=answer.strip(),
                domain=own_domain or domain,
                # The row's other columns reach rewards that declare `metadata` (constraints, test cases, tags).
                # (Not the pictures: metadata travels to the reward workers with every batch.)
                metadata=metadata,
                images=images,
                context=context,
            )
        )
    skipped.sort()
    log_skipped(path, skipped)
    if not problems:
        if not rows and not skipped:
            raise ConfigError(f"{path}: no usable rows: the file is empty; fill it or point env.path elsewhere")
        found = f"; the rows have keys {', '.join(map(repr, sorted(seen_keys)[:20]))}" if seen_keys else ""
        raise ConfigError(
            f"{path}: no usable rows ({len(skipped)} skipped, first: line {skipped[0][0]}: {skipped[0][1]}); "
            f"expected keys {prompt_key!r}, {answer_key!r}{found}: fix the rows or set env.prompt_key / "
            "env.answer_key"
        )
    return problems, skipped, frozenset(defaulted)


def log_skipped(path: str | Path, skipped: list[tuple[int, str]]) -> None:
    """One warning naming how many rows of `path` were skipped, and the first ten with their reasons."""
    if skipped:
        shown = "; ".join(f"line {n}: {why}" for n, why in skipped[:10])
        more = f" (and {len(skipped) - 10} more)" if len(skipped) > 10 else ""
        log.warning("%s: skipped %d bad row(s): %s%s", path, len(skipped), shown, more)


_ROLES = ("system", "user", "assistant")


def _chat_prompt(key: str, value: Any) -> tuple[Any, tuple[dict[str, str], ...], str | None]:
    """(prompt, context, why the row is bad or None) of a prompt column: a plain value is the prompt (for
    _text_problem to check); chat messages (verl's prepared rows: [{"role": "user", "content": ...}]) give the last
    user message's text and the text messages before it (a system message only first). The messages before were
    dropped: a row's own system prompt ("put the answer in \\boxed{}") and its few-shot turns never reached the
    model, and nothing said so."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1:
        value = value.tolist()  # (a 1-D numpy object array: how pandas hands a list column over)
    if not (isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value)):
        return value, (), None
    last = max((i for i, m in enumerate(value) if m.get("role") == "user"), default=None)
    if last is None:
        return None, (), f"{key!r} is chat messages without a user message"
    for i, m in enumerate(value[: last + 1]):
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES or (role == "system" and i > 0):
            where = "roles are system (first), user, assistant" if role in _ROLES else f"role {role!r} unknown"
            return None, (), f"message {i} of {key!r} has role {role!r} ({where})"
        if not isinstance(content, str):
            return None, (), f"{key!r} has type list (message {i}: {type(content).__name__} content), expected text"
        if (bad := _not_unicode(content)) is not None:
            return None, (), f"message {i} of {key!r} {bad}"
    context = tuple({"role": m["role"], "content": m["content"]} for m in value[:last])
    return value[last]["content"], context, None


def _row_domain(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the row's own domain or None when it names none, why the row is bad or None). A null in a Parquet column
    (or NaN) is no domain: it became the domain "None" ("nan"), which no reward routes and no metric expects."""
    value = row.get("domain")
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, None
    if not isinstance(value, str):
        return None, f"'domain' has type {type(value).__name__} ({str(value)[:40]}), expected text"
    if (bad := _not_unicode(value)) is not None:
        return None, f"'domain' {bad}"
    return (value.strip() or None), None


def _nested(row: dict[str, Any], key: str) -> Any:
    """row[key], or for a dotted key missing as a whole the nested value (`reward_model.ground_truth`)."""
    if key in row or "." not in key:
        return row.get(key)
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _image_keys(images_key: str) -> tuple[str, ...]:
    """Columns read as pictures: `images_key`, and the singular `image` when the default is used."""
    return (images_key, "image") if images_key == "images" else (images_key,)


def _row_images(
    row: dict[str, Any], images_key: str, prompt: str, context: tuple[dict[str, str], ...], base: Path
) -> tuple[list[Any], str | None]:
    """(the row's pictures, ready for load_image without a base folder; why the row is bad or None). The `<image>`
    markers counted are those of every user message (a chat row's earlier turns, `context`, and its prompt): the
    pictures are placed at them in order across the messages (roll_core.pipelines.rollout); a marker in a system or
    assistant message has no picture to stand for (it stayed literal text: for LLaVA, its picture token itself).
    Each picture is checked by its header only (`check_image`): decoding every picture of a large data set at load
    costs minutes."""
    from roll_core.multimodal import IMAGE_MARKER
    from roll_core.multimodal.images import check_image

    for i, m in enumerate(context):  # (context holds the row's messages before its prompt, numbered as in the row)
        if m["role"] != "user" and IMAGE_MARKER in m["content"]:
            where = f"message {i} ({m['role']}) of the prompt"
            return [], f"{where} has an {IMAGE_MARKER} marker: pictures go in user messages"
    value = next((row[k] for k in _image_keys(images_key) if row.get(k) is not None), None)
    if value is None:
        values: list[Any] = []
    elif isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1):
        values = list(value)  # (a 1-D numpy object array: how pandas hands a list column over)
    else:
        values = [value]
    markers = prompt.count(IMAGE_MARKER) + sum(m["content"].count(IMAGE_MARKER) for m in context if m["role"] == "user")
    if markers and markers != len(values):
        return [], f"the prompt has {markers} {IMAGE_MARKER} marker(s) but the row has {len(values)} picture(s)"
    out = []
    for j, v in enumerate(values):
        try:
            out.append(check_image(v, base))
        except ValueError as exc:
            return [], f"picture {j} of {images_key!r}: {exc}"
    return out, None


def _text_problem(key: str, value: Any, *, numbers: bool) -> str | None:
    """Why `value` cannot be a prompt (or answer) text, or None when it can."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return f"missing or empty {key!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key!r} is {value!r}, not a number"
    if not isinstance(value, str):
        kind = "text or a number" if numbers else "text"
        return f"{key!r} has type {type(value).__name__} ({str(value)[:40]}), expected {kind}"
    if (bad := _not_unicode(value)) is not None:
        return f"{key!r} {bad}"
    return None


def _templated(key: str, prompt: str, context: tuple[dict[str, str], ...]) -> str | None:
    """Why a row's prompt (or a message before it) is already chat-templated text, or None. The pipeline applies
    the model's chat template itself: such a prompt was templated twice, and the model saw a rendered chat, its
    turn markers as plain text, inside a user turn."""
    earlier = ((f"message {i} of {key!r}", m["content"]) for i, m in enumerate(context))
    for where, text in ((repr(key), prompt), *earlier):
        marker = templated_marker(text)
        if marker is not None:
            return (
                f"{where} is already chat-templated (it opens with {marker!r}) and would be templated again: give "
                "the raw user text, or chat messages as a list of {role, content}"
            )
    return None


def _metadata_problem(metadata: dict[str, Any]) -> str | None:
    """Why a JSON row's other columns (its metadata, which rewards, the distillation teacher's prompt and the
    samples written to disk read) are not Unicode text, or None: a lone surrogate in them loaded silently and failed
    mid-run wherever they were encoded (a tokenizer, a remote reward's request, a UTF-8 file)."""
    for key in metadata:
        if (bad := _not_unicode(key)) is not None:
            return f"a column name {bad}"
    todo = collections.deque((f"column {k!r}", v) for k, v in metadata.items())  # (first bad value first)
    while todo:
        where, value = todo.popleft()
        if isinstance(value, str) and (bad := _not_unicode(value)) is not None:
            return f"{where} {bad}"
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and (bad := _not_unicode(k)) is not None:
                    return f"{where} has a key that {bad}"
                todo.append((f"{where}[{k!r}]", v))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    return None


# UTF-16 surrogates: JSON decodes a proper pair of `\uXXXX` escapes to one character, so any left are lone.
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _not_unicode(text: str) -> str | None:
    """Why `text` is no Unicode text (it holds a lone surrogate), or None. JSON's `\\ud800` escape (text cut in
    the middle of a UTF-16 pair before it was dumped) loads as a str that no encoder takes: a prompt with one ended
    FileTask in a bare UnicodeEncodeError (the held-out hash) naming neither file nor row, and in an answer or a
    chat turn it failed mid-run in the tokenizer or the grader. (Parquet and `datasets` text is valid UTF-8.)"""
    found = _SURROGATE.search(text)
    if found is None:
        return None
    return (
        f"is not valid Unicode text (a lone surrogate \\u{ord(found.group()):04x} at character {found.start()}, "
        "a broken \\u escape)"
    )


class FileTask(Task):
    """Problems from user files; `skipped` lists every bad row as (file, row number, reason)."""

    def __init__(
        self,
        reward: Reward,
        path: str,
        name: str = "data",
        eval_path: str | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        eval_fraction: float = 0.1,
        eval_size: int = 100,
        system_prompt: str | None = None,
        images_key: str = "images",
        split: str | None = None,
        eval_split: str | None = None,
    ) -> None:
        super().__init__(reward)
        self.name, self.system_prompt = name, system_prompt
        for key, value in (("env.path", path), ("env.eval_path", eval_path)):
            if value and not Path(value).exists():  # name the setting: the loader only knows the file
                raise ConfigError(f"data file {value} does not exist: check {key}")
        keys = dict(prompt_key=prompt_key, answer_key=answer_key, domain="math", images_key=images_key)
        if eval_split is not None and not eval_path:  # (it would be ignored unsaid)
            raise ConfigError(f"env.eval_split={eval_split!r} names a split of env.eval_path, which is not set")
        problems, skipped, defaulted = _load(path, name=name, split=split, key="env.split", **keys)
        self.skipped = [(str(path), n, why) for n, why in skipped]
        held = None
        if eval_path:
            held, eval_skipped, eval_defaulted = _load(
                eval_path,
                name=eval_file_name(name, path, eval_path),
                split=eval_split,
                key="env.eval_split",
                held=True,
                **keys,
            )
            self.skipped += [(str(eval_path), n, why) for n, why in eval_skipped]
            defaulted |= eval_defaulted
        # Rows that name no domain (they have "math"): env=multi with route=column gives them the sub-task's own
        # domain instead (its reward), not whichever sub-task happens to be called "math".
        self.default_domain_ids = defaulted
        self._train, self._eval = self.split_held_out(
            problems,
            held,
            eval_fraction=eval_fraction,
            eval_size=eval_size,
            path=path,
            eval_path=eval_path,
        )

    @classmethod
    def conformance_task(cls, seed: int, workdir: Path) -> FileTask:
        """A small instance for roll_core.testing.tasks' suite: 300 sums written as JSONL to `workdir` (the
        held-out split is by a stable hash of the prompt, so `seed` changes nothing)."""
        from roll_envs.rewards.math import MathReward

        path = workdir / "rows.jsonl"
        rows = [{"prompt": f"What is {i} + {i}? Box it.", "answer": str(2 * i)} for i in range(300)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return cls(MathReward(), path=str(path), eval_size=30)
