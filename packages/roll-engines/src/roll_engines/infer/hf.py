"""The `hf` inference engine: batched sampling with transformers' `generate` (KV cache) on any device.

Contract: `generate(prompts, n, ...)` takes token-id lists (no padding), samples `n` continuations of each, and
returns right-padded response ids, the per-token log-probs of the sampled tokens and a response mask. Rows come
back grouped: the n samples of prompt k are rows [k*n, (k+1)*n). Log-probs are those of the tempered model
distribution log softmax(logits / temperature) (what the trainer recomputes), not of the top-p/top-k-truncated
one. A response ends at the first EOS (kept, mask 1) or a stop string (kept), or at `max_new_tokens`
(`truncated` is then 1).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from roll_core.models import default_num_threads, resolve_model_path, torch_dtype


@dataclass
class Generation:
    """Output of one `generate` call; tensors are (B*n, R) on CPU."""

    responses: Tensor
    logprobs: Tensor
    response_mask: Tensor
    truncated: Tensor  # (B*n,) 1 where the response hit max_new_tokens without EOS/stop
    seconds: float

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


class HFInferEngine:
    """Sampling engine over a transformers model; weights are replaced in place by `load_weights`."""

    def __init__(
        self,
        model_path: str,
        *,
        name: str = "hf",
        dtype: str = "float32",
        device: str = "cpu",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_new_tokens: int = 128,
        stop: Sequence[str] | None = None,
        batch_size: int = 64,
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        world_size: int = 1,
        num_threads: int | None = None,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if temperature <= 0:
            raise ValueError("temperature must be > 0 (sampling); use a small value like 1e-3 for near-greedy")
        # Ray sets OMP_NUM_THREADS=1 in workers with fractional CPUs; torch threads are set explicitly instead.
        torch.set_num_threads(num_threads or default_num_threads())
        self.name, self.device = name, torch.device(device)
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.max_new_tokens, self.stop, self.batch_size = max_new_tokens, list(stop or []), batch_size
        self.path = resolve_model_path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.path,
            dtype=torch_dtype(dtype),
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        eos = self.model.generation_config.eos_token_id or self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.seed = seed

    # ---- sampling -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        seed: int | None = None,
    ) -> Generation:
        """Sample `n` responses per prompt; see the module docstring for the layout."""
        t0 = time.perf_counter()
        temperature = temperature or self.temperature
        max_new = max_new_tokens or self.max_new_tokens
        if seed is not None:
            self.generator.manual_seed(seed)
        rows = [list(p) for p in prompts for _ in range(n)]
        chunks = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        outs = [self._generate_chunk(c, temperature, max_new) for c in chunks]
        r = max(o[0].shape[1] for o in outs)
        resp = torch.cat([torch.nn.functional.pad(o[0], (0, r - o[0].shape[1]), value=self.pad_id) for o in outs])
        logp = torch.cat([torch.nn.functional.pad(o[1], (0, r - o[1].shape[1])) for o in outs])
        mask = torch.cat([torch.nn.functional.pad(o[2], (0, r - o[2].shape[1])) for o in outs])
        trunc = torch.cat([o[3] for o in outs])
        return Generation(resp, logp, mask, trunc, time.perf_counter() - t0)

    def _generate_chunk(
        self, rows: list[list[int]], temperature: float, max_new: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        p = max(len(x) for x in rows)
        ids = torch.full((len(rows), p), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), p), dtype=torch.long)
        for i, x in enumerate(rows):  # left padding: generation continues from the right edge
            ids[i, p - len(x) :] = torch.tensor(x)
            attn[i, p - len(x) :] = 1
        # transformers samples with torch's global RNG: fork it so engine sampling is reproducible per seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.generator)))
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=attn.to(self.device),
                do_sample=True,
                temperature=temperature,
                top_p=self.top_p,
                top_k=self.top_k or None,
                max_new_tokens=max_new,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
                stop_strings=self.stop or None,
                tokenizer=self.tokenizer if self.stop else None,
                return_dict_in_generate=True,
                output_logits=True,
            )
        resp = out.sequences[:, p:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()[:, : resp.shape[1]]  # (b, R, V) raw
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        mask, finished = self._response_mask(resp)
        resp = torch.where(mask.bool(), resp, self.pad_id)
        return resp, logp * mask, mask, (~finished).long()

    def _response_mask(self, resp: Tensor) -> tuple[Tensor, Tensor]:
        """(mask, finished) per row: valid tokens run up to and including the first EOS or the token that
        completes a stop string; a row with neither is unfinished (cut by max_new_tokens) and all valid.
        Tokens generate() appended after a row finished are padding and masked out."""
        mask = torch.ones_like(resp)
        finished = torch.zeros(resp.shape[0], dtype=torch.bool)
        for i in range(resp.shape[0]):
            row = resp[i].tolist()
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            if end is None and self.stop:
                end = self._stop_position(row)
            if end is not None:
                mask[i, end + 1 :] = 0
                finished[i] = True
        return mask, finished

    def _stop_position(self, row: list[int]) -> int | None:
        """Index of the token that completes the first stop string, or None."""
        for j in range(len(row)):
            text = self.tokenizer.decode(row[: j + 1])
            if any(text.endswith(s) for s in self.stop):
                return j
        return None

    # ---- weights ------------------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, Tensor]) -> int:
        """Copy new weights in place (names as in the trainer's state dict); returns bytes received."""
        own = self.model.state_dict()
        nbytes = 0
        with torch.no_grad():
            for k, v in weights.items():
                if k not in own:
                    raise KeyError(f"weight {k!r} is not in the inference model {type(self.model).__name__}")
                own[k].copy_(v)
                nbytes += v.numel() * v.element_size()
        return nbytes
