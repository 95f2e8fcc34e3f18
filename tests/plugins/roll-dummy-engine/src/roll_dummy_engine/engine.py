"""The recompute engine itself (`infer_engine=recompute`): torch and transformers live here, not in the package's
`__init__`, which `roll.configs` imports to compose any config (`roll-train --help` included)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import ClassVar

import torch
from torch import Tensor

from roll_core.interfaces import GenerateOutput, Request, RequestOutput, SamplingParams


class RecomputeInferEngine:
    """Implements roll_core.interfaces.InferEngine without a KV cache or continuous batching."""

    continuous_batching: ClassVar[bool] = False

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "recompute",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        max_new_tokens: int = 64,
        seed: int = 0,
        dtype: str = "float32",
        device: str = "cpu",
        # Every key roll passes, named (an engine constructor must not swallow unknown keys): batching and
        # context limits it does not have, and transformers loading options it does not need.
        max_num_seqs: int = 1,
        max_model_len: int | None = None,
        attn_implementation: str = "eager",
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from roll_core.models import resolve_model_path

        path = resolve_model_path(model_path)
        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = torch.device(device)
        # The generation config's EOS ids and the tokenizer's, as the hf engine and vLLM stop on both.
        eos = self.model.generation_config.eos_token_id
        eos = [*(eos if isinstance(eos, list) else [eos]), self.tokenizer.eos_token_id]
        self.eos = {int(e) for e in eos if e is not None}
        self.defaults = SamplingParams(temperature, top_p, top_k, max_new_tokens, tuple(stop))
        self._seeds = torch.Generator().manual_seed(seed)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # held while a request decodes or weights change
        self._aborted: set[str] = set()
        self._active: set[str] = set()
        self._version = 0
        self._shapes: dict[str, torch.Size] | None = None  # set while weights are discarded
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def max_context_length(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)

    def check_sampling(self, params: SamplingParams) -> None:
        """Everything in SamplingParams is supported."""

    # ---- decoding -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def _decode(self, req: Request) -> RequestOutput:
        p = req.params
        if len(req.prompt_ids) >= self.max_context_length:
            return RequestOutput(req.request_id, req.prompt_ids, [], [], "prompt_too_long", self._version)
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        gen = torch.Generator().manual_seed(seed)
        ids, tokens, logps, reason = list(req.prompt_ids), [], [], "length"
        # Stop strings are matched on the response as it reads after the prompt (a few of its tokens decoded as
        # context, then cut off), as the hf engine and vLLM match: decoded alone, a SentencePiece response loses
        # the leading space of its first word (" Human:" read "Human:"), and a stop string " Human:" never matched.
        context = list(req.prompt_ids[-4:])
        head = self.tokenizer.decode(context)

        def after_prompt(toks: list[int]) -> str:
            text = self.tokenizer.decode(context + toks)
            return text[len(head) :] if text.startswith(head) else self.tokenizer.decode(toks)

        while len(tokens) < p.max_new_tokens and len(ids) < self.max_context_length:
            if req.request_id in self._aborted:
                reason = "abort"
                break
            logits = self.model(torch.tensor([ids], device=self.device)).logits[0, -1].float().cpu()
            # Greedy (below GREEDY_TEMPERATURE, 0 included) reports the full distribution (the protocol): no
            # truncation, no division by a near-zero temperature.
            x = logits if p.greedy else logits / p.temperature
            if p.top_k and not p.greedy:
                x = x.masked_fill(x < torch.topk(x, min(p.top_k, x.numel())).values[-1], float("-inf"))
            if p.top_p < 1 and not p.greedy:
                sx, order = torch.sort(x, descending=True)
                pr = torch.softmax(sx, -1)
                x[order[(pr.cumsum(-1) - pr) >= p.top_p]] = float("-inf")
            lp = torch.log_softmax(x, -1)
            tok = int(lp.argmax()) if p.greedy else int(torch.multinomial(lp.exp(), 1, generator=gen))
            tokens.append(tok)
            logps.append(float(lp[tok]))
            ids.append(tok)
            text = after_prompt(tokens) if p.stop else ""
            if (
                (not p.ignore_eos and tok in self.eos)
                or tok in p.stop_token_ids
                or any(s in text and s not in after_prompt(tokens[:-1]) for s in p.stop)
            ):
                reason = "stop"
                break
        else:
            reason = "length"
        return RequestOutput(req.request_id, list(req.prompt_ids), tokens, logps, reason, self._version)

    def _serve(self) -> None:
        while True:
            req, fut = self._queue.get()
            with self._lock:
                try:
                    out = self._decode(req)
                except Exception as exc:  # a failed request fails its future, not the server
                    fut.set_exception(exc)
                    continue
                finally:  # the id is free again (an abort of it ended with it)
                    self._active.discard(req.request_id)
                    self._aborted.discard(req.request_id)
            fut.set_result(out)

    def submit(self, request: Request) -> Future[RequestOutput]:
        if request.request_id in self._active:  # abort names requests by id: it could reach only one of two
            raise ValueError(f"{self.name}: request id {request.request_id!r} is already running")
        fut: Future[RequestOutput] = Future()
        self._active.add(request.request_id)
        self._queue.put((request, fut))
        return fut

    def abort(self, request_id: str) -> bool:
        if request_id not in self._active:
            return False
        self._aborted.add(request_id)
        return True

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None, n: int = 1, first_row: int = 0
    ) -> GenerateOutput:
        t0 = time.perf_counter()
        params = params or self.defaults
        futures = []
        for k, prompt in enumerate(prompts):
            for j in range(n):
                seed = None if params.seed is None else params.seed * 7919 + first_row + k * n + j
                futures.append(
                    self.submit(
                        Request(f"batch-{time.monotonic_ns()}-{k}-{j}", list(prompt), params.replace(seed=seed))
                    )
                )
        outs = [f.result() for f in futures]
        return GenerateOutput.from_requests(outs, self.pad_id, time.perf_counter() - t0)

    # ---- weights and memory -------------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        self._lock.acquire()

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        own, n = self.model.state_dict(), 0
        with torch.no_grad():
            for name, t in named_tensors:
                own[name].copy_(t)
                n += t.numel() * t.element_size()
        return n

    def finish_weight_update(self) -> int:
        self._version += 1
        self._lock.release()
        return self._version

    def sleep(self, level: int = 1) -> None:
        """Level 2 drops the weights (nothing else is held between requests)."""
        if level == 2:
            with self._lock:
                self._shapes = {k: p.shape for k, p in self.model.named_parameters()}
                for p in self.model.parameters():
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)

    def wake_up(self) -> None:
        if self._shapes is not None:
            with self._lock:
                for k, p in self.model.named_parameters():
                    p.data = torch.empty(self._shapes[k], dtype=p.dtype, device=self.device)
            self._shapes = None

    def memory_bytes(self) -> dict[str, int]:
        return {"weights": sum(p.numel() * p.element_size() for p in self.model.parameters()), "kv_cache": 0}

    def shutdown(self) -> None:
        """Nothing to stop: the daemon thread dies with the process."""
