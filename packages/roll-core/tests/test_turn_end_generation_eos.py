"""A turn that stops on an eos id of the model's generation config, not the tokenizer's (roll_core.agentic.chat).

hf, vLLM and SGLang stop on the generation config's eos ids as well as the tokenizer's, and return the id they
stopped on as the turn's last sampled token. Two cases, on tiny local tokenizers (nothing downloaded):

- GLM-4 style (tokenizer eos `<|endoftext|>`; generation config eos also `<|user|>` and `<|observation|>`, the
  tokens its template opens the next user / tool turn with, with no end-of-turn token): a turn that stops on
  `<|observation|>` and is followed by a tool message went on with the template's whole closing, so the trajectory
  held `<|observation|><|observation|>` (the model's context from then on was one no template renders). The closing
  now goes on after the sampled token: the ids are those of the rendered conversation, token for token.
- Qwen2.5-Instruct (tokenizer eos `<|im_end|>`; generation config eos also `<|endoftext|>`): a turn that stops on
  `<|endoftext|>` keeps it (sampled: trained, loss mask 1) and gets the template's whole closing after it
  (`<|im_end|>` onwards, mask 0); every later turn's request is the trajectory so far (what the trainer scores).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from roll_core.agentic.agent_sessions import AgentSessions, ChatTurn, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.openai_server import HermesToolParser
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.chat_templates import family_tokenizer

# GLM-4's layout, re-implemented: a role token and a newline open each message; no end-of-turn token.
GLM4 = (
    "[gMASK]<sop>{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{- '<|observation|>\\n' + m.content -}}"
    "{%- else -%}{{- '<|' + m.role + '|>\\n' + m.content -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
_GLM4_SPECIALS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"]


def glm4_tokenizer() -> Any:
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": _GLM4_SPECIALS})
    tok.eos_token = "<|endoftext|>"
    tok.chat_template = GLM4
    return tok


class EndsOn:
    """A request engine: each request answers `text`'s ids and then `end` (the id it stopped on), finish `stop`;
    it records the requests."""

    def __init__(self, tok: Any, text: str, end: int) -> None:
        self.ids = [*tok(text, add_special_tokens=False)["input_ids"], end]
        self.requests: list[Request] = []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, self.ids, [-0.5] * len(self.ids), "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        return False

    def check_sampling(self, params: SamplingParams) -> None:
        """Everything is accepted."""


def _rendered(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


def test_a_generation_config_eos_the_tool_turn_opens_with_is_not_written_twice() -> None:
    tok = glm4_tokenizer()
    observation = tok.convert_tokens_to_ids("<|observation|>")
    template = TurnTemplate(tok)
    assert observation not in template.turn_end_ids  # not the tokenizer's eos, not the user turn's opener
    response = [*tok("call", add_special_tokens=False)["input_ids"], observation]
    ids = template.initial_messages([{"role": "user", "content": "hi"}])
    ids += response + template.continuation([{"role": "tool", "content": "42"}], response_ids=response)
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "call"}]
    expected = _rendered(tok, [*convo, {"role": "tool", "content": "42"}])
    assert ids == expected, tok.decode(ids)
    assert ids.count(observation) == 1
    # stopped on the user turn's opener (the template's turn end): unchanged, as the template renders it
    user = tok.convert_tokens_to_ids("<|user|>")
    response = [*tok("call", add_special_tokens=False)["input_ids"], user]
    ids = template.initial_messages([{"role": "user", "content": "hi"}])
    ids += response + template.continuation([{"role": "user", "content": "more"}], response_ids=response)
    assert ids == _rendered(tok, [*convo, {"role": "user", "content": "more"}])


def test_an_agent_session_whose_turn_stops_on_the_tool_turns_opener_trains_the_rendered_conversation() -> None:
    tok = glm4_tokenizer()
    observation = tok.convert_tokens_to_ids("<|observation|>")
    engine = EndsOn(tok, "call", observation)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    sessions = AgentSessions(engine, TurnTemplate(tok), decode, HermesToolParser())
    sessions.open("ep", SamplingParams(max_new_tokens=16), SessionLimits(max_turns=2, max_context_length=512))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    reply = sessions.chat("ep", ChatTurn(messages=list(messages)))
    messages += [{"role": "assistant", "content": reply.message["content"]}, {"role": "tool", "content": "42"}]
    sessions.chat("ep", ChatTurn(messages=list(messages)))
    traj = sessions.close("ep").traj
    call = tok("call", add_special_tokens=False)["input_ids"]
    expected = [*_rendered(tok, messages), *call, observation]
    assert traj.prompt_ids + traj.tokens == expected, tok.decode(traj.prompt_ids + traj.tokens)
    # the engine's second request was that context; the sampled ids (the stop token included) are the trained ones
    assert list(engine.requests[1].prompt_ids) == _rendered(tok, messages)
    trained = [t for t, m in zip(traj.tokens, traj.mask) if m]
    assert trained == [*call, observation] * 2


class Steps:
    """Three observations, then the episode ends."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.n = 0
        return "start", {"state": "0"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.n += 1
        return f"obs{self.n}", 0.0, self.n >= 3, False, {"state": str(self.n)}


def test_a_qwen_turn_that_stops_on_endoftext_keeps_it_and_gets_the_whole_closing() -> None:
    tok = family_tokenizer("qwen2.5")
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") != endoftext
    engine = EndsOn(tok, "go", endoftext)
    rollout = AgenticRollout(engine, EnvManager(Steps, 0, step_timeout_s=10), TurnTemplate(tok), tok, EpisodeLimits(3))
    traj = rollout.run([0], [0], SamplingParams(max_new_tokens=16))[0]
    assert traj.end == "terminated" and traj.turns == 3
    go = tok("go", add_special_tokens=False)["input_ids"]
    # what the template renders with "go<|endoftext|>" as each assistant turn's content (the special token's id)
    convo: list[dict[str, str]] = [{"role": "user", "content": "start"}]
    for k in range(3):
        # each request is the trajectory so far: the rendered conversation, each sampled <|endoftext|> kept
        assert list(engine.requests[k].prompt_ids) == _rendered(tok, convo), tok.decode(engine.requests[k].prompt_ids)
        convo += [{"role": "assistant", "content": "go<|endoftext|>"}, {"role": "user", "content": f"obs{k + 1}"}]
    # (the last observation ended the episode: no turn read it)
    assert traj.prompt_ids + traj.tokens == [*_rendered(tok, convo[:-2]), *go, endoftext]
    assert [t for t, m in zip(traj.tokens, traj.mask) if m] == [*go, endoftext] * 3
