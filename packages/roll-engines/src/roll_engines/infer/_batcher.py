"""Continuous batching over a transformers model with a ragged, left-aligned KV cache.

Requests join and leave the running batch between decode steps:
- admission prefills the new prompts (identical prompts once, their cache rows repeated: the n samples of a
  GRPO group share one prefill), samples each one's first token and merges its cache rows into the running
  cache, left-padding the shorter side with masked columns;
- every decode step feeds each running row its last token at its own position id;
- finished or aborted rows leave the batch, and columns no remaining row uses are trimmed;
- a prefill that raises is retried in halves (only then: a batch that succeeds runs once) down to the prompt(s)
  that fail alone: their requests fail with a `PrefillError` naming them (the cause chained), the other new requests
  are admitted as usual and the running rows never notice (a picture the vision tower cannot take failed every
  request of the engine). A failure after the forwards (sampling, merging) still fails everything: the running
  cache may be half merged.

Rotary embeddings are applied before keys enter the cache, so masked padding columns change nothing: a row's
result does not depend on which rows share its batch (up to float reassociation). Caches whose layers are not
plain `DynamicLayer`s (sliding windows) cannot be merged; for those models requests are admitted only into an
empty batch (static batching), which is correct but slower.

Vision-language models (`vision`, roll_engines.infer._vision): a prompt's pictures go in at its prefill, prompts
are equal only with equal pictures (ids and digests), positions are explicit (3D for mrope families) and each row
decodes from its own `rope_delta`.

A request id is held from `add` until its future resolves: `add` refuses (ValueError) an id still held, because
`abort(request_id)` could stop only one of the two (the vllm engine refuses the same way). A caller that cancels its
future (`Future.cancel()`) aborts the request: it is never admitted, or its row leaves at the next step boundary; the
batcher never sets a result or an exception on a cancelled future (that raised InvalidStateError, which failed
every request of the engine).

Not thread-safe by itself: the engine serialises `step()` and mutations with its lock.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from roll_core.interfaces.inference import Request, RequestOutput
from roll_engines.infer._routing import RoutingRecorder
from roll_engines.infer._sampling import StopStrings, processed_logprobs, sample_rows
from roll_engines.infer._vision import VisionInputs, mm_key, pictures

log = logging.getLogger(__name__)


class GrowingLayer(DynamicLayer):
    """A plain KV-cache layer (transformers' DynamicLayer protocol) over buffers with spare sequence capacity.

    transformers' DynamicLayer concatenates every new token onto the whole cache, copying all of it at every
    decode step (measured: 30% of decode time for a 135M model at 32 rows). Here a token is written in place and
    the buffer doubles when full, so the copy cost is amortised to O(1) per token. `keys`/`values` are views of
    the filled part, which is what attention reads.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self._k: Tensor | None = None  # (B, H, capacity, D)
        self._v: Tensor | None = None
        self.length = 0
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.is_initialized = False

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def _reserve(self, need: int) -> None:
        cap = self._k.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        grow = [*self._k.shape[:2], new_cap - cap, self._k.shape[3]]
        self._k = torch.cat([self._k, self._k.new_zeros(grow)], dim=2)
        self._v = torch.cat([self._v, self._v.new_zeros(grow)], dim=2)

    def update(self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object):
        n = key_states.shape[2]
        if not self.is_initialized:
            shape = [*key_states.shape[:2], n + 64, key_states.shape[3]]
            self._k, self._v = key_states.new_zeros(shape), value_states.new_zeros(shape)
            self.is_initialized = True
        self._reserve(self.length + n)
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_cache_shape(self) -> int:
        return -1

    def get_max_length(self) -> int:
        return -1

    # ---- the batcher's row and column surgery ------------------------------------------------------------
    def load(self, keys: Tensor, values: Tensor) -> None:
        """Start from given keys and values (B, H, L, D) (a reused prefix), with spare capacity."""
        self._k, self._v, self.length = keys, values, keys.shape[2]
        self.is_initialized = True
        self._reserve(self.length + 64)
        self._views()

    def row(self, i: int, last: int) -> tuple[Tensor, Tensor]:
        """Copies of row i's last `last` columns (its real tokens: a row's columns are contiguous at the end)."""
        return self.keys[i : i + 1, :, -last:].clone(), self.values[i : i + 1, :, -last:].clone()

    def select_rows(self, idx: Tensor) -> None:
        self._k, self._v = self._k[idx], self._v[idx]
        self._views()

    batch_select_indices = select_rows  # the name transformers' Cache calls

    def trim_front(self, n: int) -> None:
        """Drop the first n columns (unused by every remaining row)."""
        self._k, self._v = self._k[:, :, n:], self._v[:, :, n:]
        self.length -= n
        self._views()

    def append_rows(self, other: GrowingLayer, width: int) -> None:
        """Rows of `other` below this layer's, both left-padded to `width` columns (masked padding)."""

        def lpad(t: Tensor) -> Tensor:
            extra = width - t.shape[2]
            return t if not extra else torch.cat([t.new_zeros([*t.shape[:2], extra, t.shape[3]]), t], dim=2)

        k = torch.cat([lpad(self.keys), lpad(other.keys)], dim=0)
        v = torch.cat([lpad(self.values), lpad(other.values)], dim=0)
        self._k, self._v, self.length = k, v, width
        self._reserve(width + 64)
        self._views()


class PrefillError(RuntimeError):
    """A request whose prompt's forward raised when run without the rest of its batch (the cause is chained).
    `detail`: the message without the request's id (roll_engines.infer._rows.caller_error)."""

    def __init__(self, request_id: str, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.detail = message if detail is None else detail


def settle(future: Future, result: object = None, exc: BaseException | None = None) -> None:
    """Resolve `future` unless its caller cancelled it (or it is resolved already): a cancelled request is aborted,
    and its outcome has no one to go to. Checked under the future's own lock (`set_*` raise once it is done), as a
    `done()` test first could race a cancel from another thread."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def plain_layers(cache: object) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass
class Running:
    """A request's state inside the batcher: its sampling stream, stop rule and what it generated so far."""

    request: Request
    future: Future
    generator: torch.Generator
    stop: StopStrings
    max_new: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False
    finish: str | None = None
    # Decode position of response token j is prompt_len + j + rope_delta (mrope: the prompt's max position + 1 - len).
    rope_delta: int = 0
    # Per forward that computed this request's positions, their experts (roll_engines.infer._routing; recording on).
    routing: list[Tensor] = field(default_factory=list)
    # Weight version its prompt's keys and values were computed under (set at admission): a row that ran across a
    # weight update holds old-weight KV, which must not enter the prefix store.
    kv_version: int = -1

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)


#: One prefill forward's result: its requests, their cache rows and mask (one row each), their last logits.
Prefilled = tuple[list[Running], object, Tensor, Tensor]


class ContinuousBatcher:
    """Owns the running batch of one model; `step()` admits waiting requests and decodes one token for all."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_ids: set[int],
        pad_id: int,
        max_num_seqs: int,
        max_context: int,
        device: torch.device,
        version: Callable[[], int],
        prefix_cache_bytes: int = 0,
        vision: VisionInputs | None = None,
        routing: RoutingRecorder | None = None,
        name: str = "hf",
    ) -> None:
        self.name = name
        self.model, self.eos_ids, self.pad_id = model, eos_ids, pad_id
        self.routing = routing  # records each forward's MoE experts per request (return_routing)
        self.vision = vision
        self.max_num_seqs, self.max_context, self.device = max_num_seqs, max_context, device
        self.version = version
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        # Request id -> its queue entry, from `add`; an entry whose future is done no longer holds its id (pruned
        # in `add`: requests resolve along many paths, and done futures are what they have in common).
        self.held: dict[str, Running] = {}
        self.cache = None  # DynamicCache of the running rows, (B, H, L, D) per layer
        self.attn: Tensor | None = None  # (B, L) 1 on real cached tokens
        self.mergeable = True  # False once a cache turned out to have non-plain layers
        from roll_engines.infer._prefix_cache import PrefixStore

        self.prefixes = PrefixStore(prefix_cache_bytes)
        # transformers >= 5.x names the cache argument `cache`; older releases and remote code `past_key_values`.
        import inspect

        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    # ---- queue --------------------------------------------------------------------------------------------
    def add(self, seq: Running) -> None:
        """Queue a request; ValueError when its id belongs to a request not yet resolved (module docstring)."""
        rid = seq.request.request_id
        other = self.held.get(rid)
        if other is not None and not other.future.done():
            raise ValueError(
                f"{self.name}: request id {rid!r} is already running; a running request's id must be unique (abort "
                "names requests by it)"
            )
        if len(self.held) > 2 * (len(self.waiting) + len(self.running)) + 64:  # amortised O(1) per request
            self.held = {k: s for k, s in self.held.items() if not s.future.done()}
        self.held[rid] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request.request_id == request_id and not seq.future.done():  # done: cancelled, its id free
                self.waiting.remove(seq)
                seq.finish = "abort"
                self._resolve(seq)
                return True
        for seq in self.running:
            # A second abort stops nothing (False, as for a finished request and in the vllm engine).
            if (
                seq.request.request_id == request_id
                and seq.finish is None
                and not seq.aborted
                and not seq.future.done()
            ):
                seq.aborted = True  # leaves at the next step boundary with what it generated so far
                return True
        return False

    def retire(self) -> None:
        """Between steps: resolve and drop the finished and aborted rows now (their KV freed), as a step would."""
        self._retire()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_bytes(self) -> int:
        if self.cache is None:
            return self.prefixes.bytes
        return self.prefixes.bytes + sum(
            t.numel() * t.element_size()
            for layer in self.cache.layers
            for t in (getattr(layer, "_k", layer.keys), getattr(layer, "_v", layer.values))
            if t is not None
        )

    def release(self) -> None:
        """Drop the KV cache (only when nothing runs)."""
        if self.running:
            raise RuntimeError("cannot release the KV cache while requests run")
        self.cache, self.attn = None, None
        self.prefixes.clear()

    # ---- one scheduling step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Retire aborted rows, admit waiting requests, then decode one token for every running row."""
        self._retire()
        self._admit()
        self._retire()  # a first token may already end a response
        if not self.running:
            return
        last = torch.tensor([s.tokens[-1] for s in self.running], dtype=torch.long, device=self.device)
        pos = torch.tensor([s.prompt_len + len(s.tokens) - 1 + s.rope_delta for s in self.running], device=self.device)
        ones = torch.ones((len(self.running), 1), dtype=self.attn.dtype, device=self.device)
        self.attn = torch.cat([self.attn, ones], dim=1)
        out = self.model(
            input_ids=last[:, None],
            attention_mask=self.attn,
            position_ids=self.vision.decode_positions(pos) if self.vision is not None else pos[:, None],
            use_cache=True,
            **{self.cache_arg: self.cache},  # updated in place
        )
        if self.routing is not None:
            self.routing.decode(self.running)
        self._sample(self.running, out.logits[:, -1])
        self._retire()

    def _sample(self, seqs: list[Running], logits: Tensor) -> None:
        params = [s.request.params for s in seqs]
        # Greedy rows (`greedy`: temperature below GREEDY_TEMPERATURE) go in as temperature 0 and report
        # log_softmax(logits) whatever top-k/top-p they carry (the protocol; vLLM does the same).
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
        temp = torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=logits.device)
        top_k = [0 if p.greedy else p.top_k for p in params]
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        logp = processed_logprobs(logits, temp, top_k, top_p)
        tokens = sample_rows(logp, greedy, [s.generator for s in seqs])
        chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
        for seq, tok, lp in zip(seqs, tokens.tolist(), chosen):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            p = seq.request.params
            if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:  # ignore_eos: EOS only
                seq.finish = "stop"
            elif seq.stop and seq.stop.hit(seq.tokens):
                seq.finish = "stop"
            elif len(seq.tokens) >= seq.max_new or seq.prompt_len + len(seq.tokens) >= self.max_context:
                seq.finish = "length"

    # ---- admission ----------------------------------------------------------------------------------------
    def _admit(self) -> None:
        if not self.waiting or (self.running and not self.mergeable):
            return
        room = self.max_num_seqs - len(self.running)
        new: list[Running] = []
        while self.waiting and len(new) < room:
            seq = self.waiting.popleft()
            if seq.future.cancelled():  # its caller gave up waiting: nothing to compute
                continue
            if not seq.prompt_len:  # its row would attend to nothing (or an all-empty prefill fail the batch)
                settle(seq.future, exc=ValueError(f"request {seq.request.request_id!r}: empty prompt"))
                continue
            if seq.prompt_len >= self.max_context:
                seq.finish = "prompt_too_long"
                self._resolve(seq)
                continue
            new.append(seq)
        if not new:
            return
        for seq in new:
            seq.kv_version = self.version()
        try:
            for seqs, cache, attn, logits in self._prefill(new):
                if self.running and not self.mergeable:  # static batching: a retry's later parts wait their turn
                    self.waiting.extendleft(reversed(seqs))
                    continue
                self._sample(seqs, logits)
                self._merge(seqs, cache, attn)
        except BaseException as exc:  # the new requests are in neither queue yet: fail them here, never drop them
            for seq in new:
                settle(seq.future, exc=exc)
            raise

    def _prefill(self, new: list[Running]) -> list[Prefilled]:
        """The forwards of the admitted requests' prompts (prefix-cache hits one by one, the rest together), each
        part ready to sample and merge. A forward that raises fails only its own requests (`_fail_prefill`)."""
        parts: list[Prefilled] = []
        if self.prefixes.entries and self.mergeable:
            misses = []
            for seq in new:
                hit = self.prefixes.take(seq.request.prompt_ids, mm_key(seq.request))
                if hit is None:
                    misses.append(seq)
                    continue
                try:
                    parts.append(self._prefill_from(seq, *hit))
                except Exception as exc:
                    self._fail_prefill([seq], exc)
            new = misses
            if not new:
                return parts
        # Equal prompts (the n samples of a group) are prefilled once; pictures are part of the prompt.
        groups: dict[tuple[tuple[int, ...], tuple[str, ...]], list[Running]] = {}
        for s in new:
            groups.setdefault((tuple(s.request.prompt_ids), mm_key(s.request)), []).append(s)
        return parts + self._prefill_groups(list(groups.values()))

    def _prefill_groups(self, groups: list[list[Running]]) -> list[Prefilled]:
        """One forward over the prompts of `groups` (each: requests with one prompt). Only when it raises are the
        groups split in halves and retried, down to the group(s) that fail alone: one bad prompt costs about
        2*log2(len(groups)) extra forwards, and a batch that succeeds costs nothing more."""
        try:
            return [self._prefill_batch(groups)]
        except Exception as exc:
            if len(groups) == 1:
                self._fail_prefill(groups[0], exc)
                return []
            log.warning(
                "a prefill of %d prompts failed (%r): retrying it in halves to fail only its cause", len(groups), exc
            )
        half = len(groups) // 2
        return self._prefill_groups(groups[:half]) + self._prefill_groups(groups[half:])

    def _fail_prefill(self, seqs: list[Running], exc: Exception) -> None:
        """Fail requests whose prompt's forward raised alone (its cause is theirs, not their batch's)."""
        for seq in seqs:
            rid = seq.request.request_id
            log.warning("request %r failed at its prefill (%r); the rest of its batch goes on", rid, exc)
            detail = f"its prefill failed ({type(exc).__name__}: {exc})"
            err = PrefillError(rid, f"request {rid!r}: {detail}", detail)
            err.__cause__ = exc
            settle(seq.future, exc=err)

    def _prefill_batch(self, groups: list[list[Running]]) -> Prefilled:
        """The forward of one left-padded batch of distinct prompts; each request gets its prompt's cache row."""
        new = [s for g in groups for s in g]
        prompts = [g[0].request.prompt_ids for g in groups]
        p = max(len(x) for x in prompts)
        ids = torch.full((len(prompts), p), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), p), dtype=torch.long)
        for i, x in enumerate(prompts):
            ids[i, p - len(x) :] = torch.tensor(x, dtype=torch.long)
            attn[i, p - len(x) :] = 1
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if plain_layers(cache):
            cache.layers = [GrowingLayer() for _ in cache.layers]
        if self.vision is not None:  # the prompts' pictures and explicit (3D for mrope) positions
            extra, deltas = self.vision.prefill(ids, attn, [pictures(g[0].request) for g in groups], self.device)
        else:
            extra, deltas = {"position_ids": (attn.cumsum(1) - 1).clamp_min(0).to(self.device)}, [0] * len(prompts)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **extra,
            **{self.cache_arg: cache},  # filled in place
        )
        keys = [k for k, g in enumerate(groups) for _ in g]
        if self.routing is not None:
            self.routing.prefill(new, keys, attn)
        for s, k in zip(new, keys):
            s.rope_delta = deltas[k]
        rows = torch.tensor(keys, dtype=torch.long)
        if len(prompts) != len(new):
            cache.batch_select_indices(rows.to(self.device))
        return new, cache, attn[rows].to(self.device), out.logits[:, -1][rows.to(self.device)]

    def _prefill_from(
        self, seq: Running, cached: int, kv: list[tuple[Tensor, Tensor]], cached_pictures: int
    ) -> Prefilled:
        """The forward of only the tokens after a reused prefix of `cached` tokens (holding the prompt's first
        `cached_pictures` pictures)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache.layers = [GrowingLayer() for _ in cache.layers]
        for layer, (k, v) in zip(cache.layers, kv):
            layer.load(k, v)
        suffix = torch.tensor([seq.request.prompt_ids[cached:]], dtype=torch.long, device=self.device)
        n = cached + suffix.shape[1]
        attn = torch.ones((1, n), dtype=torch.long, device=self.device)
        if self.vision is not None:
            extra, seq.rope_delta = self.vision.suffix(seq.request, cached, cached_pictures, self.device)
        else:
            extra = {"position_ids": torch.arange(cached, n, device=self.device)[None]}
        out = self.model(
            input_ids=suffix,
            attention_mask=attn,
            **extra,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: cache},
        )
        return [seq], cache, attn, out.logits[:, -1]

    def _merge(self, new: list[Running], cache: object, attn: Tensor) -> None:
        growing = all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        if not self.running:
            self.cache, self.attn, self.running = cache, attn, list(new)
            if not growing and self.mergeable:
                self.mergeable = False
                log.info("model cache has non-plain layers: requests join only an empty batch (static batching)")
            return
        width = max(self.attn.shape[1], attn.shape[1])
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            old_layer.append_rows(new_layer, width)

        def lpad(t: Tensor) -> Tensor:
            extra = width - t.shape[1]
            return t if not extra else torch.cat([t.new_zeros((t.shape[0], extra)), t], dim=1)

        self.attn = torch.cat([lpad(self.attn), lpad(attn)], dim=0)
        self.running += new

    # ---- retirement ---------------------------------------------------------------------------------------
    def _retire(self) -> None:
        for s in self.running:
            # A cancelled future is an abort: its row stops generating for no one and frees its KV.
            if (s.aborted or s.future.cancelled()) and s.finish is None:
                s.finish = "abort"
        done = [i for i, s in enumerate(self.running) if s.finish is not None]
        if not done:
            return
        for i in done:
            self._keep_prefix(i, self.running[i])
            self._resolve(self.running[i])
        keep = [i for i, s in enumerate(self.running) if s.finish is None]
        self.running = [self.running[i] for i in keep]
        if not self.running:
            self.cache, self.attn = None, None
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.attn = self.attn[idx]
        if not self.mergeable:  # a static batch of non-plain layers: transformers' own row selection
            self.cache.batch_select_indices(idx)
            return
        used = self.attn.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        for layer in self.cache.layers:
            layer.select_rows(idx)
            if first > 0:  # columns only finished rows used
                layer.trim_front(first)
        self.attn = self.attn[:, first:]

    def _keep_prefix(self, i: int, seq: Running) -> None:
        """Store a finished row's KV (prompt + all but its last token: the last was never fed back) for reuse, unless
        the weights changed while it ran (its KV is partly the old weights'; the store was cleared at the update)."""
        if not self.prefixes.budget or not self.mergeable or seq.finish not in ("stop", "length") or not seq.tokens:
            return
        if seq.kv_version != self.version():
            return
        ids = (*seq.request.prompt_ids, *seq.tokens[:-1])
        if self.vision is not None and self.vision.image_token_id in ids[seq.prompt_len :]:
            return  # a generated placeholder has no picture behind it: the key would not say what the KV holds
        self.prefixes.put(ids, [layer.row(i, len(ids)) for layer in self.cache.layers], mm_key(seq.request))

    def _resolve(self, seq: Running) -> None:
        out = RequestOutput(
            request_id=seq.request.request_id,
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=list(seq.tokens),
            logprobs=list(seq.logprobs),
            finish_reason=seq.finish or "abort",
            # the oldest weights its tokens came from: those it was admitted under (a request aborted while the
            # engine was paused resolves after the update, but sampled nothing under it)
            weight_version=seq.kv_version if seq.kv_version >= 0 else self.version(),
            routed_experts=self.routing.result(seq) if self.routing is not None else None,
        )
        settle(seq.future, out)

    def fail_all(self, exc: BaseException) -> None:
        """Resolve every queued and running request with `exc` (the engine is broken)."""
        for seq in [*self.waiting, *self.running]:
            settle(seq.future, exc=exc)
        self.waiting.clear()
        self.running = []
        self.cache, self.attn = None, None
