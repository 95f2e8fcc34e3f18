"""The OpenAI-compatible endpoint through the real `openai` client: plain and multi-turn chats whose trajectory is
exactly the ids the engine sampled (the hf engine on the tiny model), streaming, tool calls in the OpenAI format,
stop sequences, constrained replies (response_format), request fields read as OpenAI defines them, and errors in
OpenAI's error shape. A session's turns over time (retries, history rewrites, closes, preemption):
test_openai_server_sessions.py.

Tool calls use a scripted request engine (roll_core.testing.agent_endpoint.ScriptedTextEngine: it answers with the
tokens of a given text): a random tiny model does not write tool-call syntax; the learning run in
tests/e2e/test_openai_agent.py uses the real engine."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from roll_core.agentic.agent_sessions import SessionLimits
from roll_core.agentic.openai_server import HermesToolParser, tool_parser
from roll_core.interfaces import Request, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.testing.agent_endpoint import ScriptedTextEngine, openai_client, post_json, serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


class Recorder:
    """The InferGroup request API over an engine, keeping every request and its output."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Any:
        fut = self.inner.submit_request(request, route_key)
        self.calls.append((request, fut))
        return fut

    def abort(self, request_id: str) -> bool:
        return self.inner.abort(request_id)

    def check_sampling(self, params: SamplingParams) -> None:
        self.inner.check_sampling(params)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def hf_engine() -> Any:
    from roll_core.models import resolve_model_path
    from roll_core.testing.infer_engine import RequestsOf
    from roll_engines.infer.hf import HFInferEngine

    engine = HFInferEngine(resolve_model_path("builtin:tiny"), max_new_tokens=16, seed=0)
    yield RequestsOf(engine)
    engine.shutdown()


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)


def test_multi_turn_chat_records_exactly_the_sampled_ids(hf_engine: Any, tokenizer: Any) -> None:
    infer = Recorder(hf_engine)
    sessions, server = serve(infer, tokenizer)
    try:
        sessions.open("ep0", PARAMS, SessionLimits(max_turns=4, max_tokens_per_turn=8, max_context_length=512))
        client = openai_client(server, "ep0")
        assert [m.id for m in client.models.list().data] == ["roll"]
        messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 7"}]
        first = client.chat.completions.create(model="anything", messages=messages, max_tokens=6)
        messages += [first.choices[0].message, {"role": "user", "content": "Again"}]  # the client's own object
        second = client.chat.completions.create(model="anything", messages=messages)
        messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Last"}]
        chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
        assert post_json(server.reward_url("ep0"), b'{"reward": 0.75}') == (200, {"session": "ep0", "reward": 0.75})
        session = sessions.close("ep0")
    finally:
        server.close()
    outs = [f.result() for _, f in infer.calls]
    assert len(outs) == 3 and all(o.finish_reason in ("stop", "length") for o in outs)
    assert len(outs[0].token_ids) <= 6 and len(outs[1].token_ids) <= 8  # max_tokens, then the session's limit
    for reply, out in zip((first, second), outs):
        assert reply.choices[0].message.content == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert reply.usage.completion_tokens == len(out.token_ids)
        assert reply.usage.prompt_tokens == len(out.prompt_ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == tokenizer.decode(outs[2].token_ids, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    traj = session.traj
    # The prompt is the template's rendering of the first request; each later engine request saw exactly the
    # trajectory so far, and the trajectory holds each turn's sampled ids and log-probs, mask 1 on them only.
    first_prompt = tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert traj.prompt_ids == list(first_prompt) == outs[0].prompt_ids
    starts = []
    for k, out in enumerate(outs):
        start = len(out.prompt_ids) - len(traj.prompt_ids)
        starts.append(start)
        assert out.prompt_ids == traj.prompt_ids + traj.tokens[:start]
        n = len(out.token_ids)
        assert traj.tokens[start : start + n] == out.token_ids
        assert traj.logprobs[start : start + n] == out.logprobs
        assert traj.mask[start : start + n] == [1] * n and traj.turn_ids[start : start + n] == [k] * n
    assert sum(traj.mask) == sum(len(o.token_ids) for o in outs)  # template ids between turns have mask 0
    between = tokenizer.decode(traj.tokens[starts[0] + len(outs[0].token_ids) : starts[1]])
    assert between.endswith("<|user|>Again\n<|assistant|>")
    assert session.reward == 0.75 and session.rewrites == 0 and traj.turns == 3
    assert len(set(traj.state_keys)) == 3  # one state per turn (the conversation sent), for step-level estimators


def test_tool_calls_in_the_openai_format(tokenizer: Any) -> None:
    script = [
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
        "The sum is 7.",
        "<tool_call>{not json}</tool_call>",
    ]
    sessions, server = serve(ScriptedTextEngine(tokenizer, script), tokenizer)
    try:
        sessions.open("t", PARAMS, SessionLimits(max_context_length=1024))
        client = openai_client(server, "t")
        messages: list[Any] = [{"role": "user", "content": "What is 3+4?"}]
        r1 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        msg = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and msg.content == "Let me add."
        (call,) = msg.tool_calls
        assert call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
        messages += [msg, {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        r2 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert r2.choices[0].message.content == "The sum is 7." and r2.choices[0].message.tool_calls is None
        messages += [r2.choices[0].message, {"role": "user", "content": "Once more"}]
        r3 = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        assert r3.choices[0].finish_reason == "stop" and r3.choices[0].message.content == script[2]
        session = sessions.close("t")
    finally:
        server.close()
    assert session.rewrites == 0 and session.traj.turns == 3  # the echoed tool-call message matched the sampled one
    assert session.traj.tool_calls == 1 and session.invalid_tool_calls == 1
    assert tokenizer.decode(session.traj.tokens).count("<|tool|>7\n") == 1  # the tool result went in as context


def test_a_request_without_tools_gets_its_text_back_whatever_it_holds(tokenizer: Any) -> None:
    """No `tools` in the request: a reply that holds the parser's tool-call syntax is plain content with
    finish_reason stop, as OpenAI and vLLM answer (it came back as a tool call the client never offered)."""
    text = 'Sure: <tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    sessions, server = serve(ScriptedTextEngine(tokenizer, [text]), tokenizer)
    try:
        sessions.open("p", PARAMS, SessionLimits(max_context_length=1024))
        r = openai_client(server, "p").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        sessions.close("p")
    finally:
        server.close()
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text


def test_the_served_text_ends_before_a_stop_sequence_and_the_trajectory_keeps_it(tokenizer: Any) -> None:
    """OpenAI's contract: `content` stops before the stop sequence (a ReAct loop would add its own "Observation:"
    after ours); the engine keeps the completing token, and so does the trajectory."""
    script = ["Thought: search\nAction: search[x]\nObservation:", "Thought: done"]
    sessions, server = serve(ScriptedTextEngine(tokenizer, script), tokenizer)
    try:
        sessions.open("s", PARAMS, SessionLimits(max_context_length=1024))
        client = openai_client(server, "s")
        messages: list[Any] = [{"role": "user", "content": "find x"}]
        r1 = client.chat.completions.create(model="m", messages=messages, stop=["Observation:"])
        assert r1.choices[0].message.content == "Thought: search\nAction: search[x]\n"
        messages += [r1.choices[0].message, {"role": "user", "content": "Observation: x is 3"}]
        r2 = client.chat.completions.create(model="m", messages=messages, stop=["Observation:"])
        assert r2.choices[0].message.content == "Thought: done"  # no stop string in it: nothing cut
        session = sessions.close("s")
    finally:
        server.close()
    assert session.rewrites == 0  # the trimmed message echoed back matches what was recorded
    assert "Action: search[x]\nObservation:" in tokenizer.decode(session.traj.tokens)


def test_parsers() -> None:
    parse = tool_parser("hermes")
    two = parse(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>\n<tool_call>{"name": "g"}</tool_call>'
    )
    assert two.content is None and [c["name"] for c in two.calls] == ["f", "g"] and two.invalid == 0
    assert json.loads(two.calls[0]["arguments"]) == {"x": 1} and json.loads(two.calls[1]["arguments"]) == {}
    cut = parse('ok <tool_call>{"name": "f", "argu')  # cut off by max_tokens
    assert cut.content == 'ok <tool_call>{"name": "f", "argu' and cut.calls == [] and cut.invalid == 1
    assert tool_parser("none")("<tool_call>{}</tool_call>").calls == []
    with pytest.raises(ValueError, match="module:Class"):
        tool_parser("mistral")


@pytest.mark.parametrize("arguments", ["5", '"[1]"', "[1]", "null", '"5"', '"{bad"'])
def test_hermes_arguments_that_are_not_a_json_object_are_invalid_calls(arguments: str) -> None:
    """OpenAI's `arguments` is the JSON text of an object: `"arguments": 5` was served as the call f("5") and
    `"[1]"` as f([1]), neither counted invalid. Such a block is no call: it stays content and counts invalid."""
    text = f'Try <tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    parsed = tool_parser("hermes")(text)
    assert parsed.calls == [] and parsed.content == text and parsed.invalid == 1
    good = '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call>'
    both = tool_parser("hermes")(text + good)
    assert [c["name"] for c in both.calls] == ["g"] and both.invalid == 1 and both.content == text


@pytest.mark.parametrize(
    ("text", "invalid", "calls"),
    [
        ("<tool_call>bad</tool_call> stray </tool_call>", 1, 0),  # the stray close cancelled the bad block: 0
        ("</tool_call> <tool_call>bad</tool_call>", 1, 0),
        ('<tool_call>bad</tool_call></tool_call><tool_call>{"name": "f"}</tool_call></tool_call>', 1, 1),
        ('<tool_call>{"name": "f"}</tool_call> </tool_call> <tool_call>{"na', 1, 1),  # the cut-off one
        ("<tool_call>a <tool_call>b", 2, 0),
    ],
)
def test_hermes_counts_invalid_blocks_despite_stray_closing_markers(text: str, invalid: int, calls: int) -> None:
    parsed = tool_parser("hermes")(text)
    assert (parsed.invalid, len(parsed.calls)) == (invalid, calls)


def test_replies_keep_the_tool_call_markers_a_tokenizer_marks_special() -> None:
    """A tokenizer whose `<tool_call>` / `</tool_call>` are special tokens (the decode without special tokens drops
    them): the reply text keeps them and the call parses; other special tokens (EOS) still go."""
    from transformers import AddedToken

    from roll_core.agentic.openai_server import text_decoder

    tok = build_tiny_tokenizer()
    plain = text_decoder(tok, HermesToolParser.markers)
    reply = 'ok <tool_call>{"name": "f"}</tool_call>'
    eos = [tok.eos_token_id]
    assert plain(tok.encode(reply, add_special_tokens=False) + eos) == tok.decode(
        tok.encode(reply, add_special_tokens=False) + eos, skip_special_tokens=True
    )  # markers that are not special: the plain decode, unchanged
    tok.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    ids = tok.encode(reply, add_special_tokens=False) + eos
    assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert "<tool_call>" not in tok.decode(ids, skip_special_tokens=True)  # what the collector decoded before
    text = text_decoder(tok, HermesToolParser.markers)(ids)
    assert tok.eos_token not in text
    parsed = HermesToolParser()(text)
    assert [c["name"] for c in parsed.calls] == ["f"] and parsed.content.strip() == "ok"


def test_errors_are_openai_errors_and_end_nothing_but_the_request(tokenizer: Any) -> None:
    sessions, server = serve(ScriptedTextEngine(tokenizer, ["a", "b", "c", "d"]), tokenizer)
    try:
        sessions.open("e", PARAMS, SessionLimits(max_turns=1, max_context_length=1024))
        client = openai_client(server, "e")
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.NotFoundError) as nf:
            openai_client(server, "nope").chat.completions.create(model="m", messages=hi)
        assert nf.value.code == "session_not_found"
        for bad, code in [
            ({"n": 2}, "unsupported_parameter"),
            ({"presence_penalty": 0.5}, "unsupported_parameter"),
            ({"tool_choice": "required", "tools": TOOLS}, "unsupported_parameter"),
            ({"response_format": {"type": "json_object"}}, "unsupported_response_format"),
            ({"max_tokens": 0}, "invalid_parameter"),
            ({"stop": 5}, "invalid_parameter"),  # was a 500, which clients retry
            ({"stream": True, "stream_options": "yes"}, "invalid_parameter"),  # was a stream cut after a 200
        ]:
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(model="m", messages=hi, **bad)
            assert exc.value.code == code, (bad, exc.value)
        with pytest.raises(openai.BadRequestError, match="role"):
            client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
        r = client.chat.completions.create(model="m", messages=hi)  # the session still works after refusals
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=[*hi, r.choices[0].message, *hi])
        assert exc.value.code == "max_turns_exceeded"
        status, body = post_json(server.reward_url("e"), b'{"reward": "high"}')
        assert status == 400 and body["error"]["code"] == "invalid_reward"
        status, body = post_json(server.base_url("e") + "/chat/completions", b"{")
        assert status == 400 and body["error"]["code"] == "invalid_json"
        sessions.open("gone", PARAMS, SessionLimits())
        sessions.get("gone").closed = True  # as after an episode timeout, before the collector drops it
        with pytest.raises(openai.APIStatusError) as gone:
            openai_client(server, "gone").chat.completions.create(model="m", messages=hi)
        assert gone.value.status_code == 410 and gone.value.code == "session_closed"
    finally:
        server.close()


def test_response_format_constrains_the_turn_and_keeps_it_out_of_the_loss(hf_engine: Any, tokenizer: Any) -> None:
    """json_schema on the hf engine: the reply is valid JSON of the schema; the trainer cannot replay a per-turn
    constraint inside a trajectory, so the turn is context (mask 0), counted."""
    infer = Recorder(hf_engine)
    infer.check_sampling = hf_engine.engine.check_sampling  # type: ignore[method-assign]  # RequestsOf has none
    sessions, server = serve(infer, tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    try:
        sessions.open("j", PARAMS, SessionLimits(max_tokens_per_turn=24, max_context_length=512))
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        r = openai_client(server, "j").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "n?"}], response_format=fmt
        )
        session = sessions.close("j")
    finally:
        server.close()
    if r.choices[0].finish_reason == "stop":  # complete (a cut reply is a valid prefix only)
        assert isinstance(json.loads(r.choices[0].message.content)["n"], int)
    else:
        assert r.choices[0].message.content.startswith('{"n":')
    assert session.constrained_turns == 1 and session.traj.turns == 1 and sum(session.traj.mask) == 0
    assert len(session.traj.tokens) == r.usage.completion_tokens


def _request(
    url: str, method: str, body: bytes | None = None, content_type: str = "application/json"
) -> tuple[int, str, Any]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, exc.headers.get("Content-Type", ""), json.loads(raw)
        except ValueError:
            return exc.code, exc.headers.get("Content-Type", ""), raw.decode(errors="replace")


def test_every_http_error_is_an_openai_error(tokenizer: Any) -> None:
    """A body over the size limit (was a 500 internal_error with a traceback, which clients retry), an unknown route
    or method (was aiohttp's plain text): OpenAI's error JSON with the HTTP status that says what happened."""
    sessions, server = serve(ScriptedTextEngine(tokenizer, []), tokenizer)
    try:
        sessions.open("z", PARAMS, SessionLimits(max_context_length=1024))
        url = server.base_url("z") + "/chat/completions"
        over = b'{"messages": [{"role": "user", "content": "' + b"a" * server.max_body_bytes + b'"}]}'
        for target in (url, server.reward_url("z")):
            status, kind, body = _request(target, "POST", over)
            assert (status, body["error"]["code"]) == (413, "request_too_large") and kind.startswith("application/json")
        status, _, body = _request(url, "GET")
        assert (status, body["error"]["code"]) == (405, "method_not_allowed")
        for path, method in (("/responses", "POST"), ("/models/roll", "GET")):
            status, _, body = _request(server.base_url("z") + path, method, b"{}" if method == "POST" else None)
            assert (status, body["error"]["code"]) == (404, "not_found") and "chat/completions" in body["error"][
                "message"
            ]
    finally:
        server.close()


def test_an_unknown_charset_is_a_400_and_a_handlers_bug_an_openai_500(tokenizer: Any, caplog: Any) -> None:
    """A body whose Content-Type names a charset Python does not know was a 500 `internal_error` logged as a bug
    on the chat route (clients retry a 500) and aiohttp's plain-text 500 on the reward route; any bug in a handler
    (here the reward's) was that plain text too instead of OpenAI's error JSON."""
    sessions, server = serve(ScriptedTextEngine(tokenizer, []), tokenizer)
    try:
        sessions.open("z", PARAMS, SessionLimits(max_context_length=1024))
        chat = (server.base_url("z") + "/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
        for url, body in (chat, (server.reward_url("z"), b'{"reward": 1}')):
            status, kind, answer = _request(url, "POST", body, "application/json; charset=nonesuch")
            assert kind.startswith("application/json"), answer
            assert (status, answer["error"]["code"]) == (400, "invalid_json")
            assert "nonesuch" in answer["error"]["message"]
        assert sessions.get("z").reward is None and sessions.get("z").requests == 0

        def broken(value: Any) -> float:
            raise KeyError("a bug")

        sessions.get("z").set_reward = broken  # type: ignore[method-assign]
        status, kind, answer = _request(server.reward_url("z"), "POST", b'{"reward": 1}')
        assert kind.startswith("application/json"), answer
        assert (status, answer["error"]["code"], answer["error"]["type"]) == (500, "internal_error", "server_error")
        assert "KeyError" in answer["error"]["message"] and "reward failed" in caplog.text
    finally:
        server.close()


def test_request_fields_are_read_as_openai_defines_them(tokenizer: Any) -> None:
    """`max_completion_tokens: null` beside `max_tokens` (clients that send every field): max_tokens holds (it was
    ignored: the turn ran the session's whole budget); `stream` must be a JSON boolean ("false" streamed)."""
    from roll_core.agentic.openai_server import chat_turn

    hi = [{"role": "user", "content": "hi"}]
    assert chat_turn({"messages": hi, "max_completion_tokens": None, "max_tokens": 3}).max_tokens == 3
    assert chat_turn({"messages": hi, "max_completion_tokens": 2, "max_tokens": 3}).max_tokens == 2
    infer = Recorder(ScriptedTextEngine(tokenizer, ["a", "b"]))
    sessions, server = serve(infer, tokenizer)
    try:
        sessions.open("f", PARAMS, SessionLimits(max_context_length=1024))
        url = server.base_url("f") + "/chat/completions"
        status, _ = post_json(
            url, json.dumps({"messages": hi, "max_completion_tokens": None, "max_tokens": 1}).encode()
        )
        assert status == 200 and infer.calls[0][0].params.max_new_tokens == 1
        for bad in ("false", 1):
            status, body = post_json(url, json.dumps({"messages": hi, "stream": bad}).encode())
            assert (status, body["error"]["code"]) == (400, "invalid_parameter"), bad
        assert len(infer.calls) == 1  # refused before sampling
    finally:
        server.close()


@pytest.mark.parametrize(
    ("field", "named"),
    [
        # OpenAI answers each 400; they were 200s: usage chunks never sent, or sent for "false" (a truthy string).
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "false"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        # A user turn without text reached the template as "", a tool result matched to no call.
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": None}]}, "messages[1].content"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "7"}]},
            "messages[1].tool_call_id",
        ),
        ({"messages": [{"role": "tool", "content": "7", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
    ],
)
def test_fields_openai_refuses_are_400s_naming_the_field(tokenizer: Any, field: dict[str, Any], named: str) -> None:
    infer = Recorder(ScriptedTextEngine(tokenizer, ["a", "b"]))
    sessions, server = serve(infer, tokenizer)
    try:
        sessions.open("f", PARAMS, SessionLimits(max_context_length=1024))
        url = server.base_url("f") + "/chat/completions"
        status, body = post_json(url, json.dumps({"messages": [{"role": "user", "content": "hi"}], **field}).encode())
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error" and re.match(
            re.escape(named) + "[ :=]", body["error"]["message"]
        )
        assert infer.calls == []  # refused before sampling
        # What OpenAI takes is still served: include_usage with a stream, an empty user turn, a tool result with its id.
        chunks = list(
            openai_client(server, "f").chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": ""}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
            infer.calls[0][1].result().token_ids
        )
    finally:
        server.close()


def test_models_of_an_unknown_or_ended_session_are_refused_as_its_chat_is(tokenizer: Any) -> None:
    """`GET /sessions/{sid}/v1/models` answered 200 for any sid: an agent checking its base_url passed, then every
    chat was a 404."""
    sessions, server = serve(ScriptedTextEngine(tokenizer, []), tokenizer)
    try:
        sessions.open("m", PARAMS, SessionLimits())
        assert [m.id for m in openai_client(server, "m").models.list().data] == ["roll"]
        status, _, body = _request(server.url + "/v1/models", "GET")
        assert status == 200 and body["data"][0]["id"] == "roll"  # the session-less route serves as before
        with pytest.raises(openai.NotFoundError) as nf:
            openai_client(server, "nope").models.list()
        assert nf.value.code == "session_not_found" and nf.value.body["type"] == "invalid_request_error"
        sessions.open("gone", PARAMS, SessionLimits())
        sessions.get("gone").closed = True  # an episode timed out, the collector has not dropped it yet
        sessions.open("dropped", PARAMS, SessionLimits())
        sessions.close("dropped")
        for sid in ("gone", "dropped"):
            status, _, body = _request(server.base_url(sid) + "/models", "GET")
            assert (status, body["error"]["code"]) == (410, "session_closed"), sid
    finally:
        server.close()


def test_the_response_format_verdicts_are_a_bounded_lru(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every distinct schema an agent sent stayed cached for the server's life (an agent that puts a request id in
    its schema grew it by one entry per request)."""
    from roll_core.agentic import openai_server
    from roll_core.interfaces.inference import StructuredOutput

    monkeypatch.setattr(openai_server, "MAX_CHECKED_FORMATS", 3, raising=False)
    checks: list[Any] = []

    class Counting(ScriptedTextEngine):
        def check_sampling(self, params: SamplingParams) -> None:
            checks.append(params.structured.key())
            super().check_sampling(params)

    _, server = serve(Counting(tokenizer, []), tokenizer)
    try:
        fmts = [StructuredOutput(json_schema={"type": "object", "title": f"t{k}"}) for k in range(5)]
        for k in (0, 1, 2, 0, 3, 4):  # 0 is used again before 3 and 4 come: 1 and 2 are the least recently used
            with pytest.raises(openai_server.SessionError):
                server._check_structured(fmts[k])
        assert len(checks) == 5 and list(server._checked) == [fmts[k].key() for k in (0, 3, 4)]
        with pytest.raises(openai_server.SessionError) as again:
            server._check_structured(fmts[0])  # remembered: not asked again
        assert len(checks) == 5 and again.value.code == "unsupported_response_format"
        with pytest.raises(openai_server.SessionError):
            server._check_structured(fmts[1])  # dropped: asked again
        assert len(checks) == 6 and len(server._checked) == 3
    finally:
        server.close()
