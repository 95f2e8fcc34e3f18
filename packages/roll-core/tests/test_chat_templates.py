"""Multi-turn trajectories stay token-exact for every chat-template family (roll_core.testing.chat_templates),
including templates that rewrite history (Qwen3 / DeepSeek-R1 drop earlier thinking, Llama 3 / Gemma 3 / DeepSeek
trim turns) and templates that add (ChatML, Phi-3) or drop (Llama 3, DeepSeek) a newline after the end of a turn."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.testing.chat_templates import FAMILIES, family_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
ARGS = {"a": 4, "b": 4}
# The token each family's model ends a turn with (tiny: the tokenizer's eos, which its template does not spell).
END = {
    "tiny": "</s>",
    "chatml": "<|im_end|>",
    "qwen2.5": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "gemma3": "<end_of_turn>",
    "phi3": "<|end|>",
    "deepseek_r1": "<|end_of_sentence|>",
}
TOOL_CALL = {  # what each family's model writes to call a tool (no tool format: plain text)
    "qwen2.5": '<tool_call>\n{"name": "add", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>",
    "qwen3": '<tool_call>\n{"name": "add", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>",
    "llama3": '{"name": "add", "parameters": ' + json.dumps(ARGS) + "}",
}
TOOL_RESULTS = [{"role": "tool", "content": "8"}, {"role": "tool", "content": "exact"}]
NO_TOOL_ROLE = {"gemma3", "deepseek_r1"}  # their templates cannot render a tool turn
# The first continuation (after a turn that stopped on END), written out by hand: which families add a newline
# after the end-of-turn token and which do not.
FIRST_CONTINUATION = {
    "tiny": "\n<|user|>And 4+4?\n<|assistant|>",
    "chatml": "\n<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n",
    "qwen2.5": "\n<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "\n<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n",
    "llama3": (
        "<|start_header_id|>user<|end_header_id|>\n\nAnd 4+4?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "gemma3": "\n<start_of_turn>user\nAnd 4+4?<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "\n<|user|>\nAnd 4+4?<|end|>\n<|assistant|>\n",
    "deepseek_r1": "<|User|>And 4+4?<|Assistant|>",
}
REWRITES = {"qwen3", "llama3", "gemma3", "deepseek_r1"}  # re-rendering the conversation changes earlier turns


def spell(tok, text: str) -> list[int]:
    """`text` one id per character, even where an added token spells it: a sampling the model may well produce
    and that re-tokenising the decoded text would not give back."""
    return [tok.convert_tokens_to_ids(c) for c in text]


@dataclass
class Episode:
    """A simulated conversation: the trajectory built the way roll builds it, and what it must equal."""

    traj: Trajectory
    pieces: list[tuple[str, list[int]]] = field(default_factory=list)  # ("prompt"|"sampled"|"continuation", ids)
    messages: list[dict] = field(default_factory=list)  # the conversation in chat-message form

    @property
    def ids(self) -> list[int]:
        return self.traj.context()


def play(name: str) -> tuple[object, TurnTemplate, Episode]:
    """Four assistant turns: thinking + answer + newline (stopped on its end token), a user turn, a tool call
    (stopped), the tool results (a user turn where the template has no tool role), an answer cut off by the token
    limit (no end token), a user turn and a last answer with a trailing newline (stopped)."""
    tok = family_tokenizer(name)
    tools = TOOLS if name in TOOL_CALL else None
    t = TurnTemplate(tok)
    end = tok.convert_tokens_to_ids(END[name])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    prompt = t.initial_messages(msgs, tools=tools)
    ep = Episode(Trajectory(env_seed=0, group=0, prompt_ids=prompt), [("prompt", prompt)], list(msgs))

    def sample(text: str, ids: list[int], stopped: bool) -> list[int]:
        ids = ids + [end] * stopped
        ep.traj.add_response(ids, [-0.5] * len(ids))
        ep.traj.turn_rewards.append(0.0)
        ep.pieces.append(("sampled", ids))
        ep.messages.append({"role": "assistant", "content": text})
        return ids

    def observe(new: list[dict], response: list[int]) -> None:
        ids = t.continuation(new, tools=tools, response_ids=response)
        ep.traj.add_observation(ids)
        ep.pieces.append(("continuation", ids))
        ep.messages += new

    first = "<think>\nsmall sum\n</think>\n\n5\n"  # a trailing newline the trimming templates drop on re-rendering
    r = sample(first, spell(tok, first), True)
    observe([{"role": "user", "content": "And 4+4?"}], r)
    call = TOOL_CALL.get(name, "CALL add 4 4")
    r = sample(call, t.encode(call), True)
    observe([{"role": "user", "content": "8"}] if name in NO_TOOL_ROLE or name not in TOOL_CALL else TOOL_RESULTS, r)
    answer = "<think>\ngot 8\n</think>\n\nIt is 8 and"
    r = sample(answer, t.encode(answer), False)  # cut off: no end token
    observe([{"role": "user", "content": "Thanks."}], r)
    sample("Bye.\n", t.encode("Bye.\n"), True)
    return tok, t, ep


def rendered(tok, ep: Episode, name: str, last_as_prompt: bool = True) -> str:
    """The conversation rendered whole by the template (what a re-rendering implementation would train on); with
    `last_as_prompt` the last assistant turn is appended to the generation prompt as sampled, plus its end token."""
    tools = TOOLS if name in TOOL_CALL else None
    if not last_as_prompt:
        return tok.apply_chat_template(ep.messages, tools=tools, tokenize=False)
    head = tok.apply_chat_template(ep.messages[:-1], tools=tools, tokenize=False, add_generation_prompt=True)
    return head + ep.messages[-1]["content"] + ("" if name == "tiny" else END[name])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_trajectory_is_prompt_plus_sampled_plus_continuations(name: str) -> None:
    tok, _, ep = play(name)
    # (a) token for token: the prompt, each sampled turn exactly as sampled, each continuation
    assert ep.ids == [i for _, ids in ep.pieces for i in ids]
    kinds = [k for k, _ in ep.pieces]
    assert kinds == ["prompt"] + ["sampled", "continuation"] * 3 + ["sampled"]
    # (b) the loss mask covers exactly the sampled ids, in the trainer's layout too
    expected_mask = [m for k, ids in ep.pieces[1:] for m in [int(k == "sampled")] * len(ids)]
    assert ep.traj.mask == expected_mask
    batch = to_tensors([ep.traj], pad_id=tok.pad_token_id)
    assert batch["response_mask"][0].tolist() == expected_mask
    assert batch["responses"][0].tolist() == ep.traj.tokens
    # each continuation is the template's text between turns; after a stopped turn the end token is not repeated
    assert tok.decode(ep.pieces[2][1]) == FIRST_CONTINUATION[name]
    # after the cut-off turn the continuation carries the whole closing, end-of-turn token first
    cut_off_closing = tok.decode(ep.pieces[6][1])
    if name == "tiny":
        assert cut_off_closing == "\n<|user|>Thanks.\n<|assistant|>"
    else:
        assert cut_off_closing.startswith(END[name]) and "Thanks." in cut_off_closing
    # re-tokenising the decoded trajectory does not give back what was sampled (the spelled-out <think>)
    if "<think>" in tok.get_added_vocab():
        assert tok(tok.decode(ep.ids), add_special_tokens=False)["input_ids"] != ep.ids


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - REWRITES))
def test_decoded_trajectory_is_the_rendered_conversation(name: str) -> None:
    """(d) For templates that keep history as it was, the trajectory's text is the conversation's rendering."""
    tok, _, ep = play(name)
    text = tok.decode(ep.ids)
    if name == "tiny":  # the tiny model's eos is no part of its template: the sampled ones stay in the trajectory
        text = text.replace("</s>", "")
    assert text == rendered(tok, ep, name)


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_rewriting_templates_would_break_a_re_rendering_implementation(name: str) -> None:
    """(c) Re-rendering the full conversation gives other tokens than the ones the model saw and sampled (dropped
    thinking, trimmed turns); roll's appended trajectory still holds the sampled ids and each prompt it was
    sampled from."""
    tok, _, ep = play(name)
    text = tok.decode(ep.ids)
    again = rendered(tok, ep, name, last_as_prompt=False)
    assert again != text
    again_ids = tok(again, add_special_tokens=False)["input_ids"]
    assert again_ids != ep.ids
    if name in ("qwen3", "deepseek_r1"):
        assert text.count("small sum") == 1 and "small sum" not in again  # the first turn's thinking is gone
    if name in ("llama3", "gemma3", "deepseek_r1"):  # turns are trimmed: the sampled newlines before the end go
        for turn in ("5\n", "Bye.\n"):
            assert (turn + END[name]) in text and (turn + END[name]) not in again
    # the trajectory is what the model saw: every prompt it was sampled from is a prefix of it
    at = 0
    for _, ids in ep.pieces:
        assert ep.ids[at : at + len(ids)] == ids
        at += len(ids)


def test_qwen3_thinking_switch_reaches_every_generation_header() -> None:
    tok = family_tokenizer("qwen3")
    t = TurnTemplate(tok, chat_template_kwargs={"enable_thinking": False})
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(t.initial_messages([{"role": "user", "content": "hi"}])).endswith(empty_think)
    cont = tok.decode(t.continuation([{"role": "user", "content": "more"}]))  # default: ended on <|im_end|>
    assert cont == "\n<|im_start|>user\nmore<|im_end|>\n" + empty_think


@pytest.mark.parametrize("name", list(FAMILIES))
def test_agentic_initial_and_observation_on_every_family(name: str) -> None:
    """The agentic collector's path (initial / observation) is the message API's, for each family, with a
    system prompt (Gemma 3 folds it into the first user turn)."""
    tok = family_tokenizer(name)
    t = TurnTemplate(tok, system_prompt="Play well.")
    end = tok.convert_tokens_to_ids(END[name])
    first = t.initial("board 1")
    assert first == t.initial_messages([{"role": "user", "content": "board 1"}])
    assert "Play well." in tok.decode(first) and tok.decode(first).count("board 1") == 1
    stopped, cut = [*t.encode("left"), end], t.encode("up")
    assert t.observation("board 2", stopped) == t.continuation([{"role": "user", "content": "board 2"}], None, stopped)
    assert tok.decode(t.observation("board 2", stopped)) == FIRST_CONTINUATION[name].replace("And 4+4?", "board 2")
    full = tok.decode(t.observation("board 3", cut))  # cut off: the whole closing, then the next turn
    assert full == (END[name] if name != "tiny" else "") + FIRST_CONTINUATION[name].replace("And 4+4?", "board 3")
    if name not in REWRITES:
        traj = first + stopped + t.observation("board 2", stopped) + cut + t.observation("board 3", cut)
        expected = tok.apply_chat_template(
            [
                {"role": "system", "content": "Play well."},
                {"role": "user", "content": "board 1"},
                {"role": "assistant", "content": "left"},
                {"role": "user", "content": "board 2"},
                {"role": "assistant", "content": "up"},
                {"role": "user", "content": "board 3"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tok.decode(traj).replace("</s>", "") == expected


def test_end_of_turn_tokens_and_stop_ids() -> None:
    """Gemma 3 ends a turn with <end_of_turn>, not its tokenizer's eos: the template says so (stop_token_ids), a
    turn that stopped on it continues after it, one that stopped on <eos> gets the template's whole closing."""
    tok = family_tokenizer("gemma3")
    t = TurnTemplate(tok)
    eot, eos = tok.convert_tokens_to_ids("<end_of_turn>"), tok.eos_token_id
    assert t.stop_token_ids == [eot] and t.turn_end_ids == {eot, eos}
    user = [{"role": "user", "content": "go"}]
    assert tok.decode(t.continuation(user, response_ids=[*t.encode("a"), eot])).startswith("\n<start_of_turn>user")
    assert tok.decode(t.continuation(user, response_ids=[*t.encode("a"), eos])).startswith("<end_of_turn>\n")
    assert t.continuation(user) == t.continuation(user, response_ids=[eot])
    assert TurnTemplate(family_tokenizer("chatml")).stop_token_ids == []  # its eos is the end of turn


@pytest.mark.parametrize(
    ("name", "messages", "error"),
    [
        ("gemma3", TOOL_RESULTS, "cannot render \\[tool, tool\\] after an assistant turn: Conversation roles"),
        ("gemma3", [{"role": "system", "content": "Now be terse."}], "cannot render \\[system\\]"),
        ("deepseek_r1", TOOL_RESULTS[:1], "cannot render \\[tool\\]"),
        ("deepseek_r1", [{"role": "system", "content": "Now be terse."}], "moves or drops it"),
        ("qwen3", [{"role": "assistant", "content": "made up"}], "not 'assistant'"),
    ],
)
def test_messages_a_template_cannot_continue_with_are_clear_errors(name: str, messages: list, error: str) -> None:
    t = TurnTemplate(family_tokenizer(name))
    with pytest.raises(ValueError, match=error):
        t.continuation(messages)


def test_several_messages_at_once_and_mid_conversation_system() -> None:
    """Qwen2.5 groups consecutive tool results into one user turn and renders a later system message in place."""
    tok = family_tokenizer("qwen2.5")
    t = TurnTemplate(tok)
    msgs = [*TOOL_RESULTS, {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Sum?"}]
    assert tok.decode(t.continuation(msgs, tools=TOOLS)) == (
        "\n<|im_start|>user\n<tool_response>\n8\n</tool_response>\n<tool_response>\nexact\n</tool_response><|im_end|>\n"
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nSum?<|im_end|>\n<|im_start|>assistant\n"
    )
