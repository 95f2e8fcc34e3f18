"""The on-policy distillation collector (`pipeline=distill`, objective `distill`): the RLVR prompts collector's
sampling and scoring, plus each row's teacher prompt.

The student samples exactly as `pipeline=rlvr` does (the wrapped prompts collector, synchronous or asynchronous:
`pipeline.rollout_batch_size` prompts of the run's `env` task x `algo.group_size` samples, scored by the task's
reward, evaluated on its held-out problems). With `distill.teacher_prompt` each batch also carries the teacher's
prompt: the task's chat messages for the row's problem (system prompt, worked examples) whose last user message is
`teacher_prompt.format(prompt=<the student's user message>, **<the row's metadata>)`, chat-templated with the
tokenizer and left-padded (`teacher_prompts`, `teacher_prompt_mask`: (B, Pt)); the response tokens stay the
student's. A problem whose metadata lacks a field the template names is skipped with all its samples (counted in
`data/skipped_teacher_prompt_rows`, totalled in the summary), never formatted with a hole.
Evaluation: the task's held-out accuracy, as RL reports it; at step 0 of context distillation (every teacher is
the student's own model) also the teacher's, with its prompt (`eval/teacher_accuracy`): the engines then hold it.

Checked before any model loads (`check`): the offline-only settings (distill.kind, topk, tail, eval_task) are at
their defaults (this pipeline ignores them), a teacher exists (the student's own model with a teacher prompt is
context distillation; with neither the teacher would be the student itself), every domain of the task's training
problems has a teacher, every routed domain exists, the teacher prompt's fields occur in the data, and every
teacher tokenizes like the student (roll_core.posttrain `tokenizer_fingerprint`): the teacher scores the student's
token ids, so another vocabulary would score other text; and every teacher's logits cover every id the tokenizer
can produce (config vocab_size against the tokenizer's length and its largest id, added tokens included:
`check_vocabularies`). A teacher narrower than the student but covering the tokenizer lacks only padding rows: the
student samples them rarely, and the objective leaves such tokens unscored and counts them
(roll_core.pipelines.objectives.distill).
"""

from __future__ import annotations

import logging
from typing import Any

from roll_core.config.posttrain import teacher_prompt_fields
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected, Collector, CollectorContext, prompt_collectors
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.distill import TEACHER_PROMPT_MASK, TEACHER_PROMPTS, teacher_of
from roll_core.protocol import pad_left

log = logging.getLogger(__name__)

#: Metrics key (per step) and summary key (run total) of rows skipped for a teacher prompt that cannot be formatted.
SKIPPED_KEY = "data/skipped_teacher_prompt_rows"


class DistillCollector:
    """The prompts collector's batches with each row's teacher prompt (see the module docstring)."""

    trajectories = False

    def __init__(self, ctx: CollectorContext, inner: Collector) -> None:
        self.ctx, self.inner = ctx, inner
        self.template = ctx.cfg.distill.teacher_prompt
        self.fields = teacher_prompt_fields(self.template) if self.template is not None else []
        self.plot_keys = (*inner.plot_keys, "distill/reverse_kl")
        self.skipped_rows = 0
        self._warned: set[str] = set()
        self._problems: dict[tuple[str, str], Any] | None = None

    # ---- the collector contract: the wrapped collector's, with teacher prompts ----------------------------
    def next(self, step: int, log: StepLog) -> Collected | None:
        collected = self.inner.next(step, log)
        if collected is None or self.template is None:
            return collected
        return self.with_teacher_prompts(collected, log)

    def begin_sync(self) -> None:
        self.inner.begin_sync()

    def finish_sync(self, version: int) -> None:
        self.inner.finish_sync(version)

    def evaluate(self, step: int) -> dict[str, float]:
        """The task's held-out accuracy (as RL reports it); at step 0 of context distillation also the teacher's
        (`eval/teacher_accuracy`): the engines then hold the student's base weights, which are the teacher's."""
        out = self.inner.evaluate(step)
        if step == 0 and self.context_teacher:
            out.update(self.evaluate_teacher())
        return out

    @property
    def context_teacher(self) -> bool:
        """Every teacher is the student's own starting model, shown the teacher prompt."""
        cfg = self.ctx.cfg
        paths = set(cfg.distill.teacher_paths(cfg.model.path).values())
        return self.template is not None and paths == {cfg.model.path}

    def evaluate_teacher(self) -> dict[str, float]:
        """Held-out accuracy of the teacher's prompts (problems lacking a template field are left out), sampled
        as `evaluate` samples the student's."""
        from roll_core.pipelines.collectors._resume import resuming
        from roll_core.pipelines.rollout import evaluate
        from roll_core.seeds import Purpose, derive_seed

        assert self.template is not None
        inner, cfg = self.inner, self.ctx.cfg
        texts: dict[int, str] = {}  # by the problem object's identity: held-out ids need not be unique
        for p in inner.eval_set:
            values = {**(getattr(p, "metadata", None) or {}), "prompt": p.prompt}
            if all(f in values for f in self.fields):
                texts[id(p)] = self.template.format(**values)
        problems = [p for p in inner.eval_set if id(p) in texts]
        if not problems:
            return {}
        view = _TeacherView(self.ctx.task, texts)
        res = evaluate(
            # an engine's own abort is resumed, as the student's evaluation resumes it (not scored an engine failure)
            resuming(inner.infer, self.ctx.tokenizer, cfg.pipeline.max_idle_aborts),
            inner.scoring,
            self.ctx.tokenizer,
            view,
            problems,
            max_prompt_length=2**31,  # the teacher's prompts are longer by design; the model's context decides
            template_kwargs=cfg.model.chat_template_kwargs,
            params=inner.sampling.replace(
                temperature=inner.eval_temperature, seed=derive_seed(cfg.pipeline.seed, Purpose.EVAL)
            ),
        )
        return {
            "eval/teacher_accuracy": res["accuracy"],
            "eval/teacher_reward": res["reward"],
            "eval/teacher_n": res["n"],
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "distill_skipped_rows": self.skipped_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.skipped_rows = int(state.pop("distill_skipped_rows", 0))
        self.inner.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), "skipped_teacher_prompt_rows": self.skipped_rows}

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # on_policy, exhausted, sampler, ...: the wrapped collector's
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ---- teacher prompts ----------------------------------------------------------------------------------
    def with_teacher_prompts(self, collected: Collected, out: StepLog) -> Collected | None:
        """`collected` with `teacher_prompts` / `teacher_prompt_mask` (B, Pt); rows whose teacher prompt cannot be
        formatted are dropped (their whole group: every sample of a problem shares its metadata) and counted."""
        batch = collected.batch
        cache: dict[tuple[str, str], list[int] | None] = {}
        ids: list[list[int]] = []
        keep: list[int] = []
        for i, (pid, text, meta) in enumerate(zip(batch["problem_id"], batch["prompt_text"], batch["metadata"])):
            key = (pid, text)
            if key not in cache:
                cache[key] = self.teacher_prompt_ids(pid, text, meta or {})
            if cache[key] is not None:
                keep.append(i)
                ids.append(cache[key])
        skipped = len(batch) - len(keep)
        out[SKIPPED_KEY] = float(skipped)
        self.skipped_rows += skipped
        if not keep:
            log.warning("step skipped: no row of the batch has the fields of distill.teacher_prompt")
            return None
        scores = collected.scores
        if skipped:
            batch, scores = batch.index(keep), scores[keep]
        tok = self.ctx.tokenizer
        batch[TEACHER_PROMPTS], batch[TEACHER_PROMPT_MASK] = pad_left(
            ids, tok.pad_token_id if tok.pad_token_id is not None else 0
        )
        return Collected(batch, scores)

    def teacher_prompt_ids(self, problem_id: str, prompt: str, metadata: dict[str, Any]) -> list[int] | None:
        """Chat-templated ids of the teacher's conversation for one problem; None (logged once per missing field)
        when its metadata lacks a field of the template."""
        values = {**metadata, "prompt": prompt}  # {prompt} is always the student's user message
        missing = [f for f in self.fields if f not in values]
        if missing:
            for f in missing:
                if f not in self._warned:
                    self._warned.add(f)
                    log.warning(
                        "distill.teacher_prompt names {%s}, which problem %s's metadata lacks (it has %s): such "
                        "problems are skipped and counted in %s",
                        f,
                        problem_id,
                        sorted(metadata) or "none",
                        SKIPPED_KEY,
                    )
            return None
        assert self.template is not None
        messages = teacher_messages(self.ctx.task, self._problem(problem_id, prompt), self.template.format(**values))
        toks = self.ctx.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **self.ctx.cfg.model.chat_template_kwargs,
        )
        return list(toks["input_ids"] if isinstance(toks, dict) else toks)

    def _problem(self, problem_id: str, prompt: str) -> Any:
        """The task's problem of a batch row (by id and prompt: ids need not be unique across a task's files)."""
        if self._problems is None:
            task = self.ctx.task
            self._problems = {(p.id, p.prompt): p for p in [*task.train_set(), *task.eval_set()]}
        try:
            return self._problems[(problem_id, prompt)]
        except KeyError:
            raise RuntimeError(f"problem {problem_id!r} of the batch is not in the task's problems") from None


class _TeacherView:
    """The task as the teacher sees it: its messages end with the teacher's user message (texts by problem object)."""

    def __init__(self, task: Any, texts: dict[int, str]) -> None:
        self.task, self.texts = task, texts

    def messages(self, problem: Any) -> list[dict[str, Any]]:
        return teacher_messages(self.task, problem, self.texts[id(problem)])

    def __getattr__(self, name: str) -> Any:
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)


def teacher_messages(task: Any, problem: Any, text: str) -> list[dict[str, Any]]:
    """The task's chat messages for `problem` (system prompt, worked examples) with the last user message's content
    replaced by `text`: what the teacher is shown before the student's response."""
    messages = [dict(m) for m in task.messages(problem)]
    if not messages or messages[-1].get("role") != "user":
        raise ConfigError(
            f"distill.teacher_prompt replaces the task's last user message, but env={type(task).__name__}'s "
            "messages do not end with one"
        )
    messages[-1]["content"] = text
    return messages


def check_distill(cfg: Any, task: Any) -> None:
    """The distill settings against the task and the models, before any model loads (ConfigError otherwise;
    offline-only settings changed from their defaults among them)."""
    from roll_core.models import resolve_model_path

    dist = cfg.distill
    # Changed settings this pipeline never reads were accepted and silently ignored (the defaults are accepted:
    # the `distill` node fills every key).
    offline = dist.changed("kind", "topk", "tail", "eval_task")
    if offline:
        raise ConfigError(
            f"{', '.join(offline)}: pipeline=distill (on-policy) scores each sampled token under the teacher "
            "(advantage -distill.coef x (student - teacher log-prob), with the task's held-out accuracy at each "
            "evaluation); distill.kind, distill.topk, distill.tail and distill.eval_task set the offline top-k "
            "loss and its evaluation (pipeline=distill_offline) and are ignored here: drop them (distill.coef and "
            "distill.task_reward_weight shape the on-policy signal), or use pipeline=distill_offline"
        )
    if dist.teacher is None and not dist.teachers and dist.teacher_prompt is None:
        raise ConfigError(
            "pipeline=distill: the teacher would be the student itself (distill.teacher and distill.teacher_prompt "
            "are both null): set distill.teacher=<model path>, or distill.teacher_prompt for context distillation "
            "(the student's own model shown, e.g., a worked example)"
        )
    paths = dist.teacher_paths(cfg.model.path)
    problems = task.train_set()
    domains = sorted({str(d) for d in (getattr(p, "domain", None) for p in problems) if d is not None})
    if domains:
        unknown = sorted(set(dist.teachers) - set(domains))
        if unknown:
            raise ConfigError(
                f"distill.teachers routes domain(s) {unknown}, which env={cfg.env.name} has no training problems of "
                f"(its domains: {domains})"
            )
    orphans = sorted({str(getattr(p, "domain", None)) for p in problems if teacher_of(_meta(p), paths) is None})
    if orphans:
        raise ConfigError(
            f"distill.teachers routes {sorted(dist.teachers)} but the task also has domain(s) {orphans} and "
            "distill.teacher (the default teacher) is null: set distill.teacher or route every domain"
        )
    for name in teacher_prompt_fields(dist.teacher_prompt) if dist.teacher_prompt is not None else []:
        if name != "prompt" and not any(name in (getattr(p, "metadata", None) or {}) for p in problems):
            raise ConfigError(
                f"distill.teacher_prompt names {{{name}}}, which no training problem of env={cfg.env.name} has in "
                "its metadata (a data row's other columns): fix the template or the data"
            )
    check_tokenizers(cfg, {n: resolve_model_path(p) for n, p in paths.items()})
    check_vocabularies(cfg, {n: resolve_model_path(p) for n, p in paths.items()})


def _meta(problem: Any) -> dict[str, Any]:
    domain = getattr(problem, "domain", None)
    return {"domain": domain} if domain is not None else {}


def check_tokenizers(cfg: Any, teachers: dict[str, str]) -> None:
    """Every teacher's tokenizer equals the student's (`tokenizer_fingerprint`): a ConfigError naming both paths."""
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_core.posttrain.tokenize import tokenizer_fingerprint

    student_path = resolve_model_path(cfg.model.path)
    student_tok = cfg.model.tokenizer or student_path
    remote = cfg.model.trust_remote_code
    fingerprints: dict[str, str] = {}

    def fingerprint(path: str) -> str:
        if path not in fingerprints:
            fingerprints[path] = tokenizer_fingerprint(AutoTokenizer.from_pretrained(path, trust_remote_code=remote))
        return fingerprints[path]

    for name, path in teachers.items():
        if path == student_path and cfg.model.tokenizer is None:
            continue  # the student's own model (context distillation)
        if fingerprint(path) != fingerprint(student_tok):
            raise ConfigError(
                f"distill teacher {name} ({path}) tokenizes differently from the student ({student_tok}): a teacher "
                "scores the student's token ids, so both must share one tokenizer (vocabulary, special tokens and "
                "chat template)"
            )


def output_rows(path: str, trust_remote_code: bool) -> int | None:
    """The logits' width of the model at `path` (its config's vocab_size, a multimodal one's text config's), None
    when the config names none."""
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    vocab = getattr(mc, "vocab_size", None) or getattr(getattr(mc, "text_config", None), "vocab_size", None)
    return int(vocab) if vocab else None


def tokenizer_ids(tokenizer: Any) -> int:
    """How many ids `tokenizer` can produce: its length, or one past its largest id (added tokens included) when
    that is more (an added token's id may lie beyond the base vocabulary's length)."""
    top = max(tokenizer.get_vocab().values(), default=-1)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return max(len(tokenizer), top + 1, max(added, default=-1) + 1)


def check_vocabularies(cfg: Any, teachers: dict[str, str]) -> None:
    """Every teacher has a logit for every id the tokenizer can produce (`tokenizer_ids`): its config's vocab_size
    (the logits' width) is at least that. A teacher narrower than the student over such a tokenizer (Qwen2.5-3B's
    151936 rows under Qwen2.5-7B's 152064, one 151665-token tokenizer) lacks only padding rows: it is accepted, and
    the objective leaves the student's rare samples of them unscored and counts them
    (roll_core.pipelines.objectives.distill). A narrower teacher lacking real token ids is a ConfigError naming both
    widths and the tokenizer's length; a wider teacher is fine (its log-probs are normalised over its own rows)."""
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path

    student_path = resolve_model_path(cfg.model.path)
    remote = cfg.model.trust_remote_code
    student = output_rows(student_path, remote)
    needed: int | None = None
    for name, path in teachers.items():
        if path == student_path or student is None:
            continue  # the student's own model (context distillation), or nothing to compare
        rows = output_rows(path, remote)
        if rows is None or rows >= student:
            continue
        if needed is None:
            tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer or student_path, trust_remote_code=remote)
            needed = tokenizer_ids(tok)
        if rows < needed:
            raise ConfigError(
                f"distill teacher {name} ({path}) has {rows} output rows (its config's vocab_size) but the student "
                f"({student_path}) has {student} and the tokenizer produces {needed} ids: token ids in "
                f"[{rows}, {needed}) are real tokens the student can sample that the teacher has no log-prob for. "
                "Use a teacher whose vocab_size covers the tokenizer (same tokenizer; padding rows may differ)"
            )


class _DistillCollectors:
    """`pipeline=distill`: the prompts collector (synchronous or asynchronous) with teacher prompts."""

    trajectories = False
    objective = "distill"

    def check(self, cfg: Any, task: Any) -> None:
        prompt_collectors.check(cfg, task)
        check_distill(cfg, task)

    def __call__(self, ctx: CollectorContext) -> DistillCollector:
        return DistillCollector(ctx, prompt_collectors(ctx))


distill_collectors = _DistillCollectors()
