"""The bad-input corpus, beyond configs: runs refused at build, bad data rows, the shared RLVR run that meets many bad
inputs at once, rewards that fail behind the guard, model outputs adversarial for parsers, failing environments and
roll-eval. The rows' kinds, the probes and the runner: bad_input_corpus.py; the config rows:
test_bad_inputs_config.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # bad_input_corpus (and the helpers configs name by module)
pytest.register_assert_rewrite("bad_input_corpus")  # before its import: its probes' asserts explain themselves
from bad_input_corpus import (  # noqa: E402
    HUGE,
    C,
    Case,
    Corpus,
    E,
    P,
    ResetRaises,
    StepHangs,
    StepRaises,
    agentic_malformed,
    build,
    check,
    empty_dir,
    env_manager,
    file_task,
    guarded,
    huge_prompt,
    malformed_env,
    roll_eval,
    run_steps,
    scored,
    shared_evals,
    shared_metric,
    shared_one_prompt_two_ranks,
    shared_skipped_rows,
)

GOOD7 = [{"prompt": f"say 7 #{i}", "answer": "7"} for i in range(30)]  # 30 good rows; the bad line is line 31

CASES: list[Case] = [
    # -- runs refused at build: the world disagrees with the config ------------------------------------------------
    E(
        "run/model-path-missing",
        build("model.path=/nonexistent/model"),
        r"model\.path=/nonexistent/model does not exist .*point model\.path at a Hugging Face model folder",
    ),
    E(
        "run/model-folder-without-config",
        lambda c: build(f"model.path={empty_dir(c)}")(c),
        r"model\.path=.*not-a-model is a folder without config\.json: point model\.path at",
    ),
    E(
        "run/model-builtin-unknown",
        build("model.path=builtin:nope"),
        r"model\.path=builtin:nope: unknown builtin model 'nope'; builtins: tiny",
    ),
    E(
        "run/data-file-missing",
        lambda c: build(f"env.path={c.path('missing.jsonl')}")(c),
        r"data file .*missing\.jsonl does not exist: check env\.path",
    ),
    E(
        "run/eval-file-missing",
        lambda c: build(f"env.eval_path={c.path('held.jsonl')}")(c),
        r"data file .*held\.jsonl does not exist: check env\.eval_path",
    ),
    E(
        "run/empty-eval-set-with-eval-every",  # once reported as "every prompt exceeds max_prompt_length"
        build("env.eval_size=0", "pipeline.eval_every=1"),
        r"^pipeline\.eval_every=1 but the held-out set of env=data is empty .*set pipeline\.eval_every=0",
    ),
    E(
        "run/gigpo-with-rlvr",
        build("algo.adv_estimator=gigpo"),
        r"algo\.adv_estimator=gigpo groups steps of multi-turn episodes: use pipeline=agentic",
    ),
    E(
        "run/ppo-with-agentic",
        build("algo=ppo", agentic=True),
        r"algo\.adv_estimator=gae has no trajectory form: use one of .*grpo",
    ),
    E("run/agentic-with-file-env", build("pipeline=agentic"), r"pipeline=agentic needs an agentic env .*got FileTask"),
    E(  # an agentic env's env.name is null: the message said env=None
        "run/multi-turn-env-with-rlvr",
        build("pipeline=rlvr", "env.env=sokoban", agentic=True),
        r"^env=sokoban is a multi-turn environment, which pipeline=rlvr cannot run \(it samples single-turn "
        r"prompts\): use pipeline=agentic",
    ),
    E(
        "run/multi-turn-env-with-sft-eval",
        lambda c: build(
            "pipeline=sft", f"data.path={c.seven}", "env.env=sokoban", "pipeline.eval_every=1", agentic=True
        )(c),
        r"^env=sokoban is a multi-turn environment: an SFT run evaluates single-turn tasks only; set "
        r"sft\.eval_task=false .*pipeline=agentic",
    ),
    E(
        "run/dapo-filtering-with-agentic",
        build("algo.drop_uniform_groups=true", "algo.reward_clip=1.0", agentic=True),
        r"algo\.drop_uniform_groups=true, algo\.reward_clip=1\.0: dynamic sampling and reward shaping apply to "
        r"single-turn prompts \(pipeline=rlvr\), not to pipeline=agentic's episodes",
    ),
    E(
        "run/fsdp2-on-local",
        build("train_engine=fsdp2"),
        r"actor_train: world_size=2 .* local backend cannot give: use cluster=ray",
    ),
    E(  # a context no prompt fits: said before any rollout (it was a bare ValueError after the first one)
        "run/engine-context-holds-no-prompt",
        build("infer_engine.max_model_len=10"),
        r"^infer_engine\.max_model_len=10 holds no prompt: the chat template alone takes 22 tokens .*raise "
        r"infer_engine\.max_model_len \(prompt \+ response tokens\) above model\.max_prompt_length \+ "
        r"model\.max_response_length",
    ),
    E(  # a context past the template but below every prompt of a step (32-33 tokens here): one clear error
        "run/engine-context-below-every-prompt",
        run_steps("infer_engine.max_model_len=25", "pipeline.max_steps=1"),
        r"^every prompt fills the inference engine's context \(shortest 32 tokens, longest 33\): raise "
        r"infer_engine\.max_model_len .*or lower model\.max_prompt_length below it",
    ),
    E(
        "run/every-prompt-too-long",  # a whole pass over the data is tried first, then the limit is named
        run_steps("model.max_prompt_length=4", "pipeline.max_steps=1"),
        r"every prompt exceeds model\.max_prompt_length=4 \(shortest: \d+ tokens\): raise model\.max_prompt_length",
    ),
    # -- data rows (FileTask, JSONL and Parquet) -------------------------------------------------------------------
    C(
        "data/broken-json-line",
        file_task(lambda c: c.jsonl("a.jsonl", GOOD7, b'{"prompt": "x", "answer": \n')),
        "FileTask.skipped",
        r"a\.jsonl: line 31: invalid JSON",
    ),
    C(
        "data/not-utf8-line",
        file_task(
            lambda c: c.jsonl(
                "a.jsonl", GOOD7, b'{"prompt": "\xff\xfe", "answer": "7"}\n' + json.dumps(GOOD7[0]).encode() + b"\n"
            )
        ),
        "FileTask.skipped",
        r"a\.jsonl: line 31: not UTF-8 text",
    ),
    C(
        "data/missing-prompt-key",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"question": "x", "answer": "7"}])),
        "FileTask.skipped",
        r"line 31: missing or empty 'prompt'",
    ),
    C(
        "data/blank-prompt",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": " \n\t", "answer": "7"}])),
        "FileTask.skipped",
        r"line 31: missing or empty 'prompt'",
    ),
    C(
        "data/prompt-is-a-list",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": [{"role": "user"}], "answer": "7"}])),
        "FileTask.skipped",
        r"line 31: 'prompt' has type list .*expected text",
    ),
    C(
        "data/missing-answer",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": "x"}])),
        "FileTask.skipped",
        r"line 31: missing or empty 'answer'",
    ),
    C(
        "data/answer-is-a-list",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": "x", "answer": [1, 2]}])),
        "FileTask.skipped",
        r"line 31: 'answer' has type list \(\[1, 2\]\), expected text or a number",
    ),
    C(
        "data/answer-is-a-bool",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": "x", "answer": True}])),
        "FileTask.skipped",
        r"line 31: 'answer' has type bool",
    ),
    C(
        "data/answer-is-nan",
        file_task(lambda c: c.jsonl("a.jsonl", GOOD7, b'{"prompt": "x", "answer": NaN}\n')),
        "FileTask.skipped",
        r"line 31: 'answer' is nan, not a number",
    ),
    P(
        "data/answer-is-a-number",
        file_task(lambda c: c.jsonl("a.jsonl", [{"prompt": f"q{i}", "answer": 7} for i in range(30)])),
        r"answers: 7(,7)+$",
    ),
    C(
        "data/row-not-an-object",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, [1, 2]])),
        "FileTask.skipped",
        r"line 31: row is list, not an object",
    ),
    C(
        "data/parquet-null-prompt",
        file_task(
            lambda c: c.parquet("a.parquet", {"prompt": [f"q{i}" for i in range(29)] + [None], "answer": ["7"] * 30})
        ),
        "FileTask.skipped",
        r"a\.parquet: line 30: missing or empty 'prompt'",
    ),
    E(
        "data/empty-file",
        file_task(lambda c: c.write("a.jsonl", "")),
        r"a\.jsonl: no usable rows: the file is empty; fill it or point env\.path",
    ),
    E(
        "data/blank-lines-only",
        file_task(lambda c: c.write("a.jsonl", "\n \n\n")),
        r"a\.jsonl: no usable rows: the file is empty",
    ),
    E(
        "data/every-line-broken",
        file_task(lambda c: c.write("a.jsonl", "{\n{\n")),
        r"a\.jsonl: no usable rows \(2 skipped, first: line 1: invalid JSON .*\); expected keys 'prompt', 'answer'",
    ),
    E(
        "data/parquet-wrong-columns",
        file_task(lambda c: c.parquet("a.parquet", {"question": ["q"] * 3, "solution": ["7"] * 3})),
        r"a\.parquet: no usable rows .*the rows have keys 'question', 'solution': fix the rows or set env\.prompt_key",
    ),
    E(
        "data/parquet-corrupt",
        file_task(lambda c: c.write("a.parquet", b"PAR1 not really")),
        r"a\.parquet: cannot read it as Parquet .*check the file or env\.path",
    ),
    E(
        "data/unsupported-format",
        file_task(lambda c: c.write("a.csv", "prompt,answer\nx,7\n")),
        r"unsupported data file .*a\.csv \(env\.path / env\.eval_path\): use \.jsonl, \.parquet",
    ),
    E(
        "data/every-row-held-out",
        file_task(lambda c: c.jsonl("a.jsonl", GOOD7[:3]), eval_fraction=0.999),
        r"a\.jsonl: every row fell in the held-out split; lower env\.eval_fraction or give env\.eval_path",
    ),
    C(
        "data/huge-prompt-10MB",
        huge_prompt,
        "data/skipped_long_prompts",
        r"tokenised prompts of \[\d+, \d+\] characters",
    ),
    # -- the shared run: bad data, faulty rewards, a rank without prompts, one held-out prompt ----------------------
    C(
        "run/bad-rows-skipped",
        shared_skipped_rows,
        "FileTask.skipped",
        r"(?m)^line 8: invalid JSON.*\n^line 9: not UTF-8",
    ),
    C("run/huge-prompts-skipped", shared_metric("data/skipped_long_prompts"), "data/skipped_long_prompts"),
    C(
        "run/reward-raises",
        shared_metric("reward/errors"),
        "reward/errors",
        r"failed on row \d+: .*RuntimeError: a reward bug",
    ),
    C("run/reward-returns-nan", shared_metric("reward/nonfinite"), "reward/nonfinite", r"returned nan for row"),
    C("run/reward-hangs", shared_metric("reward/timeouts"), "reward/timeouts", r"did not score row \d+ within 0\.5s"),
    P("run/infer-rank-given-no-prompt", shared_one_prompt_two_ranks),  # once crashed: world_size=2, one prompt
    P("run/eval-one-held-out-prompt", shared_evals),  # once crashed: one held-out prompt on two ranks
    # -- rewards behind the guard ----------------------------------------------------------------------------------
    C("reward/raises", guarded(["raise", "7"]), "errors"),
    C("reward/returns-nan", guarded(["nan", "7"]), "nonfinite"),
    C("reward/returns-inf", guarded(["inf", "7"]), "nonfinite"),
    C("reward/hangs", guarded(["hang", "7"]), "timeouts"),
    C("reward/returns-none", guarded(["none", "7"]), "errors"),
    C("reward/kills-its-process", guarded(["exit", "7"]), "errors"),
    P("reward/one-score-short", guarded(["short", "7"]), r"scores \[0\.0, 1\.0\]"),  # rescored row by row: exact
    # -- model output adversarial for parsers ----------------------------------------------------------------------
    C(
        "parse/countdown-100k-long-product",
        scored("countdown", "\\boxed{" + "*".join(["1"] * 100_000) + "}", "1|1"),
        "errors",
    ),
    C(
        "parse/countdown-5000-nested-parens",
        scored("countdown", "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}", "1|1"),
        "errors",
    ),
    C(
        "parse/countdown-900-deep-product",
        scored("countdown", "\\boxed{" + "*".join(["1"] * 450) + "}", "1|1"),
        "wrong_numbers",
    ),
    C("parse/countdown-10k-digits", scored("countdown", "\\boxed{" + "9" * 10_000 + "}", "7|1,2,4"), "errors"),
    C("parse/countdown-power-tower", scored("countdown", "\\boxed{9**9**9**9}", "7|1,2,4"), "errors"),
    C("parse/countdown-division-by-zero", scored("countdown", "\\boxed{1/(2-2)+4}", "7|1,2,2,4"), "errors"),
    C(
        "parse/countdown-code-in-box",
        scored("countdown", "\\boxed{__import__('os').system('true')}", "7|1,2,4"),
        "errors",
    ),
    C("parse/countdown-bad-ground-truth", scored("countdown", "\\boxed{1+2+4}", "seven"), "errors"),  # once uncaught
    C("parse/countdown-unterminated-box", scored("countdown", "\\boxed{1+2+4", "7|1,2,4"), "no_boxed"),
    P("parse/countdown-right-answer", scored("countdown", "\\boxed{(1+2)+4}", "7|1,2,4", want=1.0)),
    P("parse/math-huge-output", scored("math", "a" * HUGE + " \\boxed{7}", "7", want=1.0)),
    C("parse/math-unterminated-box", scored("math", "so \\boxed{7", "7"), "no_boxed"),
    C("parse/math-100k-box-openers", scored("math", "\\boxed{" * 100_000, "7"), "no_boxed"),
    C(
        "parse/math-100k-nested-braces",
        scored("math", "\\boxed{" + "{" * 100_000 + "7" + "}" * 100_000 + "}", "7"),
        "errors",  # refused by length at once: math-verify's SIGALRM timeout once let it run for 10 minutes
    ),
    C(
        "parse/math-5000-nested-parens",
        scored("math", "\\boxed{" + "(" * 5000 + "7" + ")" * 5000 + "}", "7"),
        "errors",
    ),
    P("parse/math-10k-digits", scored("math", "\\boxed{" + "9" * 10_000 + "}", "7", want=0.0)),
    # -- environments ----------------------------------------------------------------------------------------------
    C("env/step-raises", env_manager(StepRaises), "env_errors", r"env_error: environment step raised RuntimeError"),
    C("env/reset-raises", env_manager(ResetRaises, method="reset"), "env_errors", r"environment reset raised OSError"),
    C(
        "env/step-hangs",
        env_manager(StepHangs, timeout_s=0.2),
        "env_timeouts",
        r"env_timeout: environment step did not return within 0\.2s",
    ),
    C(
        "env/step-malformed-result",
        env_manager(malformed_env),
        "env_errors",
        r"raised ValueError: step returned 3 values; an environment's step returns \(observation, reward, terminated",
    ),
    C(
        "env/step-nan-reward",
        env_manager(malformed_env),
        "env_errors",
        r"step returned the reward nan; rewards must be finite",
    ),
    C(
        "env/step-reward-not-a-number",
        env_manager(malformed_env),
        "env_errors",
        r"step returned the reward 'lots'; rewards must be finite",
    ),
    C("env/agentic-run-malformed-env", agentic_malformed, "env/env_errors", r"2 steps"),
    # -- roll-eval -------------------------------------------------------------------------------------------------
    P(
        "eval/dtype-auto",
        roll_eval("builtin:tiny", "model=tiny", "model.dtype=auto", "--samples", "2"),
        r"accuracy [\d.]+ on 2 held-out",
    ),
    E(
        "eval/empty-eval-set",
        roll_eval("builtin:tiny", "model=tiny", "env.eval_size=0"),
        r"exit 2: .*env=arithmetic has no held-out problems to evaluate .*\(env\.eval_size, env\.eval_path\)",
    ),
    E(
        "eval/model-missing",
        roll_eval("/nonexistent/model", "model=tiny"),
        r"exit 2: .*model\.path=/nonexistent/model does not exist",
    ),
    E("eval/bad-override", roll_eval("builtin:tiny", "model=tiny", "algo.lr=abc"), r"exit 2: .*full_key: algo\.lr"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, corpus: Corpus) -> None:
    check(case, corpus)


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)
    # ids unique across the corpus's modules too: the cfg/ rows are in test_bad_inputs_config.py
    assert not any(c.id.startswith("cfg/") for c in CASES), [c.id for c in CASES if c.id.startswith("cfg/")]
