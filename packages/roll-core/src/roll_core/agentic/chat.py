"""Token-in-token-out chat: the token ids a conversation adds per turn, without ever re-tokenising earlier turns.

Re-tokenising a decoded conversation does not give back the ids the model produced (BPE is not a bijection), and the
trainer's log-probs would then be those of other tokens. A trajectory is therefore built by appending: the initial
prompt's ids, each generated response's ids exactly as sampled, and for each observation the ids of only the new
text the chat template adds: the end of the assistant turn the model did not generate itself (for ChatML, the
newline after `<|im_end|>`), the user turn holding the observation, and the next assistant header.

The new text is found by rendering the template twice with placeholder contents and taking the difference, so any
template works, including ones that insert a default system prompt at the start (SmolLM2, Qwen).
"""

from __future__ import annotations

from typing import Any

_ASSISTANT = "\u2063ROLL-ASSISTANT\u2063"
_USER = "\u2063ROLL-USER\u2063"


class TurnTemplate:
    """Token ids of the initial prompt and of each observation turn for one tokenizer and chat template."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, examples: list[dict[str, str]] | None = None):
        self.tokenizer = tokenizer
        self.prefix: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.prefix += list(examples or [])
        base = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _ASSISTANT}], False)
        full = self._render(
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": _ASSISTANT},
                {"role": "user", "content": _USER},
            ],
            True,
        )
        if not full.startswith(base) or _ASSISTANT not in base:
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation")
        # After the assistant's content: what closes the turn (e.g. "<|im_end|>\n"); then the next user turn.
        self.closing = base[base.index(_ASSISTANT) + len(_ASSISTANT) :]
        self.user_turn = full[len(base) :]
        if _USER not in self.user_turn:
            raise ValueError("the chat template drops user turns after the first assistant turn")
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.prefix + messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def initial(self, observation: str) -> list[int]:
        """Ids of the conversation up to the first assistant turn (system prompt, examples, first observation)."""
        ids = self.tokenizer.apply_chat_template(
            [*self.prefix, {"role": "user", "content": observation}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def observation(self, observation: str, response_ids: list[int]) -> list[int]:
        """Ids appended after a response: the rest of its turn's closing, then the observation's user turn and
        the next assistant header. A response cut off before its end-of-turn token gets the whole closing."""
        closing = self.closing
        if response_ids and response_ids[-1] in self.eos_ids and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]
        return self.encode(closing + self.user_turn.replace(_USER, observation))
