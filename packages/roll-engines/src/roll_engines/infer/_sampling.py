"""Sampling primitives shared by roll's own decode loops: processed log-probs, seeded per-row sampling, stop strings.

Contract (roll_core.interfaces.inference): a token's reported log-prob is taken from the distribution that sampled it,
`log_softmax(logits / T)` with top-k / top-p truncation applied (and renormalised); greedy rows (T below
`GREEDY_TEMPERATURE`, 0 included) report `log_softmax(logits)`. Nothing else touches the logits: no repetition
penalty, no `generation_config.json` processors, so the trainer's recomputation `log_softmax(logits / T)` equals the
reported value when top_k=0 and top_p=1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from roll_core.interfaces.inference import GREEDY_TEMPERATURE


def processed_logprobs(logits: Tensor, temperature: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> Tensor:
    """Log-probs of the sampling distribution of each row.

    Args:
        logits: (B, V) raw next-token logits.
        temperature: (B,) temperatures; rows below GREEDY_TEMPERATURE (0 included) are greedy and use temperature 1
            here (a tinier divisor overflows fp32 logits: inf, then NaN log-probs).
        top_k: B values, 0 disables.
        top_p: B values, 1 disables.

    Returns:
        (B, V) float32 log-probs, -inf outside the truncated support.
    """
    t = temperature.to(torch.float32)
    t = torch.where(t >= GREEDY_TEMPERATURE, t, torch.ones_like(t))
    x = logits.float() / t[:, None]
    v = x.shape[-1]
    for k, p in sorted(set(zip(top_k, top_p))):
        if (k == 0 or k >= v) and p >= 1.0:
            continue
        rows = torch.tensor([i for i, kp in enumerate(zip(top_k, top_p)) if kp == (k, p)], dtype=torch.long)
        sub = x[rows]
        if 0 < k < v:
            kth = torch.topk(sub, k, dim=-1).values[:, -1:]
            sub = sub.masked_fill(sub < kth, float("-inf"))
        if p < 1.0:
            sorted_x, order = torch.sort(sub, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token when the mass strictly before it already reaches p (the top token always stays).
            drop_sorted = (probs.cumsum(-1) - probs) >= p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            sub = sub.masked_fill(drop, float("-inf"))
        x[rows] = sub
    return torch.log_softmax(x, dim=-1)


def sample_rows(logp: Tensor, greedy: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row: argmax for greedy rows, else a draw from exp(logp) with that row's generator.

    Sampling is by inverse CDF: one uniform number per row from the row's own generator, located in the row's
    cumulative distribution (`inverse_cdf`: cumulated in float64, so rounding cannot move a draw across a token of
    non-negligible mass). One draw per row costs far less than `torch.multinomial`'s pass of exponential noise over the
    vocabulary.

    Args:
        logp: (B, V) processed log-probs.
        greedy: (B,) bool.
        generators: B CPU generators (each row's own stream: results do not depend on which rows share a batch).

    Returns:
        (B,) long token ids.
    """
    rows = [i for i in range(len(generators)) if not bool(greedy[i])]
    every = bool(rows) and len(rows) == len(generators)  # no greedy row: no argmax pass over the vocabulary
    out = None if every else logp.argmax(-1)
    if not rows:
        return out
    idx = None if every else torch.tensor(rows, dtype=torch.long, device=logp.device)
    u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in rows]).to(logp.device)
    drawn = inverse_cdf((logp if every else logp[idx]).float().exp(), u)
    if every:
        return drawn
    out[idx] = drawn
    return out


def inverse_cdf(probs: Tensor, u: Tensor, block: int = 256) -> Tensor:
    """The token at fraction u of each row's mass: the first i with cumsum(probs)[i] > u * sum(probs).

    Two levels, both cumulated in float64: the block that holds the draw (cumulative sums of `block`-token block
    sums), then the token inside that one block. Same draw as one float64 cumsum over the whole vocabulary except
    within ~6e-8 of a block's mass from a block boundary (its float32 sum's rounding), but the float64 pass covers
    V / block values instead of V (at 32 rows of a 49152-token vocabulary the one-level pass was ~10 % of a
    profiled decode step; measured paired, this draw makes decode 1.02x faster). Public for its tests.

    Args:
        probs: (R, V) float32 unnormalised probabilities, >= 0 (zeros are never drawn).
        u: (R,) float64 uniforms in [0, 1).
        block: tokens per block.

    Returns:
        (R,) long token ids, always of positive mass.
    """
    r, v = probs.shape
    nb = -(-v // block)
    if nb * block != v:  # zero mass past the vocabulary, never drawn
        probs = torch.nn.functional.pad(probs, (0, nb * block - v))
    blocks = probs.reshape(r, nb, block)
    # Block sums in float32 (a cast of the whole (R, V) to float64 would cost as much as the old pass), each
    # within ~6e-8 of its block's mass; cumulated in float64.
    csum = blocks.sum(-1).double().cumsum(-1)  # (R, nb)
    total = csum[:, -1:]
    target = u[:, None] * total  # (R, 1)
    # A draw at the very top lands past the last block (and token): clamp to the last one with mass.
    b = torch.minimum(torch.searchsorted(csum, target, right=True), (csum < total).sum(-1, keepdim=True))
    before = torch.where(b > 0, csum.gather(-1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    chosen = blocks[torch.arange(r, device=probs.device), b[:, 0]]  # (R, block)
    inner = before + chosen.double().cumsum(-1)
    # The block's float32 sum may exceed its exact (float64) in-block total: a target in that sliver lands on the
    # block's last token of positive mass rather than past it.
    idx = torch.arange(block, device=probs.device)
    last = torch.where(chosen > 0, idx, torch.zeros_like(idx)).amax(-1, keepdim=True)
    j = torch.minimum(torch.searchsorted(inner, target, right=True), last)
    return (b * block + j)[:, 0]


def stop_window(stops: Sequence[str]) -> int:
    """Response tokens decoded to look for `stops`: enough to hold the longest one, counted in UTF-8 bytes.

    A token that is not special decodes to at least one byte, not one character: a byte-level or byte-fallback
    tokenizer spells a character it has no token for with up to 4 byte tokens, so a stop string of L characters
    may span 4L tokens (three emoji such a vocabulary lacks are 12 byte tokens: a window of L + 8 = 11 tokens never
    held them whole and the stop string was never matched). 8 more are a margin (special tokens, merges).
    """
    return max((len(s.encode("utf-8")) for s in stops if s), default=0) + 8


# Tokens decoded before the window as context, then cut off the text: a SentencePiece decoder (Llama 2, Mistral,
# Gemma) drops the leading space of the first token of a string ("\u2581Human" alone is "Human"), so the window
# must not start the string. vLLM decodes from the prompt on (a DecodeStream primed with the prompt's ids; the slow
# path keeps 5 prompt tokens): its response text has that space, and " Human:" stops at the first response token.
_CONTEXT = 4


class StopStrings:
    """Finds the token that completes a stop string in a growing response, even when the token overhangs it.

    Matched on the response's text as it reads after the prompt, as vLLM matches: the window is decoded behind a
    few tokens of context (the prompt's last tokens while the response is short), which are then cut off, so a
    stop string that lies in the prompt never matches. Special tokens stay in the text, as in roll's vLLM and
    SGLang engines (both pass skip_special_tokens=False, vLLM's default being True: a stop string "<|im_start|>"
    could not match).

    Only the tail of the response is decoded per token (`window` tokens, by default enough to hold the longest stop
    string: `stop_window`), so the cost per token does not grow with the response length.
    """

    def __init__(
        self, tokenizer: object, stops: Sequence[str], window: int | None = None, prompt: Sequence[int] = ()
    ) -> None:
        """`prompt`: the request's prompt ids (only its last few tokens are kept, as decoding context)."""
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.window = window or stop_window(self.stops)
        self.prompt_tail = list(prompt)[-_CONTEXT:]

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, tokens: Sequence[int]) -> bool:
        """True when the last token completes (or passes through the end of) a stop string."""
        if not self.stops or not tokens:
            return False
        seq = self.prompt_tail + list(tokens[-(self.window + _CONTEXT) :])
        n = min(len(tokens), self.window)
        context, tail = seq[:-n][-_CONTEXT:], seq[-n:]
        head = self.tokenizer.decode(context) if context else ""
        text = self._after(head, context, tail)
        before = self._after(head, context, tail[:-1]) if n > 1 else ""
        # The string must end inside the new token's characters: it was not complete before this token.
        return any(s in text and s not in before for s in self.stops)

    def _after(self, head: str, context: list[int], tokens: list[int]) -> str:
        """The text of `tokens` as it reads after `context` (decoded: `head`)."""
        text = self.tokenizer.decode(context + tokens)
        if not context or text.startswith(head):
            return text[len(head) :]
        # Cut where the two part: a context ending inside a character (byte tokens) decodes to U+FFFD there,
        # which the whole text spells as the character.
        return text[next((i for i, (a, b) in enumerate(zip(head, text)) if a != b), len(text)) :]
