"""The reward-model role: scores equal a direct transformers forward (batched, padded, truncated), normalisation and
mixing by hand, running statistics through a state_dict round trip, and the checks that refuse a wrong model."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.reward_model import RewardModelScoring, RunningStats, build_reward_model
from roll_core.protocol import Batch
from roll_core.testing.reward_models import FixedScorer, reward_model_config, scoring_rows, tiny_classifier


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_classifier(tmp_path_factory.mktemp("rm"), build_tiny_tokenizer())


@pytest.fixture(scope="module")
def run_cfg():
    """The default run config, composed once (reward_model=hf's composition is the end-to-end test's)."""
    return load_config([])


def _scoring(run_cfg, path: str, **fields: object) -> RewardModelScoring:
    """The run's reward-model scoring as a collector builds it (local backend, CPU)."""
    from roll_core.cluster.launch import Cluster
    from roll_core.config.reward_model import RewardModelConfig

    cfg = copy.deepcopy(run_cfg)
    cfg.reward_model = RewardModelConfig(name="hf", path=path, **fields)
    scoring = build_reward_model(SimpleNamespace(cfg=cfg, cluster=Cluster(cfg.cluster, cfg.hw)))
    assert scoring is not None
    return scoring


def test_scores_equal_a_direct_transformers_forward(run_cfg, rm_path: str) -> None:
    """7 rows of different lengths, 3 per forward pass, right-padded: each score is the classifier's logit of the
    chat-templated (prompt, response) alone; a row longer than max_length is cut from the left and counted."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = ["What is 2+2?", "Say hi", "x", "A much longer prompt about many things " * 3, "q", "Name a colour", ""]
    responses = ["4", "hi there!", "", "ok", "a" * 40, "red", "nothing"]
    scoring = _scoring(run_cfg, rm_path, batch_size=3, max_length=60)
    batch, scored = scoring_rows([0.0] * 7)
    batch["prompt_text"], scored["response_text"] = prompts, responses
    out = StepLog()
    scoring.apply(batch, scored, out)

    tok = AutoTokenizer.from_pretrained(rm_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    want, cut = [], 0
    for p, r in zip(prompts, responses):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=True, return_dict=False
        )
        cut += len(ids) > 60
        with torch.no_grad():
            want.append(float(model(torch.tensor([ids[-60:]])).logits[0, 0]))
    assert cut == 2  # the long prompt, and the 40-character response
    assert scored["scores"].dtype == torch.float32
    torch.testing.assert_close(scored["scores"], torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert torch.tensor(want).std() > 0.05, want  # the rows score differently: a row mix-up would show
    assert out["reward_model/truncated"] == 2.0 and out["reward_model/nonfinite"] == 0.0
    assert out["reward_model/raw_mean"] == pytest.approx(sum(want) / 7, abs=1e-5)


def test_the_chat_template_reads_the_policys_whole_conversation(run_cfg, rm_path: str) -> None:
    """A chat-format row (its own system message and an earlier exchange before the question): the prompt batch
    carries the messages the policy's prompt was rendered from, and each row's score is the classifier's logit of
    that whole conversation plus the response, not of the user message alone (which dropped the system message
    and the earlier turns: another score)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from roll_core.pipelines.rollout import prompt_batch

    system = {"role": "system", "content": "Answer in French."}
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour"}]
    task = SimpleNamespace(messages=lambda p: [system, *earlier, {"role": "user", "content": p.prompt}])
    problems = [SimpleNamespace(id=f"q{i}", prompt=q, answer="", metadata={}) for i, q in enumerate(["2+2?", "Sky?"])]
    tok = AutoTokenizer.from_pretrained(rm_path)
    batch = prompt_batch(tok, task, problems, 256, {})
    assert batch["prompt_messages"] == [task.messages(p) for p in problems]
    responses = ["quatre", "bleu"]
    scored = Batch({"scores": torch.zeros(2)}, {"response_text": responses})
    _scoring(run_cfg, rm_path).apply(batch, scored, StepLog())

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()

    def logit(messages: list[dict[str, str]]) -> float:
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, 0])

    answer = [{"role": "assistant", "content": r} for r in responses]
    want = [logit([*task.messages(p), a]) for p, a in zip(problems, answer)]
    user_only = [logit([{"role": "user", "content": p.prompt}, a]) for p, a in zip(problems, answer)]
    torch.testing.assert_close(scored["scores"], torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert all(abs(w - u) > 1e-3 for w, u in zip(want, user_only)), (want, user_only)


def test_a_template_without_a_system_role_gets_it_in_the_first_user_turn() -> None:
    """A reward model whose chat template refuses the system role (Gemma's raises) reads the system prompt before
    the first user message's text instead of failing the scoring call; other template errors still raise."""
    from roll_core.cluster.reward_model import format_row
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    plain = tok.chat_template
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + plain
    )
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"}]
    want = tok.apply_chat_template(
        [{"role": "user", "content": "Be brief.\n\nQ"}, {"role": "assistant", "content": "A"}],
        tokenize=True,
        return_dict=False,
    )
    assert format_row(tok, "chat", "Q", "A", convo) == list(want)
    tok.chat_template = "{{ raise_exception('broken') }}"
    with pytest.raises(Exception, match="broken"):
        format_row(tok, "chat", "Q", "A", [{"role": "user", "content": "Q"}])


def test_a_left_cut_keeps_a_leading_bos(run_cfg, rm_path: str) -> None:
    from roll_core.cluster.reward_model import truncate

    # The worker's inputs: a template that starts with BOS keeps it when the row is cut from the left
    scoring = _scoring(run_cfg, rm_path, template="<s>Q: {prompt} A: {response}", max_length=8)
    worker = scoring.scorer.workers[0]
    full = worker.tokenizer("<s>Q: " + "p" * 20 + " A: r")["input_ids"]
    bos = worker.tokenizer.bos_token_id
    assert full[0] == bos and len(full) > 8
    assert worker.tokenize(["p" * 20], ["r"]) == ([[bos, *full[-7:]]], [True])

    assert truncate([1, 5, 6, 7, 8], 3, "left", bos=1) == ([1, 7, 8], True)  # BOS, then the last tokens
    assert truncate([9, 5, 6, 7, 8], 3, "left", bos=1) == ([6, 7, 8], True)  # no BOS at the start: none added
    assert truncate([1, 5, 6, 7, 8], 3, "right", bos=1) == ([1, 5, 6], True)
    assert truncate([1, 5, 6], 3, "left", bos=1) == ([1, 5, 6], False)
    assert truncate([1, 5, 6, 7], 1, "left", bos=1) == ([7], True)  # no room for both: the last token


def test_rows_past_the_models_context_are_cut_there(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A GPT-2-style reward model (learned positions, n_positions=64) under the default max_length 1024: a 180-token
    row raised IndexError in the forward and failed the whole scoring call. Rows are cut to the model's context,
    flagged truncated, and the cut is logged once."""
    import logging

    from transformers import GPT2Config, GPT2ForSequenceClassification

    from roll_core.cluster.reward_model import RewardModelWorker
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=64, num_labels=1, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(0)
    GPT2ForSequenceClassification(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        worker = RewardModelWorker(str(tmp_path), template="{prompt}\n{response}")
    assert worker.max_length == 64 and "exceeds the reward model's context (64 tokens)" in caplog.text
    out = worker.score(Batch(fields={"prompt_text": ["hi", "hi"], "response_text": ["ok", "abcdefgh " * 20]}))
    assert out["rm_scores"].shape == (2,) and torch.isfinite(out["rm_scores"]).all()
    assert out["rm_truncated"].tolist() == [False, True]


def test_text_template_and_offload(run_cfg, rm_path: str) -> None:
    """A {prompt}/{response} template is what the model reads; offloaded weights are back in host memory (asleep)
    after each call and the scores do not change."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    scoring = _scoring(run_cfg, rm_path, template="Q: {prompt} A: {response}", offload=True)
    group = scoring.scorer
    assert all(m["asleep"] for m in group.memory_bytes())
    batch, scored = scoring_rows([0.0, 0.0])
    scoring.apply(batch, scored, StepLog())
    assert all(m["asleep"] for m in group.memory_bytes())
    tok = AutoTokenizer.from_pretrained(rm_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        want = [float(model(torch.tensor([tok(f"Q: p{i} A: r{i}")["input_ids"]])).logits[0, 0]) for i in range(2)]
    torch.testing.assert_close(scored["scores"], torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_a_text_template_that_spells_the_bos_gets_one_bos() -> None:
    """A text template written with the model's bos (`<s>Q: ...`) is tokenised with that one bos: the tokenizer
    adding its own before it gave `<s><s>Q: ...` (an input the reward model never read); a template without one
    gets the tokenizer's, and what the tokenizer appends after the text (eos) stays."""
    from tokenizers import processors

    from roll_core.cluster.reward_model import format_row
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    tok._tokenizer.post_processor = processors.TemplateProcessing(  # Llama's: bos before the text
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    text_ids = tok("Q: 1+1 A: 2", add_special_tokens=False)["input_ids"]
    assert format_row(tok, "<s>Q: {prompt} A: {response}", "1+1", "2") == [bos, *text_ids]
    assert format_row(tok, "Q: {prompt} A: {response}", "1+1", "2") == [bos, *text_ids]
    tok._tokenizer.post_processor = processors.TemplateProcessing(  # add_eos_token: eos after the text too
        single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    assert format_row(tok, "<s>Q: {prompt} A: {response}", "1+1", "2") == [bos, *text_ids, eos]


def test_batch_zscore_and_add_with_weight_by_hand() -> None:
    raw = [1.0, 2.0, 3.0, 6.0]
    mean, var = 3.0, (4 + 1 + 0 + 9) / 4  # population variance 3.5
    z = [(x - mean) / math.sqrt(var + 1e-6) for x in raw]
    scoring = RewardModelScoring(reward_model_config(normalize="batch", mode="add", weight=0.5), FixedScorer(raw))
    batch, scored = scoring_rows([1.0, 0.0, 1.0, 0.0])
    out = StepLog()
    scoring.apply(batch, scored, out)
    assert scored["scores"].tolist() == pytest.approx([t + 0.5 * v for t, v in zip([1, 0, 1, 0], z)], abs=1e-6)
    assert out["reward_model/raw_mean"] == pytest.approx(3.0)
    assert out["reward_model/raw_std"] == pytest.approx(math.sqrt(3.5), abs=1e-6)
    assert out["reward_model/score_mean"] == pytest.approx(0.0, abs=1e-6)
    assert out["reward_model/score_std"] == pytest.approx(1.0, abs=1e-5)
    # replace: the model's raw score as it is (normalize=none), the task's score gone.
    scoring = RewardModelScoring(reward_model_config(), FixedScorer(raw))
    batch, scored = scoring_rows([1.0, 0.0, 1.0, 0.0])
    scoring.apply(batch, scored, StepLog())
    assert scored["scores"].tolist() == raw


def test_batch_zscore_spans_every_call_that_scored_the_batch() -> None:
    """A batch scored in two calls (a dynamic-sampling refill round, an async chunk): after renormalise every row
    is normalised by the whole batch's statistics, as if scored in one call (the refill round of two rows was
    standardised against itself: raw 2.0 was +0.45 in one call and -1.0 in the other), and the per-row fields it
    used are gone."""
    from roll_core.pipelines.sampling import RM_ROW_TENSORS

    one = RewardModelScoring(
        reward_model_config(normalize="batch", mode="add", weight=0.5), FixedScorer([0.0, 1.0, 2.0, 3.0, 2.0, 3.0])
    )
    batch, whole = scoring_rows([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    one.apply(batch, whole, StepLog())
    two = RewardModelScoring(
        reward_model_config(normalize="batch", mode="add", weight=0.5), FixedScorer([0.0, 1.0, 2.0, 3.0], [2.0, 3.0])
    )
    parts = []
    for task in ([1.0, 0.0, 1.0, 0.0], [1.0, 1.0]):
        batch, scored = scoring_rows(task)
        two.apply(batch, scored, StepLog())
        parts.append(scored)
    merged = Batch({k: torch.cat([p[k] for p in parts]) for k in ("scores", *RM_ROW_TENSORS)})
    assert merged["scores"][4] != pytest.approx(float(whole["scores"][4]))  # per call: another scale
    final = two.renormalise(merged)
    assert final["scores"].tolist() == pytest.approx(whole["scores"].tolist(), abs=1e-6)
    assert not any(k in final for k in RM_ROW_TENSORS)


def test_running_statistics_and_their_state_dict_round_trip() -> None:
    """The running mean/variance equal those of every score so far; a scoring restored from a state_dict scores the
    next batch exactly as the uninterrupted one; evaluation (out=None) reads the statistics without updating."""
    a, b, c = [0.0, 4.0], [1.0, 2.0, 3.0], [10.0, -2.0]
    seen = torch.tensor(a + b)
    first = RewardModelScoring(reward_model_config(normalize="running"), FixedScorer(a, b, [5.0, 5.0], c))
    for part in (a, b):
        batch, scored = scoring_rows([0.0] * len(part))
        out = StepLog()
        first.apply(batch, scored, out)
    assert first.stats.count == 5
    assert first.stats.mean == pytest.approx(float(seen.mean()))
    assert first.stats.var == pytest.approx(float(seen.var(unbiased=False)))
    assert out["reward_model/running_std"] == pytest.approx(float(seen.std(unbiased=False)))
    # The second batch was normalised by the statistics of both batches (updated first).
    want_b = [(x - float(seen.mean())) / math.sqrt(float(seen.var(unbiased=False)) + 1e-6) for x in b]
    assert scored["scores"].tolist() == pytest.approx(want_b, abs=1e-6)

    batch, scored = scoring_rows([0.0, 0.0])
    first.apply(batch, scored, None)  # evaluation: no update
    assert first.stats.count == 5

    state = first.state_dict()
    second = RewardModelScoring(reward_model_config(normalize="running"), FixedScorer(c))
    second.load_state_dict(state)
    outs = []
    for s in (first, second):
        batch, scored = scoring_rows([0.0, 0.0])
        s.apply(batch, scored, StepLog())
        outs.append(scored["scores"].tolist())
    assert outs[0] == outs[1]
    allv = torch.tensor(a + b + c)
    assert second.stats.mean == pytest.approx(float(allv.mean()))
    assert second.stats.var == pytest.approx(float(allv.var(unbiased=False)))


def test_running_stats_of_uneven_batches_match_torch() -> None:
    torch.manual_seed(1)
    parts = [torch.randn(n) * 3 + 7 for n in (1, 5, 2, 9)]
    stats = RunningStats()
    for p in parts:
        stats.update(p)
    allv = torch.cat(parts).double()
    assert stats.mean == pytest.approx(float(allv.mean()))
    assert stats.var == pytest.approx(float(allv.var(unbiased=False)))


def test_non_finite_scores_are_counted_and_neutral() -> None:
    scoring = RewardModelScoring(
        reward_model_config(normalize="batch"), FixedScorer([1.0, float("nan"), 3.0, float("inf")])
    )
    batch, scored = scoring_rows([0.0] * 4)
    out = StepLog()
    scoring.apply(batch, scored, out)
    assert out["reward_model/nonfinite"] == 2.0 and scoring.summary()["nonfinite"] == 2
    assert scored["scores"].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-5)


def test_a_text_template_reads_the_whole_conversation(run_cfg, rm_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """A text template's {conversation} is the policy's whole prompt conversation (its system message and an
    earlier exchange before the question) as `role: content` blocks, scored as that text; {prompt} stays the user
    message alone (back-compat), and a worker reading it where the prompts carry more says so once, with counts."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from roll_core.cluster.reward_model import conversation_text, format_row
    from roll_core.pipelines.rollout import prompt_batch

    system = {"role": "system", "content": "Answer in French."}
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]}]
    task = SimpleNamespace(messages=lambda p: [system, *earlier, {"role": "user", "content": p.prompt}])
    problems = [SimpleNamespace(id=f"q{i}", prompt=q, answer="", metadata={}) for i, q in enumerate(["2+2?", "Sky?"])]
    tok = AutoTokenizer.from_pretrained(rm_path)
    batch = prompt_batch(tok, task, problems, 256, {})
    scored = Batch({"scores": torch.zeros(2)}, {"response_text": ["quatre", "bleu"]})
    template = "{conversation}\n\nassistant: {response}"
    _scoring(run_cfg, rm_path, template=template).apply(batch, scored, StepLog())

    texts = [
        f"system: Answer in French.\n\nuser: Hi\n\nassistant: Yo\n\nuser: {q}\n\nassistant: {r}"
        for q, r in [("2+2?", "quatre"), ("Sky?", "bleu")]
    ]
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        want = [float(model(torch.tensor([tok(t)["input_ids"]])).logits[0, 0]) for t in texts]
        user_only = [
            float(model(torch.tensor([tok(f"user: {q}\n\nassistant: r")["input_ids"]])).logits[0, 0])
            for q in ("2+2?", "Sky?")
        ]
    torch.testing.assert_close(scored["scores"], torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert all(abs(w - u) > 1e-3 for w, u in zip(want, user_only)), (want, user_only)
    # Without messages (a batch of plain prompts) {conversation} is the one user message; {prompt} is the user text.
    assert conversation_text(None, "Q") == "user: Q"
    convo = task.messages(problems[0])
    assert format_row(tok, "{prompt}|{response}", "2+2?", "4", convo) == tok("2+2?|4")["input_ids"]

    worker = _scoring(run_cfg, rm_path, template="Q: {prompt} A: {response}").scorer.workers[0]
    with caplog.at_level("WARNING", logger="roll_core.cluster.reward_model"):
        worker.tokenize(["a", "b", "c"], ["r"] * 3, [convo, [{"role": "user", "content": "b"}], None])
        worker.tokenize(["a"], ["r"], [convo])
    warned = [r.getMessage() for r in caplog.records if "{conversation}" in r.getMessage()]
    assert warned == [
        "reward_model.template reads {prompt}, the user message alone: 1 of 3 prompts also carry a system prompt or "
        "earlier turns the reward model does not see; {conversation} renders them all"
    ]


def test_text_template_placeholders_are_checked_at_composition() -> None:
    """Only {prompt}, {conversation} and {response} are placeholders: any other (a typo, an attribute, a literal
    "{{prompt}}" that never renders the prompt) is a ConfigError before the run; {conversation} may stand for
    {prompt}."""
    for bad, why in [
        ("{promt} {response}", r"unknown placeholder \{promt\}"),
        ("{prompt.upper} {response}", r"unknown placeholder \{prompt.upper\}"),
        ("{} {prompt} {response}", r"unknown placeholder \{\}"),
        ("{prompt} {response} {", "Single '{'"),
        ("{{prompt}} {response}", "neither {prompt} nor {conversation}"),
        ("{conversation}", "has no {response}"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_config(["reward_model=hf", "reward_model.path=/x", f"reward_model.template='{bad}'"])
    cfg = load_config(["reward_model=hf", "reward_model.path=/x", "reward_model.template='{conversation} {response}'"])
    assert cfg.reward_model.template == "{conversation} {response}"


def test_wrong_models_are_config_errors(run_cfg, tmp_path: Path) -> None:
    causal = tiny_classifier(tmp_path / "lm", build_tiny_tokenizer(), causal=True)
    with pytest.raises(ConfigError, match="LlamaForCausalLM, not a sequence classifier"):
        _scoring(run_cfg, causal)
    two = tiny_classifier(tmp_path / "two", build_tiny_tokenizer(), num_labels=2)
    with pytest.raises(ConfigError, match="2 labels"):
        _scoring(run_cfg, two)
    with pytest.raises(ConfigError, match=r"reward_model\.path=/no/such/rm does not exist"):
        _scoring(run_cfg, "/no/such/rm")
    from transformers import AutoTokenizer

    bare = tmp_path / "bare"
    tiny_classifier(bare, build_tiny_tokenizer())
    tok = AutoTokenizer.from_pretrained(bare)
    tok.chat_template = None
    tok.save_pretrained(bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="has no chat template"):
        _scoring(run_cfg, str(bare))
    assert build_reward_model(SimpleNamespace(cfg=run_cfg, cluster=None)) is None  # reward_model=none


def test_roll_eval_restores_the_checkpoints_running_statistics(tmp_path: Path) -> None:
    """roll-eval of `<checkpoint>/actor/model` scores with the running statistics the run had at that checkpoint
    (a fresh scorer standardised the evaluated batch by itself: its eval reward was not the run's)."""
    import json
    from types import SimpleNamespace

    from roll_core.evaluate import restore_reward_model

    trained = RewardModelScoring(reward_model_config(normalize="running"), FixedScorer([0.0, 4.0, 8.0]))
    batch, scored = scoring_rows([0.0, 0.0, 0.0])
    trained.apply(batch, scored, StepLog())
    ckpt = tmp_path / "checkpoints" / "step_000004"
    (ckpt / "actor" / "model").mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"collector": {"reward_model": trained.state_dict()}}))
    fresh = RewardModelScoring(reward_model_config(normalize="running"), FixedScorer([2.0, 6.0], [2.0, 6.0]))
    assert restore_reward_model(SimpleNamespace(reward_model=fresh), str(ckpt / "actor" / "model"))
    assert fresh.stats.state_dict() == trained.stats.state_dict()
    batch, scored = scoring_rows([0.0, 0.0])
    fresh.apply(batch, scored, None)  # evaluation: by the run's statistics (mean 4), not the batch's own
    assert scored["scores"].tolist() == pytest.approx([(x - 4.0) / math.sqrt(32 / 3 + 1e-6) for x in (2.0, 6.0)])
    assert not restore_reward_model(SimpleNamespace(reward_model=fresh), str(tmp_path))  # not a checkpoint


def test_a_colocated_reward_model_in_a_disaggregated_cluster_is_refused_at_composition() -> None:
    """reward_model.placement=colocated promises the trainer's devices, which cluster.placement=disaggregated gives
    each role whole: refused when the config is composed (the cluster refused it only when the reward model's group
    was built, after the other models had loaded); following the cluster, or a colocated cluster, composes."""
    from roll_core.errors import ConfigError

    rm = ["reward_model=hf", "reward_model.path=/models/rm"]
    with pytest.raises(ConfigError, match=r"reward_model\.placement=colocated time-shares the trainer's devices"):
        load_config([*rm, "reward_model.placement=colocated", "cluster.placement=disaggregated"])
    assert load_config([*rm, "cluster.placement=disaggregated"]).reward_model.placement is None
    load_config([*rm, "reward_model.placement=colocated", "cluster.placement=colocated"])
    load_config([*rm, "reward_model.placement=disaggregated", "cluster.placement=colocated"])
