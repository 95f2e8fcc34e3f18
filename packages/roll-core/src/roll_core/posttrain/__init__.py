"""Post-training data: reading row files (SFT, preference pairs, distillation rows) and tokenising them into
batches in roll_core.protocol's layout, for the file-fed collectors (pipeline=sft|dpo|distill_offline).

- `config.DataConfig`: the run config's `data` node (where the rows are, their form, column names, limits).
- `rows`: files to rows (JSONL, JSON, Parquet, CSV, a `datasets` folder; local only) with counted skips.
- `tokenize`: SFT rows (chat, prompt/completion, token ids) to token rows with assistant-only loss masks,
  and `tokenizer_fingerprint`.
- `pairs`: preference rows, and pairs built from a rollout-only output file.
- `distill`: teacher top-k log-probs stored with distillation rows, validated.
- `source`: `RowSource` (len, batch(indices) -> Batch, skipped) and the loaders with their held-out split.
"""
