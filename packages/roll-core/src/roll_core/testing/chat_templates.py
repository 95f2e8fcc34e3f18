"""Chat templates of the model families roll meets, re-implemented from each family's documented behaviour (not
copied from vendor files), and tiny local tokenizers that know each family's special tokens: for tests of
token-in-token-out trajectories (roll_core.agentic.chat) against templates that rewrite history.

Families (FAMILIES[name]):
- `tiny`: roll's builtin tiny model (`<|role|>content\\n`; eos `</s>` is not part of the template).
- `chatml`: SmolLM2's ChatML, a default system prompt when none is given; eos `<|im_end|>`.
- `qwen2.5`: ChatML with tools (JSON schemas in the system turn, assistant `<tool_call>` blocks, tool results
  grouped into one user turn of `<tool_response>` blocks), default system prompt.
- `qwen3`: qwen2.5's tool format plus thinking: the `<think>` block of every assistant turn before the last user
  query is dropped on re-rendering (tool results are not queries); `enable_thinking=False` puts an empty think block
  in the generation header.
- `llama3`: `<|begin_of_text|>`, `<|start_header_id|>role<|end_header_id|>\\n\\n`, content trimmed, `<|eot_id|>`
  with no newline after it; tool results in an `ipython` turn, tool calls as `{"name", "parameters"}` JSON.
- `gemma3`: no system role (the system prompt is prepended to the first user turn), `model` for the assistant,
  roles must alternate (a tool or a later system message is an error), content trimmed, `<end_of_turn>\\n`; the
  tokenizer's eos is `<eos>`, not the end-of-turn token.
- `phi3`: adds a newline after the end-of-turn token `<|end|>`, and an end-of-text token when no generation
  prompt follows (so a conversation ending with an assistant turn is not a prefix of its continuation).
- `deepseek_r1`: drops the newline: no separator after `<|end_of_sentence|>`; earlier assistant turns lose their
  thinking and surrounding whitespace; the system prompt is hoisted to the start (ASCII spellings of its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TOOL_CALL_JSON = (  # one OpenAI-format tool call as qwen renders it; arguments may be a JSON string or a mapping
    "{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' -}}'
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}{{- '}\\n</tool_call>' -}}"
)

_QWEN_SYSTEM = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- else -%}{{- DEFAULT_SYSTEM -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- elif DEFAULT_SYSTEM -%}{{- '<|im_start|>system\\n' + DEFAULT_SYSTEM + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
)

_QWEN_TOOL_RESULT = (  # consecutive tool results share one user turn
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
)

QWEN25 = (
    "{%- set DEFAULT_SYSTEM = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -%}"
    + _QWEN_SYSTEM
    + "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for tool_call in (message.tool_calls or []) -%}{{- '\\n' -}}" + _TOOL_CALL_JSON + "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}" + _QWEN_TOOL_RESULT + "{%- elif message.role != 'system' -%}"
    "{{- raise_exception('unknown role ' + message.role) -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

QWEN3 = (
    "{%- set DEFAULT_SYSTEM = '' -%}"
    + _QWEN_SYSTEM
    # the last user query: tool results wrapped as a user message do not count
    + "{%- set ns = namespace(last_query=-1) -%}{%- for m in messages -%}"
    "{%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>') "
    "and m.content.endswith('</tool_response>')) -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = message.content or '' -%}{%- set reasoning = '' -%}"
    "{%- if message.reasoning_content is string -%}{%- set reasoning = message.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    # thinking is kept only after the last query, and only on the last turn or where there is some
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{{- content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- for tool_call in (message.tool_calls or []) -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}" + _TOOL_CALL_JSON + "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}" + _QWEN_TOOL_RESULT + "{%- elif message.role != 'system' -%}"
    "{{- raise_exception('unknown role ' + message.role) -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

CHATML = (  # SmolLM2
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

LLAMA3 = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions; answer with "
    '{"name": function name, "parameters": arguments} to call one:\' -}}'
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{%- set role = 'ipython' -%}{%- else -%}{%- set role = m.role -%}{%- endif -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}"
    "{%- if m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    '{{- \'{"name": "\' + f.name + \'", "parameters": \' -}}'
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
    "{{- '}' -}}{%- endfor -%}"
    "{%- else -%}{{- m.content | trim -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

GEMMA3 = (
    "{{- bos_token -}}"
    "{%- if messages[0].role == 'system' -%}"
    "{%- set first_user_prefix = messages[0].content + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + (m.content | trim) -}}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

PHI3 = (
    "{%- for m in messages -%}"
    "{{- '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
)

DEEPSEEK_R1 = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- '<|User|>' + m.content -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|Assistant|>' + (content | trim) + '<|end_of_sentence|>' -}}"
    "{%- elif m.role != 'system' -%}{{- raise_exception('unknown role ' + m.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|Assistant|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    """A chat-template family: its template and the tokens a tokenizer must know for it."""

    name: str
    template: str | None  # None: the tiny tokenizer's own
    specials: tuple[str, ...] = ()  # added as special tokens
    added: tuple[str, ...] = ()  # added as plain (non-special) tokens, e.g. qwen's <think> and <tool_call>
    eos: str | None = None
    bos: str | None = None


_QWEN_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("tiny", None),
        Family("chatml", CHATML, ("<|im_start|>", "<|im_end|>"), eos="<|im_end|>"),
        Family("qwen2.5", QWEN25, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), _QWEN_ADDED, eos="<|im_end|>"),
        Family("qwen3", QWEN3, ("<|im_start|>", "<|im_end|>", "<|endoftext|>"), _QWEN_ADDED, eos="<|im_end|>"),
        Family(
            "llama3",
            LLAMA3,
            ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            eos="<|eot_id|>",
            bos="<|begin_of_text|>",
        ),
        Family("gemma3", GEMMA3, ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), eos="<eos>", bos="<bos>"),
        Family(
            "phi3", PHI3, ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|endoftext|>"), eos="<|endoftext|>"
        ),
        Family(
            "deepseek_r1",
            DEEPSEEK_R1,
            ("<|begin_of_sentence|>", "<|User|>", "<|Assistant|>", "<|end_of_sentence|>"),
            ("<think>", "</think>"),
            eos="<|end_of_sentence|>",
            bos="<|begin_of_sentence|>",
        ),
    )
}


def family_tokenizer(name: str) -> Any:
    """roll's tiny character-level tokenizer with family `name`'s special tokens, eos/bos and chat template
    (built locally, nothing downloaded). Text outside the added tokens is one id per character."""
    from roll_core.models import build_tiny_tokenizer

    if name not in FAMILIES:
        raise ValueError(f"unknown chat-template family {name!r}; known: {', '.join(FAMILIES)}")
    fam = FAMILIES[name]
    tok = build_tiny_tokenizer()
    if fam.specials:
        tok.add_special_tokens({"additional_special_tokens": list(fam.specials)})
    if fam.added:
        tok.add_tokens(list(fam.added))
    if fam.eos:
        tok.eos_token = fam.eos
    if fam.bos:
        tok.bos_token = fam.bos
    if fam.template is not None:
        tok.chat_template = fam.template
    return tok
