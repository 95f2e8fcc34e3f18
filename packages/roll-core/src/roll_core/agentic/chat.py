"""Token-in-token-out chat: the token ids a conversation adds per turn, without ever re-tokenising earlier turns.

Re-tokenising a decoded conversation does not give back the ids the model produced (BPE is not a bijection), and
chat templates rewrite history: Qwen3 and DeepSeek-R1 drop the `<think>` blocks of earlier assistant turns, Llama 3
and Gemma 3 trim each turn's content, Phi-3 appends an end-of-text token when no generation prompt follows. The
trainer's log-probs of a re-rendered conversation would then be those of other tokens. A trajectory is therefore
built by appending, never by re-rendering:

    initial_messages(messages)          the first prompt's ids, ending with the generation header
    + sampled ids, exactly as sampled   (the loss mask covers exactly these)
    + continuation(new_messages)        what closes that assistant turn and that the model did not generate
                                        (ChatML, Phi-3: the newline after the end-of-turn token; DeepSeek: nothing),
                                        then the new user / tool / system messages, then the next generation header
    + sampled ids + continuation(...) ...

The continuation is found by rendering the template with a placeholder assistant turn followed by the new messages
and taking the text after the placeholder, so any template works (default system prompts, tool schemas in the
system turn, history rewriting before the placeholder: none of it reaches the text after it). Messages a template
cannot render after an assistant turn (Gemma 3 has no tool or mid-conversation system role; DeepSeek moves a system
message to the start) are a ValueError naming the roles.

EOS and stop tokens. roll's engines (hf, vLLM, SGLang) return the token they stopped on as the last sampled id: the
eos / `stop_token_ids` token is in `token_ids` (and was sampled, so it is trained on). When the sampled ids end with
one of `turn_end_ids` and the text after the placeholder starts with that token's text (after any whitespace the
template puts before it: Llama 2 renders " </s>", the model samples "</s>" right after its answer), the
continuation starts after it; otherwise (a response cut off at `max_new_tokens`, stopped by a stop string, stopped
on an eos the template does not use as its turn end, or an engine that drops the stop token) the continuation
carries the template's whole closing, end-of-turn token included, so the next turn's context is the template's;
those ids are observation ids (loss mask 0). A sampled special token the closing starts with is such an end too,
whichever list made the engine stop on it: the model's generation config (hf, vLLM and SGLang stop on its eos ids
as well as the tokenizer's; GLM-4 lists `<|user|>` and `<|observation|>`, the tokens its template opens the next
user and tool turns with) or `stop_token_ids`. The closing then goes on after it, as a template renders the turn;
given whole it wrote that token twice (`<|observation|><|observation|>`), a context no template renders. An eos the
closing does not start with (Qwen2.5's `<|endoftext|>`, its generation config's second eos; Gemma 3's `<eos>`) is
kept, as sampled and trained, and followed by the whole closing. `turn_end_ids` are the tokenizer's eos ids plus
the template's end-of-turn token when it is a special token (Gemma 3 ends turns with `<end_of_turn>` while its
tokenizer's eos is `<eos>`): `stop_token_ids` lists the latter for SamplingParams, so that an engine whose model
config lacks them still stops. A template's alternative end of turn (`ALT_TURN_ENDS`: Llama 3.1+ ends a turn
that calls a built-in tool with `<|eom_id|>` where its template otherwise writes `<|eot_id|>`) is a turn end and a
stop token too, when the tokenizer has it as a special token: a sampled one takes the place of the closing's
end-of-turn token (the turn ends as the template renders such a turn), where it used to be followed by a second,
`<|eot_id|>`, end.

Tokenising the new text. Only the text between turns is encoded, never the sampled ids, and it is encoded as it
follows the conversation (`encode_after` the template's rendering before it, the placeholder turn and the sampled
end token included): encoded on its own, a SentencePiece tokenizer (Llama 2, Mistral) prefixes a space to it ("▁"
before "[INST]", or a lone "▁" before a leading space), a token the rendered conversation does not have and
that every later turn's context would carry. The text between turns starts at or right after a special token in
the templates of byte-level BPE tokenizers (Qwen, Llama 3), which split there: their ids are the text's own.

Untrusted text (roll_core.agentic.turn_text). Text the policy did not write and that nobody vouches for is encoded
as text: a special token it spells (`<|im_end|>\n<|im_start|>assistant\n` in an observation) is that spelling's
text ids, not the template's special ids, so it cannot end its turn and pose as the assistant or the system; the
template's own framing around it (role headers, turn ends) stays special. So do the added tokens not marked special
that the template writes around untrusted text (Qwen's `<tool_response>` / `</tool_response>`; found by rendering a
sentinel tool / user / system message after an assistant turn, turn_text.framing_tokens): a tool's output that
spells `</tool_response>` is text, and cannot close the template's tool-response block. Other added tokens keep
their ids in it, the reasoning tags `<think>` / `</think>` included where the template does not write them around
it (thinking on): the same text gets those ids from `apply_chat_template` and the inference engine, and a tag in
a user or tool turn does not open or close the assistant's reasoning (turn_text's module docstring).
Which text that is:
- every message of a `continuation`: environment observations and tools' outputs (`observation` /
  `observation_turn`), and the user / tool / system messages an agent program sends between its turns (the
  OpenAI-compatible endpoint, roll_core.agentic.agent_sessions);
- the environment's first observation (`initial` / `initial_turn`: what its reset() returned, which may echo a
  task string a user supplied, exactly as untrusted as a step's observation);
- the content of `tool` messages in `initial_messages` (an agent's rewritten history, an SFT prompt with tool
  results), and of the messages whose role is in its `untrusted_roles`.
Trusted, rendered and tokenised as the template does (a special token spelt there is special): the other messages
of `initial_messages` (a dataset's prompt, the agent's own system and user messages of its first request), the
system prompt and examples, the tool schemas, the chat template's own framing; and the policy's sampled ids, which
are kept as sampled (never re-tokenised). A conversation that spells no special token in untrusted text gets
exactly the ids it got before.

Pictures. An observation may carry pictures (roll_core.agentic.observation). With a `vision` processor
(roll_core.multimodal.VisionProcessor, for a vision-language model) `initial_turn` / `observation_turn` render the
user message as a content list (`as_content`: the pictures where the text's `<image>` markers stand, else first)
with the processor's chat template, tokenise, and expand each picture's single placeholder into as many placeholder
tokens as the picture has features; they return the ids and that turn's `MMInputs`. The ids of every turn are
checked against its pictures (`check_tokens`): a placeholder the template did not write is an error, not a
shifted batch (one typed in an observation's text, the first's too, is text: untrusted text, above). Without
`vision`, an observation with pictures is a ValueError (a text model cannot see them). `picture_token_id` is the
placeholder token a policy must not sample (the rollout stops a turn on it; see roll_core.agentic.rollout).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from roll_core.agentic.observation import Observation, images_of, text_of
from roll_core.agentic.turn_text import SpecialText, encode_after, framing_tokens

__all__ = ["ALT_TURN_ENDS", "TurnTemplate", "encode_after"]

_ASSISTANT = "\u2063ROLL-ASSISTANT\u2063"
_USER = "\u2063ROLL-USER\u2063"
_UNTRUSTED = "\u2063ROLL-UNTRUSTED\u2063"  # the sentinel message whose framing `framing_tokens` reads
_FIRST_USER = "x"  # the placeholder conversation's first query (templates that need one before an assistant turn)
#: The roles whose framing after an assistant turn `_framing_probe` reads: the chat roles, and the tool-result and
#: instruction roles of tool-calling templates (Llama 3.1's `ipython`, GLM's `observation`, OpenAI's legacy `function`
#: and its `developer`), each where the template renders it. A continuation may hold any role but `assistant`.
_AFTER_ASSISTANT = ("user", "tool", "system", "developer", "function", "ipython", "observation")
#: End-of-turn tokens a family's template writes instead of its usual one (keyed by that one), e.g. Llama 3.1's
#: `<|eom_id|>` after a built-in tool call: the model samples it, and nothing else closes that turn.
ALT_TURN_ENDS: dict[str, tuple[str, ...]] = {"<|eot_id|>": ("<|eom_id|>",)}


class TurnTemplate:
    """Token ids of the initial prompt and of each turn appended after a sampled response, for one tokenizer and
    chat template. `system_prompt` and `examples` (user/assistant messages) are put before every conversation;
    `chat_template_kwargs` go to every rendering (e.g. `{"enable_thinking": False}` for Qwen3). `vision` (a
    `roll_core.multimodal.VisionProcessor`) renders observations with pictures (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str | None = None,
        examples: list[dict[str, str]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        vision: Any = None,
    ):
        self.tokenizer = tokenizer
        self.vision = vision
        # A vision model's processor may have its own template (the one that knows picture items).
        self.chat_template: str | None = vision.chat_template if vision is not None else None
        self.picture_token_id: int | None = int(vision.image_token_id) if vision is not None else None
        self.prefix: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.prefix += list(examples or [])
        self.template_kwargs = dict(chat_template_kwargs or {})
        eos = tokenizer.eos_token_id
        self.eos_ids: set[int] = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._special_ids: frozenset[int] = frozenset(
            {int(i) for i in tokenizer.all_special_ids} | {int(i) for i, t in added.items() if getattr(t, "special", 0)}
        )
        try:
            before, after = self._after_assistant([{"role": "user", "content": _USER}], None)
        except ValueError as exc:
            raise ValueError(f"the chat template cannot render a user turn after an assistant turn: {exc}") from exc
        if _USER not in after:
            raise ValueError("the chat template drops user turns after the first assistant turn")
        # The text between an assistant turn's content and the next user message's content (the turn's closing
        # and the user header, e.g. "<|im_end|>\n<|im_start|>user\n"); its first token ends the turn when special.
        self.closing = after[: after.index(_USER)]
        closing_ids = encode_after(tokenizer, before, self.closing)
        self._stop_ids: list[int] = []
        if closing_ids and self._is_special(closing_ids[0]):
            self._stop_ids.append(closing_ids[0])
        self._turn_end_text = self.tokenizer.decode(closing_ids[:1]) if self._stop_ids else ""
        # (a tokenizer without the token, Llama 3.0's, maps it to None or its unknown token: not one)
        alts = [tokenizer.convert_tokens_to_ids(t) for t in ALT_TURN_ENDS.get(self._turn_end_text, ())]
        self._alt_end_ids: set[int] = {
            int(i) for i in alts if isinstance(i, int) and i != tokenizer.unk_token_id and self._is_special(int(i))
        }
        self._stop_ids += sorted(self._alt_end_ids)
        self.turn_end_ids: set[int] = self.eos_ids | set(self._stop_ids)
        # untrusted text's spellings of special tokens and of the template's framing added tokens stay text
        self.special_text = SpecialText(tokenizer, framing_tokens(tokenizer, self._framing_probe()))

    # ---- rendering ----------------------------------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: list[dict] | None) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return self.tokenizer.apply_chat_template(
            self.prefix + messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _framing_probe(self) -> list[str]:
        """The text the template writes around an untrusted message: what follows an assistant turn when a tool,
        a user or a system message (a sentinel) comes next, for each role the template renders there."""
        texts = []
        for role in _AFTER_ASSISTANT:
            try:
                _, after = self._after_assistant([{"role": role, "content": _UNTRUSTED}], None)
            except ValueError:  # a role the template cannot render after an assistant turn frames nothing
                continue
            texts += after.split(_UNTRUSTED)
        return texts

    def _is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _after_assistant(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> tuple[str, str]:
        """(before, after): the text a template renders up to the end of an assistant turn's content (a
        placeholder), and after it when `messages` follow it, up to and including the next generation header."""
        for m in messages:
            # any other role is rendered as the template renders it (an SFT row's ipython / observation tool
            # results between trained turns were refused); one it cannot render is the ValueError below
            if m.get("role") == "assistant" or not isinstance(m.get("role"), str) or not m["role"]:
                raise ValueError(
                    f"a continuation holds the messages that follow a sampled turn (user, tool, system, ...), not "
                    f"{m.get('role')!r}: an assistant turn that was not sampled starts a new trajectory "
                    "(initial_messages)"
                )
        convo = [{"role": "user", "content": _FIRST_USER}, {"role": "assistant", "content": _ASSISTANT}, *messages]
        try:
            full = self._render(convo, True, tools)
        except Exception as exc:  # jinja's raise_exception, TemplateError, a KeyError in the template ...
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise ValueError(f"the chat template cannot render [{roles}] after an assistant turn: {exc}") from exc
        if full.count(_ASSISTANT) != 1:
            raise ValueError("the chat template does not render an assistant turn's content once, verbatim")
        cut = full.index(_ASSISTANT) + len(_ASSISTANT)
        before, after = full[:cut], full[cut:]
        for m in messages:  # a template that moves or drops a message would leave the model a different context
            content = m.get("content")
            texts = [content] if isinstance(content, str) else [c.get("text", "") for c in content or []]
            if not all(_rendered(t, after) for t in texts if isinstance(t, str)):
                raise ValueError(
                    f"the chat template does not render a {m['role']!r} message where it follows an assistant turn "
                    "(it moves or drops it)"
                )
        return before, after

    def encode(self, text: str) -> list[int]:
        """Ids of `text` on its own, with no special tokens added (bos) beyond the ones it spells (a SentencePiece
        tokenizer prefixes a space: text between turns goes through `encode_after`)."""
        return [int(x) for x in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    # ---- the API ------------------------------------------------------------------------------------------
    @property
    def stop_token_ids(self) -> list[int]:
        """The template's end-of-turn token when it is not the tokenizer's eos, and its alternatives
        (`ALT_TURN_ENDS`) (put them in SamplingParams)."""
        return [i for i in self._stop_ids if i not in self.eos_ids]

    def initial_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict] | None = None,
        untrusted_roles: Collection[str] = ("tool",),
    ) -> list[int]:
        """Ids of a first prompt: the prefix (system prompt, examples), `messages`, and the generation header.
        A special token spelt in the content of a message whose role is in `untrusted_roles` (a `tool` message's,
        by default) is encoded as text (module docstring: untrusted text)."""
        if not messages:
            raise ValueError("initial_messages needs at least one message")
        if messages[-1].get("role") == "assistant":
            raise ValueError("the last message of a prompt is an assistant turn: the model would start another one")
        given = [dict(m) for m in messages]
        marked = [self.special_text.mark_message(m) if m.get("role") in untrusted_roles else m for m in given]
        if marked != given:  # untrusted text spells a special token: it is encoded as text
            return self.special_text.encode_after("", self._render(marked, True, tools))
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        ids = self.tokenizer.apply_chat_template(
            self.prefix + given,
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
            **kwargs,
        )
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict] | None = None,
        response_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Ids appended after a sampled assistant turn (kept as sampled): the rest of that turn's closing the model
        did not generate, then `messages` (user / tool / system, or any other role but assistant the template renders:
        Llama 3.1's ipython, GLM's observation; several at once), then the next generation header.

        `response_ids` are the sampled ids: when they end with a turn-end token or another special token (an eos of
        the model's generation config, see the module docstring) that the closing starts with (after whitespace),
        the closing continues after it; otherwise the whole closing is added. Without `response_ids` the turn is
        taken to have ended on the template's end-of-turn token (the usual stop).

        The ids are those of the new text as it follows the conversation (`encode_after`, see the module doc); a
        special token spelt in the messages' content is encoded as text (module docstring: untrusted text)."""
        before, after = self._after_assistant([self.special_text.mark_message(m) for m in messages], tools)
        if response_ids is None:
            sampled_end = self._turn_end_text
        elif response_ids and (int(response_ids[-1]) in self.turn_end_ids or self._is_special(int(response_ids[-1]))):
            # (a special token the engine stopped on: the generation config's eos ids, stop_token_ids)
            sampled_end = self.tokenizer.decode([int(response_ids[-1])])
        else:
            sampled_end = ""
        rest = after.lstrip()
        if sampled_end and rest.startswith(sampled_end):
            # the template's whitespace before its end token (Llama 2's " </s>") was not sampled: the trajectory
            # goes on right after the sampled end token, and so does the context the new text is encoded after
            before, after = before + sampled_end, rest[len(sampled_end) :]
        elif response_ids and int(response_ids[-1]) in self._alt_end_ids and rest.startswith(self._turn_end_text):
            # <|eom_id|> ended the turn in <|eot_id|>'s place: adding the template's <|eot_id|> after it gave the
            # model a turn with two ends, a context its template never renders
            before, after = before + sampled_end, rest[len(self._turn_end_text) :]
        return self.special_text.encode_after(before, after)

    def initial(self, observation: str) -> list[int]:
        """Ids of the conversation up to the first assistant turn (system prompt, examples, first observation); the
        observation is untrusted text (module docstring), as a later one is."""
        ids, _ = self.initial_turn(observation)
        return ids

    def observation(self, observation: str, response_ids: list[int]) -> list[int]:
        """Ids appended after a response: the rest of its turn's closing, then the observation's user turn and
        the next assistant header. A response cut off before its end-of-turn token gets the whole closing."""
        ids, _ = self.observation_turn(observation, response_ids)
        return ids

    # ---- observations with pictures -----------------------------------------------------------------------
    def initial_turn(self, observation: Observation) -> tuple[list[int], Any]:
        """(ids, MMInputs | None) of the conversation up to the first assistant turn (see `initial`); the
        pictures' placeholders are expanded in the ids. The observation is untrusted text: an environment's reset()
        may echo a task string nobody vouches for, and spelt special tokens there ended the user's turn."""
        message, images = self._user_message(observation)
        ids = self.initial_messages([message], untrusted_roles=("user",))
        if self.vision is not None:
            ids = self.vision.with_bos(ids)  # as the prompts of single-turn runs (VisionProcessor.encode_text)
        return self._with_pictures(ids, images, "the first observation")

    def observation_turn(self, observation: Observation, response_ids: Sequence[int]) -> tuple[list[int], Any]:
        """(ids, MMInputs | None) appended after a response (see `observation`): this turn's pictures only."""
        message, images = self._user_message(observation)
        ids = self.continuation([message], response_ids=response_ids)
        return self._with_pictures(ids, images, "an observation")

    def _user_message(self, observation: Observation) -> tuple[dict[str, Any], list[Any]]:
        text, images = text_of(observation), images_of(observation)
        if not images:
            return {"role": "user", "content": text}, []
        if self.vision is None:
            raise ValueError(
                f"an observation holds {len(images)} picture(s) but the model is not a vision-language model: "
                "use one (model.path=builtin:tiny-qwen2.5-vl, a Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder) or an "
                "environment whose observations are text"
            )
        from roll_core.multimodal import as_content

        return {"role": "user", "content": as_content(text, len(images))}, images

    def _with_pictures(self, ids: list[int], images: list[Any], where: str) -> tuple[list[int], Any]:
        if self.vision is None:
            return ids, None
        from roll_core.multimodal import check_tokens

        mm = self.vision.process_images(images) if images else None
        ids = self.vision.expand(ids, mm)
        check_tokens(ids, mm, self.vision.image_token_id, where)
        return ids, mm


def _rendered(text: str, rendered: str) -> bool:
    """Whether a message's `text` is in `rendered` (stripped: templates trim), as given or as a JSON string's
    body: Llama 3.1's template writes a tool / ipython message's text `| tojson` (a string is `iterable` to jinja),
    so a tool result with a quote, a newline or a backslash (JSON output, a traceback) reads `{\\"a\\": 1}` there;
    it was taken for a dropped message (a template_error SFT skip, an agent endpoint 400)."""
    text = text.strip()
    return any(t in rendered for t in (text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]))
