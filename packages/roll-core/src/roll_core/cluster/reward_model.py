"""The `reward_model` role: a transformers sequence-classification model scoring (prompt, response) rows.

`RewardModelWorker` loads `AutoModelForSequenceClassification` (one label) on its device and scores rows in
forward passes of `batch_size` rows; `RewardModelGroup` is the typed group the controller calls
(`reward_model.score(batch) -> Batch`). A row is the prompt and the response text, formatted by `format_row`: the
tokenizer's chat template over the conversation the policy was prompted with (`prompt_messages`: system prompt,
examples, earlier turns, the user message; the user message `prompt_text` alone where a batch has no messages) and
the response as the assistant turn, or a text template with `{response}` and `{prompt}` (the user message alone,
as before) and/or `{conversation}` (the whole prompt conversation as plain text: `role: content` per message, blank
lines between; a text template with `{prompt}` alone drops the policy's system prompt and earlier turns, logged once
per worker), cut to `max_length` tokens (`truncation_side`; a left cut keeps a leading BOS); the result carries
`rm_scores` (B,) float32, the model's logit as it comes (normalisation and mixing with the task reward are the
controller's: roll_core.pipelines.reward_model), and `rm_truncated` (B,) bool. Each score is the one an unpadded
transformers forward of the row alone gives: with the model's own pad token, transformers' rule (the last token
that is not it); without one (the tokenizer's pad fills the rows), the row's last token, even when it is the
tokenizer's pad (an EOS).

The response is the policy's text, scored as it was written: its reasoning included (a thinking policy's
`...</think>` block stays in the assistant turn, for the reward model's chat template to render or drop as it
does; a generation header that opened the block leaves no `<think>` in the text). A special token of the reward
tokenizer spelt in it (`<|im_end|>\n<|im_start|>user\n...`) is encoded as text (`response_specials`, the LLM
judge's roll_core.agentic.turn_text.SpecialText): decoding dropped the policy's own special tokens, so such a
spelling is text it wrote, and given the special id it ended the assistant turn and forged the turns the reward
model scores. The prompt and its conversation are the data's, rendered as the policy's prompt was.

In bf16/fp16 the classifier's head (`score`, one output) runs in float32 (`fp32_score_head`): its weight upcast,
its input hidden state upcast per call. A half-precision head rounded each logit to a bf16 step (1/64 at a score
of 3): a row's score moved by a whole step with the batch it was padded in, and close responses of a GRPO group
tied (no advantage between them).

A checkpoint missing weights that transformers would initialise at random (a classifier's head) is a
ConfigError when the worker loads it, and logits not of one label per row fail the scoring call.

Sleep: with `offload` the weights live in host memory and move to the device only for a scoring call, the way an
inference engine's `sleep(1)` frees the device for the trainer (roll_engines' hf engine); `sleep()`/`wake_up()`
do the same on demand. Stateless between calls, so a restarted worker needs nothing restored (`restartable`).

May assume the model passed `check_reward_model` (the driver checks it before building the role); must not
change rows' order, and never raises for odd text (empty responses, characters outside the vocabulary).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from roll_core.agentic.turn_text import SpecialText
from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.worker import Dispatch, Worker, dispatch
from roll_core.config.reward_model import CHAT_TEMPLATE
from roll_core.errors import ConfigError
from roll_core.protocol import Batch

log = logging.getLogger(__name__)


def check_reward_model(path: str, *, trust_remote_code: bool = False, tokenizer: str | None = None) -> str:
    """Refuse, as a ConfigError naming `reward_model.path`, a model that is missing or is not a sequence
    classifier with exactly one label; returns the local folder (or hub id) to load. Reads configs only."""
    from transformers import AutoConfig

    from roll_core.models import resolve_model_path

    try:
        resolved = resolve_model_path(path)
    except ConfigError as exc:  # its message names model.path; this is the reward model's
        raise ConfigError(str(exc).replace("model.path", "reward_model.path")) from None
    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"reward_model.path={path}: cannot read its config ({type(exc).__name__}: {exc})") from None
    archs = list(getattr(config, "architectures", None) or [])
    # Loading a causal LM (or a bare config) as a classifier would give it a fresh random head: silent noise.
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"reward_model.path={path} holds {', '.join(archs) or 'a model of unknown architecture'}, not a sequence "
            "classifier: a reward model is an ...ForSequenceClassification checkpoint with num_labels=1"
        )
    if int(getattr(config, "num_labels", 0)) != 1:
        raise ConfigError(
            f"reward_model.path={path} is a classifier with {config.num_labels} labels; a reward model has one "
            "(num_labels=1: its logit is the score)"
        )
    if getattr(config, "pad_token_id", None) is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer or resolved, trust_remote_code=trust_remote_code)
        if tok.pad_token_id is None:
            raise ConfigError(
                f"reward_model.path={path}: neither its config nor its tokenizer has a pad token, so a batch's "
                "last tokens cannot be found: set pad_token_id in its config.json"
            )
    return resolved


def format_row(
    tokenizer: Any,
    template: str,
    prompt: str,
    response: str,
    messages: Sequence[Mapping[str, Any]] | None = None,
    special: SpecialText | None = None,
) -> list[int]:
    """Token ids of one (prompt, response) row: the chat template over `messages` (the conversation the policy
    was prompted with; None: a user turn of `prompt`) and an assistant turn of `response` (`template="chat"`), or
    `template.format(prompt=..., conversation=conversation_text(messages, prompt), response=...)` tokenised with the
    tokenizer's specials; a text template that
    spells those leading specials itself (`<|begin_of_text|>{prompt}...`) keeps its own, as SFT's raw text does
    (the tokenizer's second bos is an input the reward model never saw). `special` (the reward tokenizer's
    `response_specials`): the special tokens the response spells are encoded as text (see the module docstring);
    a row whose response spells none gets the same ids as without it."""
    marked = special.mark(response) if special is not None else response
    if marked != response:
        try:
            return _format_marked(tokenizer, template, prompt, response, marked, messages, special)
        except ValueError:  # a spelling the tokenizer gives a special id even character by character: dropped
            assert special is not None
            log.warning("reward model: a response spells a special token that cannot be encoded as text: removed")
            response = _spelt(special).sub("", response)
    if template == CHAT_TEMPLATE:
        return _chat_ids(tokenizer, _chat(prompt, response, messages), tokenize=True)
    text = template.format(prompt=prompt, conversation=conversation_text(messages, prompt), response=response)
    return _with_added_specials(tokenizer, text, list(tokenizer(text, add_special_tokens=False)["input_ids"]))


def response_specials(tokenizer: Any) -> SpecialText:
    """What `format_row` marks in a response: the tokenizer's special tokens (not its plain added tokens: a
    response's `</think>` or `<tool_call>` is the policy's own token, which decoding kept; its special tokens were
    dropped by decoding, so a special token in the text was spelt)."""
    return SpecialText(tokenizer, ())


def _spelt(special: SpecialText) -> re.Pattern[str]:
    return re.compile("|".join(map(re.escape, special.tokens)) or "(?!)")


def _chat(prompt: str, response: str, messages: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    convo = [dict(m) for m in messages] if messages else [{"role": "user", "content": prompt}]
    convo.append({"role": "assistant", "content": response})
    return convo


def _chat_ids(tokenizer: Any, convo: list[dict[str, Any]], *, tokenize: bool) -> Any:
    """The chat template over `convo`: its ids (`tokenize`) or its text."""
    try:
        out = tokenizer.apply_chat_template(convo, tokenize=tokenize, return_dict=False)
    except Exception:  # jinja's raise_exception: Gemma-style templates have no system role
        if not convo or convo[0].get("role") != "system":
            raise
        out = tokenizer.apply_chat_template(_system_folded(convo), tokenize=tokenize, return_dict=False)
    if not tokenize:
        return out
    return list(out["input_ids"] if isinstance(out, dict) else out)


def _format_marked(
    tokenizer: Any,
    template: str,
    prompt: str,
    response: str,
    marked: str,
    messages: Sequence[Mapping[str, Any]] | None,
    special: SpecialText,
) -> list[int]:
    """`format_row` of a response that spells special tokens (`marked`: SpecialText.mark of it): rendered with the
    marked response, encoded with the spellings as text; ValueError where one cannot be."""
    if template == CHAT_TEMPLATE:
        return special.encode_after("", _chat_ids(tokenizer, _chat(prompt, marked, messages), tokenize=False))
    conversation = conversation_text(messages, prompt)
    own = special.encode_after("", template.format(prompt=prompt, conversation=conversation, response=marked))
    text = template.format(prompt=prompt, conversation=conversation, response=response)
    return _with_added_specials(tokenizer, text, own)


def _with_added_specials(tokenizer: Any, text: str, own: list[int]) -> list[int]:
    """`own` (the ids of `text` without the specials the tokenizer adds) with those the tokenizer adds around
    `text` (its bos, eos, sep), less the leading ones the text spells itself."""
    with_specials = list(tokenizer(text)["input_ids"])
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    start = next(
        (s for s in range(len(with_specials) - len(plain) + 1) if with_specials[s : s + len(plain)] == plain), None
    )
    if start is None:  # (a post-processor that changes the text's own ids: as the tokenizer gives them)
        return with_specials if own == plain else own
    head, tail = with_specials[:start], with_specials[start + len(plain) :]
    if own and 0 < start <= len(own) and own[:start] == head:
        head = []  # the text's own bos, then whatever the tokenizer adds after it (eos, sep)
    return head + own + tail


def conversation_text(messages: Sequence[Mapping[str, Any]] | None, prompt: str) -> str:
    """A text template's `{conversation}`: each message of the policy's prompt conversation (None: one user
    message, `prompt`) as `role: content`, blank lines between; a content given as parts keeps its text parts (a
    text reward model reads no pictures)."""
    convo = list(messages) if messages else [{"role": "user", "content": prompt}]
    return "\n\n".join(f"{m.get('role', 'user')}: {_content_text(m.get('content'))}" for m in convo)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
    return str(content)


def drops_context(messages: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether a prompt conversation holds more than one user message (a system prompt, examples, earlier
    turns): what a text template's `{prompt}` leaves out."""
    return bool(messages) and not (len(messages) == 1 and messages[0].get("role") == "user")


def _system_folded(convo: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`convo` with its leading system message put before the first user message's text (what Gemma's own
    template does with one), for a reward model whose chat template refuses the system role: dropping it would
    score the response against another instruction than the policy's."""
    system, rest = convo[0], [dict(m) for m in convo[1:]]
    first = next((m for m in rest if m.get("role") == "user"), None)
    if first is None:
        return rest
    first["content"] = f"{system.get('content', '')}\n\n{first.get('content', '')}"
    return rest


def truncate(ids: list[int], max_length: int, side: str, bos: int | None = None) -> tuple[list[int], bool]:
    """`ids` cut to `max_length` tokens from the `side` end ("left": keep the last tokens); (ids, was_cut). A left
    cut keeps a leading `bos` (models trained with one read every input from it: Llama's scores shift without)."""
    if len(ids) <= max_length:
        return ids, False
    if side == "left":
        head = ids[:1] if bos is not None and ids and ids[0] == bos and max_length > 1 else []
        return head + ids[len(ids) - (max_length - len(head)) :], True
    return ids[:max_length], True


#: Attribute names of a sequence classifier's final linear head: transformers' decoder classifiers' (`score`:
#: Llama, Qwen, Mistral, Gemma, GPT-2...) and encoders' (`classifier` where it is one linear layer: BERT's).
HEAD_NAMES = ("score", "classifier")


def fp32_score_head(model: torch.nn.Module) -> bool:
    """Run `model`'s final linear head in float32 when it is in bf16/fp16 (see the module docstring): its
    parameters upcast in place, a forward pre-hook upcasting its input; its logits come out float32. Returns
    whether it did (False: the head is already float32, or not one linear layer under a HEAD_NAMES name)."""
    head = next((h for h in (getattr(model, n, None) for n in HEAD_NAMES) if isinstance(h, torch.nn.Linear)), None)
    if head is None or head.weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    head.float()
    head.register_forward_pre_hook(_upcast_input)
    return True


def _upcast_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The head's positional inputs (the hidden states) in float32."""
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


class RewardModelWorker(Worker):
    """Hosts one copy of the reward model (see the module docstring)."""

    def __init__(
        self,
        path: str,
        tokenizer: str | None = None,
        template: str = CHAT_TEMPLATE,
        batch_size: int = 16,
        max_length: int = 1024,
        truncation_side: str = "left",
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        offload: bool = False,
        platform: str = "auto",
        **base: Any,
    ) -> None:
        super().__init__(**base)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from roll_core.devices import resolve_device

        resolved = resolve_device({"platform": platform, "device": "auto", "dtype": dtype, "role": "reward_model"})
        self.device = torch.device(resolved["device"])
        self.template, self.batch_size, self.max_length = template, batch_size, max_length
        self.truncation_side, self.offload = truncation_side, offload
        self._warned = False  # the {prompt}-drops-the-system-prompt warning, given once
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=trust_remote_code)
        self.special = response_specials(self.tokenizer)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            dtype=getattr(torch, resolved["dtype"]),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            # transformers initialises them at random and only logs it: each worker would score with its own
            # random head (a causal LM saved under a classifier's config, a base model before its head was trained).
            raise ConfigError(
                f"reward_model.path={path}: the checkpoint has no weights for {', '.join(missing[:4])}"
                f"{' ...' if len(missing) > 4 else ''} (transformers would initialise them at random): not a trained "
                "reward model"
            )
        context = next(
            (int(v) for v in (getattr(model.config, k, None) for k in ("max_position_embeddings", "n_positions")) if v),
            None,
        )
        if context is not None and context < max_length:
            # Rows past the model's context crash learned position embeddings (GPT-2's IndexError failed the whole
            # scoring call) or are scored out of range (RoPE): cut them there, counted in reward_model/truncated.
            log.warning(
                "reward_model.max_length=%d exceeds the reward model's context (%d tokens): rows are cut to %d",
                max_length,
                context,
                context,
            )
            self.max_length = context
        # A model with no pad token of its own reads the last token of every input (transformers' pooling without
        # one); the tokenizer's pad then only fills rows (check_reward_model made sure it has one), and each pass
        # tells the pooling a pad id that no row ends with: a tokenizer whose pad is its EOS scored a row ending in
        # EOS at the token before it. With the model's own pad token, transformers' rule stands as it was trained.
        self.reads_last_token = model.config.pad_token_id is None
        if self.reads_last_token:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.pad_id = int(model.config.pad_token_id)
        if not fp32_score_head(model) and model.dtype in (torch.bfloat16, torch.float16):
            log.info("reward model: no linear head (%s) to run in float32: logits in %s", HEAD_NAMES, model.dtype)
        model.requires_grad_(False)
        self.model = model.eval()
        self._asleep = False
        # Offloaded weights start (and stay, between calls) in host memory.
        if offload:
            self._asleep = True
        else:
            self.model.to(self.device)

    # ---- scoring ------------------------------------------------------------------------------------------
    def tokenize(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        messages: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
    ) -> tuple[list[list[int]], list[bool]]:
        """Model input ids of each row (`messages`: each row's prompt conversation, see `format_row`), cut to
        `max_length` (a leading BOS kept), and whether each was cut."""
        bos = self.tokenizer.bos_token_id
        convos = messages if messages is not None else [None] * len(prompts)
        if not self._warned and self.template != CHAT_TEMPLATE and "{conversation}" not in self.template:
            dropped = sum(drops_context(m) for m in convos)
            if dropped:
                # Kept for back-compat ({prompt} always was the user message), but the reward model then judges
                # the response against less than the policy was told: say so once.
                self._warned = True
                log.warning(
                    "reward_model.template reads {prompt}, the user message alone: %d of %d prompts also carry a "
                    "system prompt or earlier turns the reward model does not see; {conversation} renders them all",
                    dropped,
                    len(convos),
                )
        rows = [
            truncate(
                format_row(self.tokenizer, self.template, p, r, m, self.special),
                self.max_length,
                self.truncation_side,
                bos,
            )
            for p, r, m in zip(prompts, responses, convos)
        ]
        return [ids for ids, _ in rows], [cut for _, cut in rows]

    @torch.inference_mode()
    def forward(self, rows: list[list[int]]) -> torch.Tensor:
        """(B,) float32 scores of token-id rows, `batch_size` rows per pass. Rows are right-padded (positions
        stay those of an unpadded forward) and grouped by length (less padding); the result is in input order."""
        out = torch.empty(len(rows), dtype=torch.float32)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            width = max(len(rows[i]) for i in idx)
            fill = self.pad_id
            if self.reads_last_token:  # (at most batch_size ends: one of the first batch_size + 1 ids is free)
                ends = {rows[i][-1] for i in idx if rows[i]}
                fill = fill if fill not in ends else next(t for t in range(len(ends) + 1) if t not in ends)
                self.model.config.get_text_config().pad_token_id = fill
            ids = torch.full((len(idx), width), fill, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, i in enumerate(idx):
                ids[j, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
                mask[j, : len(rows[i])] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            if tuple(logits.shape) != (len(idx), 1):  # (remote code whose head is not one label per row)
                raise ValueError(
                    f"the reward model returned logits of shape {tuple(logits.shape)} for {len(idx)} rows, not "
                    f"({len(idx)}, 1): a reward model has one label"
                )
            out[torch.tensor(idx)] = logits[:, 0].float().cpu()
        return out

    @dispatch(Dispatch.DP)
    def score(self, batch: Batch) -> Batch:
        """`rm_scores` (B,) float32 and `rm_truncated` (B,) bool of `batch["prompt_text"]` (with
        `batch["prompt_messages"]` where the batch has them) x `batch["response_text"]`."""
        messages = batch["prompt_messages"] if "prompt_messages" in batch else None
        rows, cut = self.tokenize(batch["prompt_text"], batch["response_text"], messages)
        if not rows:
            return Batch({"rm_scores": torch.empty(0), "rm_truncated": torch.empty(0, dtype=torch.bool)})
        woke = self._asleep
        if woke:
            self.wake_up()
        try:
            scores = self.forward(rows)
        finally:
            if woke and self.offload:
                self.sleep()
        return Batch({"rm_scores": scores, "rm_truncated": torch.tensor(cut, dtype=torch.bool)})

    # ---- memory ------------------------------------------------------------------------------------------
    @dispatch(Dispatch.BROADCAST)
    def sleep(self) -> None:
        """Weights to host memory; the device's cache is released (a no-op on CPU)."""
        if self.device.type != "cpu":
            self.model.to("cpu")
            from roll_hw import current_platform

            current_platform.empty_cache()
        self._asleep = True

    @dispatch(Dispatch.BROADCAST)
    def wake_up(self) -> None:
        """Weights back on the device."""
        self.model.to(self.device)
        self._asleep = False

    @dispatch(Dispatch.BROADCAST)
    def memory_bytes(self) -> dict[str, Any]:
        """Bytes of weights on the device (0 while asleep off-CPU), the device and whether the worker sleeps."""
        on_device = sum(
            p.numel() * p.element_size()
            for p in list(self.model.parameters()) + list(self.model.buffers())
            if p.device.type == self.device.type
        )
        return {"weights": on_device, "device": str(self.device), "asleep": self._asleep}


class RewardModelGroup(WorkerGroup[RewardModelWorker]):
    """reward_model. Restartable: workers hold no state between calls, so a re-created one reruns the call."""

    worker_cls = RewardModelWorker
    restartable = True

    def score(self, batch: Batch) -> Batch:
        """Scores of every row of `batch` (fields `prompt_text`, `response_text`, and `prompt_messages` when it has
        them), split over the workers: `rm_scores` (B,) float32 (the model's logit) and `rm_truncated` (B,) bool."""
        keys = ("prompt_text", "response_text", *(["prompt_messages"] if "prompt_messages" in batch else []))
        return Batch.concat(self.submit(RewardModelWorker.score, batch.select(*keys)).values())

    def sleep(self) -> None:
        self.call(RewardModelWorker.sleep)

    def wake_up(self) -> None:
        self.call(RewardModelWorker.wake_up)

    def memory_bytes(self) -> list[dict[str, Any]]:
        return self.call(RewardModelWorker.memory_bytes)
