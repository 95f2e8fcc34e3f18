"""What the file-fed collectors call: `load_rows(kind, data, tokenizer, ...)` -> train and held-out `RowSource`s.

Kinds: `sft` (messages, prompt/completion, token rows; rollout rows read as token rows, filtered by
`data.min_score` on the score column `pairs.score_column` picks: the 0/1 `correct` flag, else the reward),
`preference` (explicit pairs or pairs built from rollout rows), `distill` (SFT rows plus the teacher's top-k,
filtered like SFT's). Files are read in order (`data.path` may be a list or a glob), each file's row form detected
from its columns unless `data.format` names it; bad rows are counted skips (`RowSource.skipped`, reason -> count,
logged once with the first rows); a file where every row is bad is a ConfigError naming the first reason.
The held-out split is `data.eval_path` when given (training examples whose prompt it holds too, whitespace aside,
are counted in `stats["also_held_out"]`, logged and reported in the run's `also_held_out` (`PostTrainData`), not
dropped: a run may evaluate on its training rows on purpose), else `data.eval_size` rows of `data.path` chosen by a
stable hash of their prompt (deterministic, a prompt's rows on one side, and those of a prompt equal to it but for
whitespace with them: roll_core.posttrain.tokenize `loose_prompt_keys`).

`RowSource.batch(indices)` gives a `Batch` in roll_core.protocol's layout: `prompts` (B, P) left-padded,
`responses` / `response_mask` (B, R) right-padded (the mask is the loss mask and may have holes: multi-turn
context), `input_ids` / `attention_mask` / `position_ids` (B, P+R) with attention on every real token (context
tokens inside the response included) and positions counting them. Preference batches hold 2N rows, pair i's chosen
at row 2i and its rejected at 2i+1, with `pair_index` (2N,) long and `is_chosen` (2N,) bool. Distillation batches
add `teacher_topk_ids` (B, R, K) long and `teacher_topk_logprobs` (B, R, K) float32, 0 where `response_mask` is 0.
Every batch has the field `where` ("file:row" per row).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from roll_core.errors import ConfigError
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.distill import DistillParser, teacher_tensors
from roll_core.posttrain.pairs import (
    PREFERENCE_FORMATS,
    Pair,
    build_pairs,
    check_score_settings,
    parse_preference,
    score_column,
    score_of,
)
from roll_core.posttrain.row_values import KNOWN_ROLES
from roll_core.posttrain.rows import RawRow, SkipRow, Skips, apply, held_out, read_rows
from roll_core.posttrain.tokenize import SFT_FORMATS, SFTTokenizer, TokenRow, detect_format, loose_prompt_keys
from roll_core.protocol import Batch
from roll_core.sequences import pad_left

log = logging.getLogger(__name__)

KINDS = ("sft", "preference", "distill")


def token_batch(rows: Sequence[TokenRow], pad_id: int) -> dict[str, torch.Tensor]:
    """The protocol's tensors for token rows: `prompts` (B, P), `responses`/`response_mask` (B, R),
    `input_ids`/`attention_mask`/`position_ids` (B, P+R) (see the module doc)."""
    b = len(rows)
    r = max((len(t.response_ids) for t in rows), default=0)
    responses = torch.full((b, r), pad_id, dtype=torch.long)
    mask = torch.zeros((b, r), dtype=torch.long)
    for i, t in enumerate(rows):
        n = len(t.response_ids)
        if n:
            responses[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
            mask[i, :n] = torch.tensor(t.mask, dtype=torch.long)
    prompts, prompt_mask = pad_left([t.prompt_ids for t in rows], pad_id)
    # Attention by position, not by the loss mask: context tokens inside the response are real input, and a
    # template token may share the pad id (SmolLM2's <|im_end|>).
    lengths = torch.tensor([len(t.response_ids) for t in rows], dtype=torch.long)
    present = (torch.arange(r)[None, :] < lengths[:, None]).long()
    attention = torch.cat([prompt_mask, present], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp_min(0),
    }


class RowSource:
    """Tokenised examples of one kind (TokenRows, or Pairs for `preference`) and their batches.

    `skipped` (reason -> rows), `truncated` (the responses of its examples that were cut to max_response_length, both
    sides of a pair counted; a row or pair skipped after its cut is not), `other_roles` (role -> examples with a turn of
    that role roll does not know, rendered as untrained context: roll_core.posttrain.row_values), `renamed_roles` (alias
    -> examples whose messages named a role by another data set's name, read as the role it names: "human->user") and
    `stats` (kind-specific counts, e.g. `prompts_without_pair`) describe how the files were read, for the run's
    metrics."""

    def __init__(
        self,
        kind: str,
        items: Sequence[TokenRow | Pair],
        pad_id: int,
        *,
        skipped: dict[str, int] | None = None,
        stats: dict[str, int] | None = None,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
        self.kind, self.items, self.pad_id = kind, list(items), pad_id
        self.skipped = dict(skipped or {})
        sides = (t for x in self.items for t in ((x.chosen, x.rejected) if isinstance(x, Pair) else (x,)))
        self.truncated = sum(t.truncated for t in sides)
        self.other_roles: dict[str, int] = {}
        self.renamed_roles: dict[str, int] = {}
        for x in self.items:
            parts = (x.chosen, x.rejected) if isinstance(x, Pair) else (x,)
            for counts, field in ((self.other_roles, "other_roles"), (self.renamed_roles, "renamed_roles")):
                for name in {n for t in parts for n in getattr(t, field)}:  # an example (a pair) counts once
                    counts[name] = counts.get(name, 0) + 1
        self.stats = dict(stats or {})

    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> list[int]:
        """Real tokens (prompt + response) of each example; a pair counts both of its rows."""

        def n(t: TokenRow) -> int:
            return len(t.prompt_ids) + len(t.response_ids)

        return [n(x.chosen) + n(x.rejected) if isinstance(x, Pair) else n(x) for x in self.items]

    def batch(self, indices: Sequence[int]) -> Batch:
        """The examples at `indices` (in that order) as one Batch (a preference batch has 2 rows per pair)."""
        items = [self.items[int(i)] for i in indices]
        if self.kind == "preference":
            rows = [t for p in items for t in (p.chosen, p.rejected)]
        else:
            rows = items
        tensors = token_batch(rows, self.pad_id)
        if self.kind == "preference":
            tensors["pair_index"] = torch.arange(len(items), dtype=torch.long).repeat_interleave(2)
            tensors["is_chosen"] = torch.tensor([True, False] * len(items), dtype=torch.bool)
        elif self.kind == "distill":
            tensors.update(teacher_tensors(rows, tensors["responses"].shape[1], tensors["response_mask"]))
        return Batch(tensors, {"where": [t.where for t in rows]})


@dataclass
class PostTrainData:
    """The training rows and the held-out rows (None without `data.eval_path` or `data.eval_size`).

    Its `skipped_rows` and `also_held_out` are roll_core.interfaces.tasks.DataCounts: the post-training collectors
    report them as the RLVR and agentic ones report their task's (`data_counts`: the run summary's `skipped_rows`
    and `also_held_out`, every step's `data/skipped_rows` and `data/also_held_out`)."""

    train: RowSource
    eval: RowSource | None = None

    @property
    def skipped_rows(self) -> dict[str, int]:
        """Bad rows skipped reading `data.path` and `data.eval_path`, by reason (a post-training skip names its
        reason, e.g. `template_error`, where a task's names its file; the log names the rows)."""
        out = dict(self.train.skipped)
        for reason, n in (self.eval.skipped if self.eval is not None else {}).items():
            out[reason] = out.get(reason, 0) + n
        return out

    @property
    def other_roles(self) -> dict[str, int]:
        """Examples of `data.path` and `data.eval_path` with turns of a role roll does not know (role -> examples:
        `RowSource.other_roles`, rendered as untrained context), as `skipped_rows` sums their skips: the run
        summary's `other_roles`."""
        out = dict(self.train.other_roles)
        for role, n in (self.eval.other_roles if self.eval is not None else {}).items():
            out[role] = out.get(role, 0) + n
        return dict(sorted(out.items()))

    @property
    def renamed_roles(self) -> dict[str, int]:
        """Examples of `data.path` and `data.eval_path` whose messages named a role by another data set's name, by
        rename ("human->user" -> examples: `RowSource.renamed_roles`, read as the standard role), summed as
        `other_roles` is: the run summary's `renamed_roles`."""
        out = dict(self.train.renamed_roles)
        for name, n in (self.eval.renamed_roles if self.eval is not None else {}).items():
            out[name] = out.get(name, 0) + n
        return dict(sorted(out.items()))

    @property
    def also_held_out(self) -> int | None:
        """Training examples whose prompt a held-out example has too (`_count_shared_prompts`): kept and trained
        on, unlike the RLVR tasks' (which leave them out), since evaluating on training rows may be the point; so
        the held-out metrics partly measure trained prompts. 0 for a `data.eval_size` split (a prompt's rows,
        and those of a prompt equal to it but for whitespace, stay on one side); None without held-out rows
        (nothing to count)."""
        if self.eval is None:
            return None
        return int(self.train.stats.get("also_held_out", 0))


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id (padding is never attended nor trained)."""
    for pid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pid is not None:
            return int(pid[0] if isinstance(pid, list) else pid)
    raise ConfigError("the tokenizer has neither a pad nor an eos token to pad batches with")


def load_rows(
    kind: str,
    data: DataConfig,
    tokenizer: Any,
    *,
    max_prompt_length: int,
    max_response_length: int,
    seed: int = 0,
) -> PostTrainData:
    """Read `data.path` (and `data.eval_path`) as rows of `kind` (sft | preference | distill) for `tokenizer`,
    with the model's length limits; `seed` orders the pairs built from rollout rows."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
    pad = pad_id_of(tokenizer)

    def load(paths: list[str], setting: str) -> RowSource:
        sft = SFTTokenizer(
            tokenizer, data, max_prompt_length=max_prompt_length, max_response_length=max_response_length
        )
        skips = Skips()
        stats: dict[str, int] = {}
        items = _parse(kind, read_rows(paths, setting, skips), sft, setting, skips, stats, seed)
        skips.log_summary(setting)
        skips.check_any(len(items), setting)
        if not items:
            what = "rows"
            if kind == "preference":
                # the score column (pairs.score_column) may be a 0/1 flag beside a continuous reward
                hint = f"; data.correct_key=null scores them by {data.reward_key!r}" if data.correct_key else ""
                what = f"pairs (no prompt has two samples whose scores differ by more than data.pair_margin{hint})"
            raise ConfigError(f"{setting}: no usable {what}")
        source = RowSource(kind, items, pad, skipped=skips.counts, stats=stats)
        for role, n in sorted(source.other_roles.items()):  # once per role: kept, but maybe not what was meant
            log.warning(
                "%s: %d of %d examples have turns of role %r, which the chat template renders as context, never "
                "trained (roll knows the roles %s; only assistant turns are trained)",
                setting,
                n,
                len(source),
                role,
                ", ".join(KNOWN_ROLES),
            )
        if source.renamed_roles:  # once per load: read as meant, but said (the run summary's renamed_roles)
            log.info(
                "%s: read roles named by another data set as the standard ones (examples): %s",
                setting,
                ", ".join(f"{name} ({n})" for name, n in sorted(source.renamed_roles.items())),
            )
        return source

    train = load(data.paths, "data.path")
    if data.eval_paths:
        held = load(data.eval_paths, "data.eval_path")
        return PostTrainData(_count_shared_prompts(train, held, tokenizer), held)
    if data.eval_size:
        keys = [x.key for x in train.items]
        kept, held = held_out(train.items, keys, data.eval_size, "data.path", _loose_keys(train, tokenizer))
        ev = RowSource(kind, held, pad, stats={"held_out": len(held)})
        return PostTrainData(RowSource(kind, kept, pad, skipped=train.skipped, stats=train.stats), ev)
    return PostTrainData(train)


def _count_shared_prompts(train: RowSource, held: RowSource, tokenizer: Any) -> RowSource:
    """`train`, with `stats["also_held_out"]` counting its examples whose prompt a `data.eval_path` example has, but
    for whitespace (`loose_prompt_keys`: "Q?" and "Q?\\n" are one prompt, as the RL tasks count them), and one
    warning saying so: the held-out loss then measures rows the model trains on. Kept, not dropped: an evaluation on
    (a copy of) the training rows is a use of its own (how well a student fits its teacher); what was wrong is that
    nothing said so."""
    keys = set(_loose_keys(held, tokenizer))
    shared = sum(k in keys for k in _loose_keys(train, tokenizer))
    if shared:
        log.warning(
            "data.path: %d of its %d examples have a prompt that data.eval_path holds too (whitespace aside): the "
            "held-out metrics measure prompts the model trains on (remove them from one side for a held-out measure)",
            shared,
            len(train),
        )
        train.stats["also_held_out"] = shared
    return train


def _loose_keys(source: RowSource, tokenizer: Any) -> list[str]:
    """Each example's prompt as `loose_prompt_keys` (a pair's: its chosen row's, the same prompt as its rejected)."""
    prompts = [x.chosen.prompt_ids if isinstance(x, Pair) else x.prompt_ids for x in source.items]
    return loose_prompt_keys(tokenizer, prompts)


def _parse(
    kind: str,
    rows: list[RawRow],
    sft: SFTTokenizer,
    setting: str,
    skips: Skips,
    stats: dict[str, int],
    seed: int,
) -> list[Any]:
    """Rows to examples, file by file (each file's form detected from its own columns)."""
    by_file: dict[str, list[RawRow]] = {}
    for raw in rows:
        by_file.setdefault(raw.file, []).append(raw)
    allowed = PREFERENCE_FORMATS if kind == "preference" else SFT_FORMATS
    distill = DistillParser(sft) if kind == "distill" else None
    forms = {file: detect_format(file_rows, sft.cfg, allowed, setting) for file, file_rows in by_file.items()}
    # data.min_score reads one score column over every token row of the load (see pairs.score_column)
    scored = [raw for file, file_rows in by_file.items() if forms[file] == "tokens" for raw in file_rows]
    column = score_column(scored, sft.cfg)
    if sft.cfg.min_score is not None and scored:
        check_score_settings(column, sft.cfg, setting, "min_score")
    out: list[Any] = []
    rollout: list[RawRow] = []  # pairs may join samples from several files (a sharded rollout)
    for file, file_rows in by_file.items():
        form = forms[file]
        if sft.cfg.min_score is not None and (kind == "preference" or form != "tokens"):
            # it was silently ignored for preference pairs and for distillation rows
            raise ConfigError(
                f"data.min_score filters rollout (token) rows by score for SFT and distillation; {file} holds "
                f"{form} rows" + (" for preference pairs" if kind == "preference" else "")
            )
        if form == "rollout":
            rollout += file_rows
            continue
        own = Skips()
        if form == "preference":
            got = apply(file_rows, lambda raw: parse_preference(raw, sft), own)
        elif distill is not None:
            got = apply(file_rows, lambda raw, f=form: distill.parse(_above_min_score(raw, f, sft, column), f), own)
        else:
            got = apply(file_rows, lambda raw, f=form: sft.parse(_above_min_score(raw, f, sft, column), f), own)
        # One bad file is an error even beside good ones; a file whose rows all fell below data.min_score is not
        # bad (a Parquet rollout's per-step part with no correct sample: the whole load failed)
        if set(own.counts) != {"below_min_score"}:
            own.check_any(len(got), f"{setting} ({file})")
        skips.merge(own)
        out += got
    if rollout:
        out += build_pairs(rollout, sft, seed=seed, skips=skips, stats=stats, setting=setting)
    return out


def _above_min_score(raw: RawRow, form: str, sft: SFTTokenizer, column: str) -> RawRow:
    """`raw`, or SkipRow("below_min_score") for a token row whose score (in `column`) is below `data.min_score`."""
    cfg = sft.cfg
    if form == "tokens" and cfg.min_score is not None:
        score = score_of(raw.row, cfg, column)
        if score < cfg.min_score:
            raise SkipRow("below_min_score", f"{column} {score} < data.min_score={cfg.min_score}")
    return raw
