"""The inference-engine contract: what a rollout engine (transformers, vLLM, SGLang, a plugin's) must offer.

An `InferEngine` serves two APIs over the same weights:
- the batch API, `generate(prompts, params, n)`: every prompt sampled `n` times, results as padded tensors (the
  RLVR pipeline's call);
- the request API, `submit(request) -> Future`, `abort(request_id)`: one conversation turn at a time, with
  continuous batching inside engines that have it (multi-turn rollout and partial rollout build on it).

Log-probs: for every generated token the engine reports its log-probability under the distribution that sampled it:
`log_softmax(logits / temperature)` after top-k/top-p truncation and renormalisation (identical to the trainer's
recomputation `log_softmax(logits / temperature)` when top_k=0 and top_p=1). Greedy requests (temperature below
`GREEDY_TEMPERATURE`, 0 included) report `log_softmax(logits)`. No other logits processor (repetition penalty, a
model's `generation_config.json`) may change the sampled distribution. Structured outputs
(`SamplingParams.structured`) are the one exception, and they are part of the policy: the engine masks the tokens the
constraint forbids at each step (EOS only where the constraint is complete) and reports log-probs of the masked,
renormalised distribution; the trainer must replay the same constraint over the response tokens to recompute the same
distribution.

A response ends at the first EOS / stop token (kept, mask 1), at the token that completes a stop string (kept,
even when the token overhangs the string's end), or at `max_new_tokens` (finish reason `length`). Rows are
grouped: the n samples of prompt k are rows [k*n, (k+1)*n).

Weights arrive through `update_weights(named tensors)` in the trainer's (Hugging Face) parameter names, bucket by
bucket; `sleep(level)` releases memory while training runs on the same device and `wake_up()` restores it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported where a tensor is built: composing a config (`roll-train --help`) needs none
    from torch import Tensor

#: Temperatures below this are greedy decoding in every engine roll drives (vLLM's own threshold, `_SAMPLING_EPS`):
#: dividing logits by a tinier one overflows (1e-38 in fp32: inf, then NaN log-probs and a garbage token), and the
#: distribution is one-hot to float precision anyway. Engines send such a request to their backend as temperature 0;
#: a run's sampling temperature (which the trainer divides logits by) must be at least this.
GREEDY_TEMPERATURE = 1e-5

#: Why a response ended. `prompt_too_long`: the prompt alone fills the engine's context (nothing generated).
FINISH_REASONS = ("stop", "length", "abort", "prompt_too_long")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the response text: it must match a regex, or be JSON valid under a JSON schema.

    Exactly one of `json_schema` / `regex` is set. A schema may be given as a dict or its JSON text (an OpenAI
    `response_format={"type": "json_schema", "json_schema": {"schema": ...}}` carries the dict). Property order
    matters (the generated JSON follows it), so the canonical text keeps the schema's key order.
    """

    # A JSON schema (dict, or its JSON text): the response is one JSON value valid under it.
    json_schema: dict[str, Any] | str | None = None
    # A regular expression the whole response must match (outlines-core syntax, close to Python's `re`).
    regex: str | None = None

    def __post_init__(self) -> None:
        if (self.json_schema is None) == (self.regex is None):
            raise ValueError("StructuredOutput: set exactly one of json_schema / regex")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"StructuredOutput.regex must be a non-empty string, got {self.regex!r}")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"StructuredOutput.regex {self.regex!r} is not a valid regex: {e}") from None
        else:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutput.json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(
                    "StructuredOutput.json_schema must be a JSON object (a dict or its text), "
                    f"got {type(schema).__name__}"
                )
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"StructuredOutput.json_schema is not JSON-serialisable: {e}") from None

    @property
    def kind(self) -> str:
        """`"json_schema"` or `"regex"`."""
        return "regex" if self.regex is not None else "json_schema"

    @property
    def schema_text(self) -> str | None:
        """The JSON schema as compact JSON text (key order kept), or None for a regex constraint."""
        if self.json_schema is None:
            return None
        schema = json.loads(self.json_schema) if isinstance(self.json_schema, str) else self.json_schema
        return json.dumps(schema, separators=(",", ":"))

    @property
    def schema_dict(self) -> dict[str, Any] | None:
        """The JSON schema as a dict, or None for a regex constraint."""
        text = self.schema_text
        return None if text is None else json.loads(text)

    def key(self) -> tuple[str, str]:
        """A hashable identity (kind, canonical text): equal constraints compile to the same guide."""
        return (self.kind, self.regex if self.regex is not None else self.schema_text)  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutput) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def to_dict(self) -> dict[str, str]:
        """Plain form for a batch's per-row field and for configs: {"json_schema": text} or {"regex": text}."""
        return {self.kind: self.key()[1]}

    @staticmethod
    def from_dict(d: StructuredOutput | dict[str, Any] | None) -> StructuredOutput | None:
        """Inverse of `to_dict` (None and StructuredOutput pass through); unknown keys are an error."""
        if d is None or isinstance(d, StructuredOutput):
            return d
        unknown = set(d) - {"json_schema", "regex"}
        if unknown:
            raise ValueError(f"StructuredOutput: unknown keys {sorted(unknown)} (expected json_schema or regex)")
        return StructuredOutput(json_schema=d.get("json_schema"), regex=d.get("regex"))


#: The batch key of the per-row constraint the trainer replays: a (B, K) uint8 tensor, row i the UTF-8 bytes of
#: `json.dumps(constraint.to_dict())` right-padded with 0, all zeros for an unconstrained row (see
#: `structured_rows`). A tensor, not a per-row field, because train workers hand engines `batch.tensors()` only,
#: and a tensor follows every row split, shuffle and chunk of the batch for free.
STRUCTURED_KEY = "structured"


def structured_rows(constraints: Sequence[StructuredOutput | dict[str, Any] | None], width: int = 0) -> Tensor:
    """The (B, K) uint8 batch encoding of one constraint per row (None: unconstrained); K = the longest row's
    byte length, or `width` if larger (to concatenate with another batch's encoding of that width)."""
    import torch

    rows = [
        json.dumps(c.to_dict()).encode() if c is not None else b"" for c in map(StructuredOutput.from_dict, constraints)
    ]
    out = torch.zeros((len(rows), max([width, *map(len, rows)])), dtype=torch.uint8)
    for i, raw in enumerate(rows):
        if raw:
            out[i, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def structured_from_rows(encoded: Tensor) -> list[StructuredOutput | None]:
    """Inverse of `structured_rows`: one constraint (or None) per row of a (B, K) uint8 tensor."""
    import torch

    if encoded.dim() != 2 or encoded.dtype != torch.uint8:
        raise ValueError(
            f"batch[{STRUCTURED_KEY!r}] must be a (B, K) uint8 tensor, got {encoded.dtype} {tuple(encoded.shape)}"
        )
    out: list[StructuredOutput | None] = []
    for row in encoded.cpu():
        raw = bytes(row.numpy().tobytes()).rstrip(b"\0")
        out.append(StructuredOutput.from_dict(json.loads(raw)) if raw else None)
    return out


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response. Engines must honour every field or refuse it (`check_sampling`)."""

    # Softmax temperature, finite and >= 0; below GREEDY_TEMPERATURE (1e-5, 0 included) greedy decoding, in every
    # engine (vLLM's threshold: a tinier divisor overflows the logits).
    temperature: float = 1.0
    # Nucleus sampling mass, in (0, 1] (1 disables).
    top_p: float = 1.0
    # Keep only the k most likely tokens, >= 0 (0 disables; vLLM's -1 is refused, not read as "disabled").
    top_k: int = 0
    # Maximum tokens to generate, >= 1.
    max_new_tokens: int = 128
    # Strings that end a response (the completing token is kept).
    stop: tuple[str, ...] = ()
    # Token ids that end a response besides the model's EOS ids.
    stop_token_ids: tuple[int, ...] = ()
    # Keep generating past EOS (benchmarks).
    ignore_eos: bool = False
    # Seed of this request's sampling noise; None: the engine's running generator.
    seed: int | None = None
    # Constrained decoding (JSON schema / regex); None: unconstrained. Engines without support refuse it.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # NaN compares false with everything: `< 0` alone let it through (NaN logits), and inf sampled uniformly.
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature} must be >= 0 and finite (below {GREEDY_TEMPERATURE}: greedy)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            object.__setattr__(self, "structured", StructuredOutput.from_dict(self.structured))

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature below GREEDY_TEMPERATURE (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE

    def replace(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass
class Request:
    """One generation request: a conversation's next turn, as token ids."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # The pictures of a vision-language prompt (roll_core.multimodal.MMInputs); their placeholder tokens are
    # already expanded in `prompt_ids`. None for text.
    mm: Any = None


@dataclass
class RequestOutput:
    """The result of one request. `token_ids` and `logprobs` have one entry per generated token."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    # One of FINISH_REASONS.
    finish_reason: str
    # Weight version the tokens were sampled under (incremented by every `update_weights` completion); for a
    # request that ran across an update, the oldest (the one it started under).
    weight_version: int = 0
    # MoE engines asked to record routing (infer_engine.return_routing): (len(prompt_ids) + len(token_ids),
    # num_moe_layers, top_k) int16 expert ids per position, -1 where none was computed (roll_core.routing).
    routed_experts: Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{self.request_id}: {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{self.request_id}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")


@dataclass
class GenerateOutput:
    """Output of one batch `generate` call: (B*n, R) tensors on CPU plus per-row finish reasons."""

    # (B*n, R) long: response token ids, right-padded with the pad id.
    responses: Tensor
    # (B*n, R) float32: log-prob of each sampled token (0 where the mask is 0).
    logprobs: Tensor
    # (B*n, R) long: 1 on generated tokens.
    response_mask: Tensor
    # B*n entries of FINISH_REASONS.
    finish_reasons: list[str]
    # Wall seconds of the call.
    seconds: float = 0.0
    # Per row, RequestOutput.routed_experts (engines recording MoE routing), else None.
    routed_experts: list[Tensor] | None = None

    @property
    def truncated(self) -> Tensor:
        """(B*n,) long: 1 where the response hit max_new_tokens."""
        import torch

        return torch.tensor([r == "length" for r in self.finish_reasons], dtype=torch.long)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    @staticmethod
    def from_requests(outputs: Sequence[RequestOutput], pad_id: int, seconds: float = 0.0) -> GenerateOutput:
        """Right-pad per-request outputs into batch tensors (row order kept)."""
        import torch

        r = max((len(o.token_ids) for o in outputs), default=0)
        resp = torch.full((len(outputs), r), pad_id, dtype=torch.long)
        logp = torch.zeros((len(outputs), r), dtype=torch.float32)
        mask = torch.zeros((len(outputs), r), dtype=torch.long)
        for i, o in enumerate(outputs):
            k = len(o.token_ids)
            if k:
                resp[i, :k] = torch.tensor(o.token_ids, dtype=torch.long)
                logp[i, :k] = torch.tensor(o.logprobs, dtype=torch.float32)
                mask[i, :k] = 1
        routing = [o.routed_experts for o in outputs]
        routed = routing if outputs and all(r is not None for r in routing) else None
        return GenerateOutput(resp, logp, mask, [o.finish_reason for o in outputs], seconds, routed)


class UnsupportedSamplingError(ValueError):
    """Sampling parameters this engine cannot honour (a config error naming the engine)."""


#: roll's inference engines that constrain decoding (engines declare it with `structured_outputs = True`).
STRUCTURED_ENGINES = ("hf", "vllm", "sglang")


def check_structured(engine: object, params: SamplingParams) -> None:
    """Refuse a constrained request on an engine that does not declare `structured_outputs = True` (a plugin's
    engine that predates structured outputs would otherwise ignore the constraint silently). Callers that route
    requests to an engine (the infer worker) call it next to `engine.check_sampling`."""
    if params.structured is not None and not getattr(engine, "structured_outputs", False):
        name = getattr(engine, "name", type(engine).__name__)
        raise UnsupportedSamplingError(
            f"infer_engine={name} cannot constrain decoding (SamplingParams.structured: a JSON schema or regex): "
            f"use infer_engine={', '.join(STRUCTURED_ENGINES)}"
        )


@runtime_checkable
class InferEngine(Protocol):
    """What an inference worker hosts. Engines take plain values and never a Hydra config."""

    #: Registry name (`infer_engine=<name>`).
    name: str
    #: Whether requests submitted while others run join the running batch (continuous batching).
    continuous_batching: ClassVar[bool]
    # Optional: `structured_outputs: ClassVar[bool] = True` where `SamplingParams.structured` is honoured (masked
    # decoding, log-probs of the masked distribution); see `check_structured`.

    @property
    def max_context_length(self) -> int:
        """Most tokens (prompt + response) one sequence may hold."""
        ...

    @property
    def pad_id(self) -> int:
        """Pad token id used in batch outputs."""
        ...

    def check_sampling(self, params: SamplingParams) -> None:
        """Raise `UnsupportedSamplingError` naming the engine if `params` cannot be honoured exactly."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        n: int = 1,
        mm: Sequence[Any] | None = None,
        first_row: int = 0,
    ) -> GenerateOutput:
        """Sample `n` responses per prompt (rows grouped per prompt); see the module docstring. `mm`: one
        `roll_core.multimodal.MMInputs` or None per prompt (placeholders already expanded in the ids); only engines
        serving vision-language models take it, and callers pass it only when a prompt has pictures. With a seed,
        row r samples the stream of row `first_row + r` (`derive_seed(params.seed, Purpose.ENGINE_ROW, first_row +
        r)` in roll's engines): the slice of a batch starting at row `first_row` samples what the whole batch's call
        samples for those rows, so a batch split over engines samples what one engine would. Callers pass
        `first_row` only when it is not 0."""
        ...

    def submit(self, request: Request) -> Future[RequestOutput]:
        """Start one request; the future resolves when it finishes or is aborted. Never blocks on generation."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a running or queued request; its future resolves with finish reason `abort` and the tokens
        generated so far. False if the id is unknown or already finished."""
        ...

    def begin_weight_update(self) -> None:
        """Pause generation (running requests wait, none is lost) until `finish_weight_update`."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Copy one bucket of new weights (trainer's parameter names) into the engine; returns bytes received."""
        ...

    def finish_weight_update(self) -> int:
        """Called once after all buckets of one sync: drops stale caches, resumes generation and returns the new
        weight version."""
        ...

    # Optional: `abort_weight_update(reason: str) -> int`, called instead of `finish_weight_update` when a sync
    # failed outside the engine (the trainer died between buckets, an object-store bucket could not be fetched, a
    # broadcast broke): put back what the sync wrote, resume generation on the old weights whole and return the
    # weight version, unchanged. Engines without it are finished (`finish_weight_update`) and keep whatever part of
    # the sync they received (roll_core.cluster.infer_role.InferWorker.abort_weight_update).

    def sleep(self, level: int = 1) -> None:
        """Release memory while another role uses the device: level 1 frees the KV cache (and offloads weights on
        devices), level 2 also discards the weights (the next sync must send all of them). No requests may run."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep` (level 2: weights are allocated but hold garbage until the next full sync)."""
        ...

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this engine holds now: {"weights": ..., "kv_cache": ...} (device or host memory)."""
        ...

    def shutdown(self) -> None:
        """Stop background threads and processes; the engine is unusable afterwards."""
        ...
