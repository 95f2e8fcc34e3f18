"""The bad-input corpus, configs: unknown keys and options, wrong types, values out of range and incompatible
combinations, each refused with a message that names the key and the fix. The rows' kinds, the probes and the
runner: bad_input_corpus.py; the other rows: test_bad_inputs_run.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # bad_input_corpus (and the helpers configs name by module)
pytest.register_assert_rewrite("bad_input_corpus")  # before its import: its probes' asserts explain themselves
from bad_input_corpus import Case, Corpus, E, check, compose  # noqa: E402

CASES: list[Case] = [
    # -- configs: unknown keys and options ------------------------------------------------------------------------
    E("cfg/unknown-key", compose("algo.lrr=1e-5"), r"Key 'lrr' not in 'AlgoConfig'.*Did you mean 'algo\.lr'\?"),
    E(
        "cfg/unknown-key-forced-with-plus",
        compose("+pipeline.max_stepz=3"),
        r"Key 'max_stepz' not in 'PipelineConfig' \(full_key: pipeline\.max_stepz\)\. "
        r"Did you mean 'pipeline\.max_steps'",
    ),
    E("cfg/unknown-top-level-key", compose("foo=1"), r"Key 'foo' not in 'RLVRConfig'.*Valid keys here: .*pipeline"),
    E("cfg/unknown-algo-preset", compose("algo=grpoo"), r"Could not find 'algo/grpoo'.*Available options.*\bgrpo\b"),
    E(
        "cfg/unknown-infer-engine",
        compose("infer_engine=vllmm"),
        r"Could not find 'infer_engine/vllmm'.*Did you mean 'infer_engine=vllm'\?",
    ),
    E("cfg/override-without-value", compose("algo.lr"), r"Error parsing override 'algo\.lr'.*override_grammar"),
    E("cfg/override-bad-token", compose("env.ops=[^]"), r"env\.ops=\[\^\].*token recognition error at: '\^'"),
    # -- configs: wrong types --------------------------------------------------------------------------------------
    E(
        "cfg/lr-not-a-number",
        compose("algo.lr=abc"),
        r"algo\.lr=abc.*could not be converted to Float.*full_key: algo\.lr",
    ),
    E(
        "cfg/max-steps-float",
        compose("pipeline.max_steps=1.5"),
        r"pipeline\.max_steps=1\.5.*could not be converted to Integer.*full_key: pipeline\.max_steps",
    ),
    E(
        "cfg/group-size-word",
        compose("algo.group_size=eight"),
        r"could not be converted to Integer.*full_key: algo\.group_size",
    ),
    E(
        "cfg/bool-word",
        compose("pipeline.progress=maybe"),
        r"'maybe' is not a valid bool.*full_key: pipeline\.progress",
    ),
    E("cfg/file-env-without-path", compose("env=file"), r"missing mandatory value: path.*full_key: env\.path"),
    # -- configs: out of range -------------------------------------------------------------------------------------
    E("cfg/lr-negative", compose("algo.lr=-1e-6"), r"algo\.lr=-1e-06 must be > 0"),
    E("cfg/lr-nan", compose("algo.lr=nan"), r"algo\.lr=nan must be a finite number > 0"),
    E("cfg/lr-inf", compose("algo.lr=inf"), r"algo\.lr=inf must be a finite number > 0"),
    E("cfg/critic-lr-negative", compose("algo=ppo", "algo.critic_lr=-1"), r"algo\.critic_lr=-1\.0 must be > 0"),
    E("cfg/warmup-negative", compose("algo.warmup_steps=-5"), r"algo\.warmup_steps=-5 must be >= 0"),
    E("cfg/weight-decay-negative", compose("algo.weight_decay=-0.1"), r"algo\.weight_decay=-0\.1 must be >= 0"),
    E("cfg/group-size-0", compose("algo.group_size=0"), r"algo\.group_size=0 must be >= 1"),
    E(
        "cfg/temperature-negative",
        compose("infer_engine.temperature=-0.5"),
        r"infer_engine\.temperature=-0\.5 must be > 0",
    ),
    E("cfg/temperature-nan", compose("infer_engine.temperature=nan"), r"infer_engine\.temperature=nan must be > 0"),
    E("cfg/top-p-0", compose("infer_engine.top_p=0"), r"infer_engine\.top_p=0\.0 must be in \(0, 1\]"),
    E("cfg/top-k-negative", compose("infer_engine.top_k=-1"), r"infer_engine\.top_k=-1 must be >= 0"),
    E("cfg/eval-every-negative", compose("pipeline.eval_every=-1"), r"pipeline\.eval_every=-1 must be >= 0"),
    E("cfg/eval-size-negative", compose("pipeline.eval_size=-1"), r"pipeline\.eval_size=-1 must be >= 0"),
    E(
        "cfg/eval-temperature-negative",
        compose("pipeline.eval_temperature=-1"),
        r"pipeline\.eval_temperature=-1\.0 must be >= 0",
    ),
    E("cfg/async-ratio-negative", compose("pipeline.async_ratio=-1"), r"pipeline\.async_ratio=-1 must be >= 0"),
    E("cfg/clip-inverted", compose("algo.clip_low=0.3", "algo.clip_high=-0.1"), r"algo\.clip_high=-0\.1 must be > 0"),
    E("cfg/clip-low-above-1", compose("algo.clip_low=1.5"), r"algo\.clip_low=1\.5 must be < 1"),
    E("cfg/dual-clip-below-1", compose("algo.dual_clip=0.5"), r"algo\.dual_clip=0\.5 must be > 1"),
    E("cfg/value-clip-negative", compose("algo.value_clip=-1"), r"algo\.value_clip=-1\.0 must be > 0"),
    E("cfg/advantage-clip-0", compose("algo.advantage_clip=0"), r"algo\.advantage_clip=0\.0 must be > 0"),
    E("cfg/reward-clip-negative", compose("algo.reward_clip=-1"), r"algo\.reward_clip=-1\.0 must be > 0"),
    E("cfg/ratio-cap-0", compose("algo.ratio_cap=0"), r"algo\.ratio_cap=0\.0 must be > 0"),
    E("cfg/kl-coef-negative", compose("algo.kl_coef=-0.1"), r"algo\.kl_coef=-0\.1 must be >= 0"),
    E("cfg/kl-target-negative", compose("algo.kl_target=-1"), r"algo\.kl_target=-1\.0 must be > 0"),
    E("cfg/kl-horizon-0", compose("algo.kl_horizon=0"), r"algo\.kl_horizon=0 must be > 0"),
    E("cfg/gamma-above-1", compose("algo.gamma=2"), r"algo\.gamma=2\.0 and algo\.lam=1\.0 must lie in \[0, 1\]"),
    E("cfg/max-steps-0", compose("pipeline.max_steps=0"), r"pipeline\.max_steps=0 must be > 0"),
    E("cfg/rollout-batch-0", compose("pipeline.rollout_batch_size=0"), r"pipeline\.rollout_batch_size=0 must be > 0"),
    E("cfg/prompt-length-0", compose("model.max_prompt_length=0"), r"model\.max_prompt_length=0 must be > 0"),
    E("cfg/dtype-unknown", compose("model.dtype=fp8"), r"model\.dtype='fp8' is not one of 'auto', 'float32'"),
    E("cfg/infer-world-size-0", compose("infer_engine.world_size=0"), r"infer_engine\.world_size \(hf\)=0 must be > 0"),
    E(
        "cfg/micro-batch-0",
        compose("train_engine.micro_batch_size=0"),
        r"train_engine\.micro_batch_size .* must be >= 1",
    ),
    E(
        "cfg/megatron-context-parallel",
        compose("train_engine=megatron", "train_engine.context_parallel_size=2"),
        r"world_size=1 is not a multiple of .* x context_parallel_size = 1 x 1 x 2",
    ),
    E(
        "cfg/megatron-context-parallel-0",
        compose("train_engine=megatron", "train_engine.context_parallel_size=0"),
        r"context_parallel_size must be >= 1",
    ),
    E(
        "cfg/megatron-expert-parallel",
        compose("train_engine=megatron", "train_engine.expert_model_parallel_size=2"),
        r"expert_model_parallel_size=2 must divide the data-parallel size .* = 1",
    ),
    E(
        "cfg/megatron-lora-splits-fused-qkv",
        compose(
            "train_engine=megatron", "train_engine.lora_rank=4", "train_engine.lora_target_modules=[q_proj,v_proj]"
        ),
        r"fuses q_proj/k_proj/v_proj into one layer \(linear_qkv\) that shares one LoRA A",
    ),
    E("cfg/sleep-level-3", compose("infer_engine.sleep_level=3"), r"infer_engine\.sleep_level=3 is not one of 0, 1, 2"),
    E(
        "cfg/max-model-len-0",
        compose("infer_engine.max_model_len=0"),
        r"infer_engine\.max_model_len=0 must be >= 1 \(or null: the model's\)",
    ),
    E(  # the hf engine dropped it, the others matched it at once; and it refused partial_rollout as a stop string
        "cfg/stop-empty-string",
        compose("infer_engine.stop=['</answer>', '']"),
        r"infer_engine\.stop=\['</answer>', ''\] holds an empty string, which is no stop string: remove it",
    ),
    E(
        "cfg/backend-unknown",
        compose("cluster.backend=slurm"),
        r"cluster\.backend='slurm' is not one of 'local', 'ray'",
    ),
    E("cfg/platform-unknown", compose("hw.platform=tpu"), r"hw\.platform='tpu' is not installed; installed: .*cpu"),
    E("cfg/reward-timeout-0", compose("pipeline.reward_timeout_s=0"), r"pipeline\.reward_timeout_s=0\.0 must be > 0"),
    E("cfg/env-eval-size-negative", compose("env.eval_size=-1"), r"env\.eval_size=-1 must be >= 0"),
    E("cfg/env-train-size-0", compose("env.train_size=0"), r"env\.train_size=0 must be >= 1"),
    E(
        "cfg/file-eval-fraction-above-1",
        compose("env=file", "env.path=x.jsonl", "env.eval_fraction=1.5"),
        r"env\.eval_fraction=1\.5 must be in \[0, 1\)",
    ),
    E("cfg/countdown-max-number-0", compose("env=countdown", "env.max_number=0"), r"env\.max_number=0 must be >= 1"),
    E(
        "cfg/agentic-turn-longer-than-context",
        compose("pipeline=agentic", "env=agentic", "env.env=sokoban", "env.max_tokens_per_turn=4096"),
        r"env\.max_tokens_per_turn must be below env\.max_context_length",
    ),
    E(
        "cfg/correction-with-truncated-sampling",
        compose("model=qwen3", "algo.off_policy_correction=geo_mask"),
        r"algo\.off_policy_correction=geo_mask with truncated sampling \(infer_engine\.top_p=0\.95, top_k=20",
    ),
    E(
        "cfg/megatron-float16",
        compose("train_engine=megatron", "model.dtype=float16"),
        r"train_engine=megatron with model\.dtype=float16 is not supported: use model\.dtype=bfloat16",
    ),
    E(
        "cfg/distill-topk-1-without-tail",
        compose("pipeline=distill_offline", "distill.topk=1", "distill.tail=false"),
        r"distill\.topk=1 with distill\.tail=false gives a loss of 0 whatever the student",
    ),
    E(
        "cfg/agentic-on-failure-unknown",
        compose("pipeline=agentic", "env=agentic", "env.env=sokoban", "env.on_failure=retry"),
        r"env\.on_failure='retry' must be score or drop",
    ),
    E(
        "cfg/agentic-failure-reward-nan",
        compose("pipeline=agentic", "env=agentic", "env.env=sokoban", "env.failure_reward=nan"),
        r"env\.failure_reward must be a finite number, got nan",
    ),
    # -- configs: incompatible combinations ------------------------------------------------------------------------
    E(
        "cfg/grpo-group-size-1",
        compose("algo=grpo", "algo.group_size=1"),
        r"algo\.adv_estimator=grpo .*set algo\.group_size >= 2",
    ),
    E(
        "cfg/ppo-with-gigpo",
        compose("algo=ppo", "algo.adv_estimator=gigpo"),
        r"adv_estimator=gigpo .*set algo\.group_size >= 2",
    ),
    E(
        "cfg/partial-rollout-without-async",
        compose("pipeline.partial_rollout=true"),
        r"pipeline\.partial_rollout .* need asynchronous training: set pipeline\.async_ratio >= 1",
    ),
    E(  # (it was refused only once the engines were built)
        "cfg/async-with-sleeping-engine",
        compose("pipeline.async_ratio=1", "infer_engine.sleep_level=1"),
        r"^pipeline\.async_ratio=1 keeps the engines generating while the trainer trains: set "
        r"infer_engine\.sleep_level=0 \(it is 1\)",
    ),
    E(
        "cfg/tail-groups-without-async",
        compose("pipeline.tail_groups=2"),
        r"need asynchronous training: set pipeline\.async_ratio >= 1",
    ),
    E(
        "cfg/kl-in-reward-with-grpo",
        compose("algo.kl_in_reward=true", "algo.kl_coef=0.1"),
        r"algo\.kl_in_reward=true needs a token-reward estimator .* not grpo",
    ),
    E(
        "cfg/mini-batch-size-and-count",
        compose("algo.mini_batch_size=8", "algo.num_mini_batches=2"),
        r"set algo\.mini_batch_size or algo\.num_mini_batches, not both",
    ),
    E(
        "cfg/more-mini-batches-than-samples",
        compose("algo.num_mini_batches=1000"),
        r"algo\.num_mini_batches=1000 exceeds the 64 samples of a rollout batch \(pipeline\.rollout_batch_size=8 x "
        r"algo\.group_size=8\): lower it",
    ),
    E(
        "cfg/overlong-buffer-past-response",
        compose("algo.overlong_buffer=100"),
        r"algo\.overlong_buffer=100 exceeds model\.max_response_length=16: lower the buffer",
    ),
    E(
        "cfg/address-with-local",
        compose("cluster.address=auto"),
        r"cluster\.address is set but cluster\.backend=local: use cluster=ray",
    ),
    # -- configs: a map's keys (the user's own) are added with +, even when the docs spelt them without --------
    E(
        "cfg/map-key-without-plus",
        compose("cluster.call_timeouts.reward=600"),
        r"Key 'reward' is not in struct.*\ncluster\.call_timeouts is a map: add the key 'reward' with "
        r"\+cluster\.call_timeouts\.reward=<value>",
    ),
    E(
        "cfg/map-assigned-whole",
        compose("cluster.resources={GPU:2}"),
        r"cluster\.resources is a map: add the key 'GPU' with \+cluster\.resources\.GPU=<value>",
    ),
    # -- Ray's own counts: a traceback from its raylet, or (0 CPUs) silently all cores ----------------------------
    E("cfg/num-cpus-negative", compose("cluster=ray", "cluster.num_cpus=-3"), r"cluster\.num_cpus=-3 must be >= 1"),
    E(
        "cfg/num-cpus-zero",
        compose("cluster=ray", "cluster.num_cpus=0"),
        r"cluster\.num_cpus=0 must be >= 1 \(or null: all cores\)",
    ),
    E(
        "cfg/resources-negative",
        compose("cluster=ray", "+cluster.resources.GPU=-1"),
        r"cluster\.resources\.GPU=-1\.0 must be >= 0",
    ),
    E(
        "cfg/sglang-top-p",
        compose("infer_engine=sglang", "infer_engine.top_p=0.9"),
        r"infer_engine=sglang reports log-probs before top-k/top-p truncation",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, corpus: Corpus) -> None:
    check(case, corpus)


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)
    # ids unique across the corpus's modules too: the cfg/ rows are here, the others in test_bad_inputs_run.py
    assert all(c.id.startswith("cfg/") for c in CASES), [c.id for c in CASES if not c.id.startswith("cfg/")]
