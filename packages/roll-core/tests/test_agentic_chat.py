"""Token-in-token-out chat turns and the trajectory batch layout (holes in the loss mask)."""

from __future__ import annotations

import pytest
import torch

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.models import build_tiny_tokenizer

CHATML = (  # like SmolLM2's and Qwen's: a default system prompt when none is given
    "{% for m in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(params=["tiny", "chatml"])
def tokenizer(request: pytest.FixtureRequest):
    tok = build_tiny_tokenizer()
    if request.param == "chatml":
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.eos_token = "<|im_end|>"
        tok.chat_template = CHATML
    return tok


def test_appended_turns_equal_the_rendered_conversation(tokenizer) -> None:
    """initial + response + observation + response ... decodes to exactly the template's rendering, while the
    response ids stay the ones generated (never re-tokenised)."""
    t = TurnTemplate(tokenizer, system_prompt="Play well.")
    eos = tokenizer.eos_token_id
    first = t.initial("board 1")
    reply1 = tokenizer("move left", add_special_tokens=False)["input_ids"] + [eos]  # stopped at end-of-turn
    obs = t.observation("board 2", reply1)
    reply2 = tokenizer("move up", add_special_tokens=False)["input_ids"]  # cut off: no end-of-turn token
    obs2 = t.observation("board 3", reply2)
    text = tokenizer.decode(first + reply1 + obs + reply2 + obs2)
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Play well."},
            {"role": "user", "content": "board 1"},
            {"role": "assistant", "content": "move left"},
            {"role": "user", "content": "board 2"},
            {"role": "assistant", "content": "move up"},
            {"role": "user", "content": "board 3"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.replace("</s>", "") == expected.replace("</s>", "")


def test_batch_layout_has_holes_and_turns() -> None:
    a = Trajectory(env_seed=1, group=0, prompt_ids=[5, 6])
    a.add_response([10, 11], [-0.1, -0.2])
    a.state_keys.append("s0")
    a.turn_rewards.append(0.0)
    a.add_observation([20, 21, 22])
    a.add_response([12], [-0.3])
    a.state_keys.append("s1")
    a.turn_rewards.append(1.0)
    b = Trajectory(env_seed=1, group=0, prompt_ids=[7])
    b.add_response([13], [-0.4])
    b.turn_rewards.append(0.0)
    t = to_tensors([a, b], pad_id=0)
    assert t["responses"].tolist() == [[10, 11, 20, 21, 22, 12], [13, 0, 0, 0, 0, 0]]
    assert t["response_mask"].tolist() == [[1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0]]
    assert t["turn_ids"].tolist() == [[0, 0, -1, -1, -1, 1], [0, -1, -1, -1, -1, -1]]
    torch.testing.assert_close(t["behaviour_logprobs"][0], torch.tensor([-0.1, -0.2, 0, 0, 0, -0.3]))
    # observations are attended (they are context), padding is not; prompts left-padded
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert t["turn_rewards"].tolist() == [[0.0, 1.0], [0.0, 0.0]] and t["turn_mask"].tolist() == [[1, 1], [1, 0]]
    assert t["episode_rewards"].tolist() == [1.0, 0.0] and t["state_keys"] == [["s0", "s1"], []]


# ---- SentencePiece-style tokenizers (Llama 2, Mistral) ----------------------------------------------------------
SP = "\u2581"
WORDS = ["[INST]", "[/INST]", "It", "is", "4", "go", "on"]
SP_TEMPLATES = {
    # Llama 2: the answer stripped between spaces, then eos (the model samples eos right after its answer)
    "llama2": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}"
        "{% else %}{{ ' ' + m.content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
    # Mistral: the answer as sampled (its leading space), then eos
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}"
        "{% else %}{{ m.content + eos_token }}{% endif %}{% endfor %}"
    ),
}


def sp_tokenizer(template: str, legacy: bool):
    """A SentencePiece-style tokenizer built locally from a word-level vocabulary (the ids spelt out by hand): each
    space a "\u2581", and one put before the text; `legacy` (Llama 2's normalizer) before the text after every
    special token too, else (transformers' legacy=False: Metaspace prepend_scheme="first") only at the start."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", SP, *WORDS, *(SP + w for w in WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SP), normalizers.Replace(" ", SP)])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="never", split=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement=SP, prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = SP_TEMPLATES[template]
    return fast


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("template", list(SP_TEMPLATES))
def test_sentencepiece_continuations_are_tokenised_as_they_follow_the_conversation(template: str, legacy: bool):
    """Encoded on its own, the text between turns got a space token the conversation does not have ("\u2581[INST]"
    after eos where the whole rendering has "[INST]", "\u2581" "\u2581" "</s>" where it has "\u2581" "</s>"), and
    Llama 2's " </s>" after a turn that stopped on eos was a second eos: every later turn's context carried them.
    The trajectory (prompt, sampled ids as sampled, continuations) is the whole rendering's ids, except the space
    Llama 2's template puts before an eos the model sampled right after its answer."""
    tok = sp_tokenizer(template, legacy)
    t = TurnTemplate(tok)
    eos = tok.eos_token_id
    inst = "\u2581[INST]" if legacy else "[INST]"  # after a special token (the sampled eos)
    answer = tok.convert_tokens_to_ids([SP + "It", SP + "is", SP + "4"])
    stopped, cut = [*answer, eos], answer[:2]  # stopped on eos; cut off by the token limit
    first = t.initial_messages([{"role": "user", "content": "go"}])
    after_stopped = t.continuation([{"role": "user", "content": "go on"}], response_ids=stopped)
    after_cut = t.continuation([{"role": "user", "content": "go"}], response_ids=cut)
    assert tok.convert_ids_to_tokens(after_stopped) == [inst, SP + "go", SP + "on", SP + "[/INST]"]
    closing = [SP, "</s>"] if template == "llama2" else ["</s>"]  # the whole closing: the turn did not end it
    assert tok.convert_ids_to_tokens(after_cut) == [*closing, inst, SP + "go", SP + "[/INST]"]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": " It is 4"},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": " It is"},
        {"role": "user", "content": "go"},
    ]
    rendered = tok.apply_chat_template(messages, return_dict=False)
    gap = tok.convert_tokens_to_ids([SP]) if template == "llama2" else []  # Llama 2's " </s>": not sampled
    assert [*first, *answer, *gap, eos, *after_stopped, *cut, *after_cut] == rendered
    # the default (no response ids): a turn taken to have ended on the template's end of turn
    assert t.continuation([{"role": "user", "content": "go on"}]) == (
        after_stopped if template == "mistral" else [*gap, eos, *after_stopped]
    )


def test_llama3_eom_ends_a_turn_in_place_of_eot() -> None:
    """Llama 3.1+ ends a turn that calls a built-in tool with <|eom_id|>: the turn stops there (a stop token, as
    <|eot_id|> is the tokenizer's eos) and the next turn follows it directly, as the template renders such a
    turn; it used to get a second end, <|eot_id|>, appended after the sampled <|eom_id|>. A Llama 3.0 tokenizer
    (no <|eom_id|>) is unchanged."""
    from roll_core.testing.chat_templates import family_tokenizer

    old = TurnTemplate(family_tokenizer("llama3"))
    assert old.stop_token_ids == [] and old.turn_end_ids == {old.tokenizer.eos_token_id}
    tok = family_tokenizer("llama3")
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>", "<|end_of_text|>"]})
    eom, eot = tok.convert_tokens_to_ids("<|eom_id|>"), tok.convert_tokens_to_ids("<|eot_id|>")
    t = TurnTemplate(tok)
    assert t.stop_token_ids == [eom] and t.turn_end_ids == {eot, eom}
    reply = tok("calling the tool", add_special_tokens=False)["input_ids"]
    after_eot = t.observation("result", [*reply, eot])
    after_eom = t.observation("result", [*reply, eom])
    assert after_eom == after_eot  # the header of the next turn, right after the sampled end
    assert tok.decode(after_eom).startswith("<|start_header_id|>user<|end_header_id|>")
    text = tok.decode(t.initial("question") + reply + [eom] + after_eom)
    rendered = tok.apply_chat_template(
        [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": "calling the tool"},
            {"role": "user", "content": "result"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == rendered.replace("calling the tool<|eot_id|>", "calling the tool<|eom_id|>", 1)
    # cut off (no end token): the whole closing, <|eot_id|> included, as before
    assert tok.decode(t.observation("result", reply)).startswith("<|eot_id|><|start_header_id|>user")
