"""The OpenAI-compatible endpoint through the real `openai` client: plain and multi-turn chats whose trajectory is
exactly the ids the engine sampled (the hf engine on the tiny model), streaming, tool calls in the OpenAI format,
errors in OpenAI's error shape, and history rewrites counted and handled.

Tool calls use a scripted request engine (it answers with the tokens of a given text): a random tiny model does
not write tool-call syntax; the learning run in tests/e2e/test_openai_agent.py uses the real engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Future
from typing import Any

import openai
import pytest

from roll_core.agentic.agent_sessions import AgentSessions, SessionLimits
from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.openai_server import HermesToolParser, OpenAIServer, tool_parser
from roll_core.interfaces import Request, RequestOutput, SamplingParams, UnsupportedSamplingError
from roll_core.models import build_tiny_tokenizer

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


class ScriptedEngine:
    """Answers each request with the tokens of the next scripted text (log-prob -0.25 each); refuses constraints."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.25] * len(ids), "stop"))
        return fut

    def abort(self, request_id: str) -> bool:
        return False

    def check_sampling(self, params: SamplingParams) -> None:
        if params.structured is not None:
            raise UnsupportedSamplingError("scripted: no structured outputs")


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


def _serve(infer: Any, tokenizer: Any, **kwargs: Any) -> tuple[AgentSessions, OpenAIServer]:
    sessions = AgentSessions(
        infer,
        TurnTemplate(tokenizer),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        HermesToolParser(),
        **kwargs,
    )
    server = OpenAIServer(sessions)
    server.start()
    return sessions, server


def _post(url: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _client(server: OpenAIServer, sid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url(sid), api_key="unused", max_retries=0)


PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
RETRY = {"x-stainless-retry-count": "1"}  # what the openai clients send on a retry (0 on a first attempt)


def test_multi_turn_chat_records_exactly_the_sampled_ids(hf_engine: Any, tokenizer: Any) -> None:
    infer = Recorder(hf_engine)
    sessions, server = _serve(infer, tokenizer)
    try:
        sessions.open("ep0", PARAMS, SessionLimits(max_turns=4, max_tokens_per_turn=8, max_context_length=512))
        client = _client(server, "ep0")
        assert [m.id for m in client.models.list().data] == ["roll"]
        messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 7"}]
        first = client.chat.completions.create(model="anything", messages=messages, max_tokens=6)
        messages += [first.choices[0].message, {"role": "user", "content": "Again"}]  # the client's own object
        second = client.chat.completions.create(model="anything", messages=messages)
        messages += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Last"}]
        chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
        assert _post(server.reward_url("ep0"), b'{"reward": 0.75}') == (200, {"session": "ep0", "reward": 0.75})
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
    sessions, server = _serve(ScriptedEngine(tokenizer, script), tokenizer)
    try:
        sessions.open("t", PARAMS, SessionLimits(max_context_length=1024))
        client = _client(server, "t")
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
    sessions, server = _serve(ScriptedEngine(tokenizer, [text]), tokenizer)
    try:
        sessions.open("p", PARAMS, SessionLimits(max_context_length=1024))
        r = _client(server, "p").chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        sessions.close("p")
    finally:
        server.close()
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text


def test_the_served_text_ends_before_a_stop_sequence_and_the_trajectory_keeps_it(tokenizer: Any) -> None:
    """OpenAI's contract: `content` stops before the stop sequence (a ReAct loop would add its own "Observation:"
    after ours); the engine keeps the completing token, and so does the trajectory."""
    script = ["Thought: search\nAction: search[x]\nObservation:", "Thought: done"]
    sessions, server = _serve(ScriptedEngine(tokenizer, script), tokenizer)
    try:
        sessions.open("s", PARAMS, SessionLimits(max_context_length=1024))
        client = _client(server, "s")
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
    sessions, server = _serve(ScriptedEngine(tokenizer, ["a", "b", "c", "d"]), tokenizer)
    try:
        sessions.open("e", PARAMS, SessionLimits(max_turns=1, max_context_length=1024))
        client = _client(server, "e")
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.NotFoundError) as nf:
            _client(server, "nope").chat.completions.create(model="m", messages=hi)
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
        status, body = _post(server.reward_url("e"), b'{"reward": "high"}')
        assert status == 400 and body["error"]["code"] == "invalid_reward"
        status, body = _post(server.base_url("e") + "/chat/completions", b"{")
        assert status == 400 and body["error"]["code"] == "invalid_json"
        sessions.open("gone", PARAMS, SessionLimits())
        sessions.get("gone").closed = True  # as after an episode timeout, before the collector drops it
        with pytest.raises(openai.APIStatusError) as gone:
            _client(server, "gone").chat.completions.create(model="m", messages=hi)
        assert gone.value.status_code == 410 and gone.value.code == "session_closed"
    finally:
        server.close()


class SlowScriptedEngine(ScriptedEngine):
    """ScriptedEngine whose answers take `delay` seconds (from a thread), counting its requests."""

    def __init__(self, tokenizer: Any, texts: list[str], delay: float) -> None:
        super().__init__(tokenizer, texts)
        self.delay, self.requests = delay, 0

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        import threading
        import time

        self.requests += 1
        done = super().submit_request(request, route_key)
        fut: Future = Future()
        threading.Thread(target=lambda: (time.sleep(self.delay), fut.set_result(done.result())), daemon=True).start()
        return fut


def test_a_session_closed_while_its_turn_is_prepared_runs_no_request(tokenizer: Any) -> None:
    """close() between the turn's checks and its submit (the template renders meanwhile) saw no request to abort:
    the request ran its whole budget after the episode ended. Now the turn notices and submits nothing."""
    import threading

    engine = SlowScriptedEngine(tokenizer, ["late"], delay=0.05)
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), lambda ids: tokenizer.decode(ids), HermesToolParser())
    sessions.open("c", PARAMS, SessionLimits(max_context_length=1024))
    session = sessions.get("c")
    rendering, release = threading.Event(), threading.Event()
    real = session.context_for

    def slow_context(turn: Any) -> Any:
        rendering.set()
        release.wait(5)
        return real(turn)

    session.context_for = slow_context
    from roll_core.agentic.agent_sessions import ChatTurn, SessionError

    errors: list[Exception] = []

    def chat() -> None:
        try:
            sessions.chat("c", ChatTurn(messages=[{"role": "user", "content": "hi"}]))
        except Exception as exc:
            errors.append(exc)

    worker = threading.Thread(target=chat)
    worker.start()
    assert rendering.wait(5)
    sessions.close("c")
    release.set()
    worker.join(5)
    assert engine.requests == 0 and isinstance(errors[0], SessionError) and errors[0].status == 410


@pytest.mark.parametrize("policy", ["restart", "refuse"])
def test_a_client_retry_gets_the_recorded_reply_and_keeps_the_trajectory(tokenizer: Any, policy: str) -> None:
    """The openai client times out on a slow turn and re-sends it: the retry waits for the running turn and gets
    its reply, so the agent sees exactly the turn that is trained on; a retry after the reply arrived gets it again.
    (The retry was a history rewrite: `restart` dropped the turns the agent had seen, `refuse` answered 400.)"""
    engine = SlowScriptedEngine(tokenizer, ["one", "two", "three"], delay=0.05)
    sessions, server = _serve(engine, tokenizer, on_rewrite=policy)
    try:
        sessions.open("r", PARAMS, SessionLimits(max_context_length=1024))
        patient = _client(server, "r")
        messages: list[Any] = [{"role": "user", "content": "a"}]
        r1 = patient.chat.completions.create(model="m", messages=messages)
        messages += [r1.choices[0].message, {"role": "user", "content": "b"}]
        engine.delay = 1.0  # the next turn outlasts the client's timeout: it retries while the turn runs
        hasty = openai.OpenAI(base_url=server.base_url("r"), api_key="unused", max_retries=3, timeout=0.4)
        r2 = hasty.chat.completions.create(model="m", messages=messages)
        # A client's retry (attempt 1, as the openai client marks it) that arrives after the reply was recorded.
        again = patient.chat.completions.create(model="m", messages=messages, extra_headers=RETRY)
        engine.delay = 0.05
        messages += [r2.choices[0].message, {"role": "user", "content": "c"}]
        r3 = patient.chat.completions.create(model="m", messages=messages)
        session = sessions.close("r")
    finally:
        server.close()
    assert r2.choices[0].message.content == again.choices[0].message.content == "two"
    assert r3.choices[0].message.content == "three" and engine.requests == 3  # one sample per turn, no more
    assert session.replays >= 2 and session.rewrites == 0 and session.dropped_turns == 0
    trained = tokenizer.decode([t for t, m in zip(session.traj.tokens, session.traj.mask) if m])
    assert trained == "one</s>two</s>three</s>" and session.traj.turns == 3


@pytest.mark.parametrize("policy", ["restart", "refuse"])
def test_history_rewrites_are_counted_and_handled(tokenizer: Any, policy: str) -> None:
    sessions, server = _serve(ScriptedEngine(tokenizer, ["one", "two", "three"]), tokenizer, on_rewrite=policy)
    try:
        sessions.open("h", PARAMS, SessionLimits(max_context_length=1024))
        client = _client(server, "h")
        r1 = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ONE"}]  # not what was sampled
        messages = [*edited, {"role": "user", "content": "b"}]
        if policy == "refuse":
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(model="m", messages=messages)
            assert exc.value.code == "history_rewritten"
            messages = [{"role": "user", "content": "a"}, r1.choices[0].message, {"role": "user", "content": "b"}]
        client.chat.completions.create(model="m", messages=messages)
        session = sessions.close("h")
    finally:
        server.close()
    assert session.rewrites == 1
    traj = session.traj
    if policy == "restart":  # the rewritten history is the new prompt; the turn sampled before it is not trained
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert traj.prompt_ids == list(prompt) and traj.turns == 1 and session.dropped_turns == 1
        assert tokenizer.decode([t for t, m in zip(traj.tokens, traj.mask) if m]) == "two</s>"
    else:  # refused: the session went on from the unchanged conversation
        assert traj.turns == 2 and session.dropped_turns == 0
        assert tokenizer.decode([t for t, m in zip(traj.tokens, traj.mask) if m]) == "one</s>two</s>"


def test_response_format_constrains_the_turn_and_keeps_it_out_of_the_loss(hf_engine: Any, tokenizer: Any) -> None:
    """json_schema on the hf engine: the reply is valid JSON of the schema; the trainer cannot replay a per-turn
    constraint inside a trajectory, so the turn is context (mask 0), counted."""
    infer = Recorder(hf_engine)
    infer.check_sampling = hf_engine.engine.check_sampling  # type: ignore[method-assign]  # RequestsOf has none
    sessions, server = _serve(infer, tokenizer)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    try:
        sessions.open("j", PARAMS, SessionLimits(max_tokens_per_turn=24, max_context_length=512))
        fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
        r = _client(server, "j").chat.completions.create(
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


def test_a_repeated_request_that_is_no_retry_gets_a_new_sample_and_counts_as_a_turn(tokenizer: Any) -> None:
    """An agent that asks the same messages again (another sample, "retry until it parses") with a client that does
    not retry: each request is sampled (the repeat restarts the trajectory), and max_turns stops the loop. It got
    the first reply back forever, replays never counted, and the episode looped until its timeout."""
    engine = SlowScriptedEngine(tokenizer, ["not json", '{"ok": 1}', "c", "d"], delay=0.0)
    sessions, server = _serve(engine, tokenizer)
    try:
        sessions.open("p", PARAMS, SessionLimits(max_turns=3, max_context_length=1024))
        client = _client(server, "p")
        hi = [{"role": "user", "content": "Answer in JSON"}]
        answers = [client.chat.completions.create(model="m", messages=hi).choices[0].message.content for _ in "abc"]
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=hi)
        assert exc.value.code == "max_turns_exceeded"
        session = sessions.close("p")
    finally:
        server.close()
    assert answers == ["not json", '{"ok": 1}', "c"] and engine.requests == 3 and session.replays == 0
    assert session.requests == 3 and session.traj.turns == 1 and session.dropped_turns == 2  # trained: the last


def test_retries_of_one_request_are_capped(tokenizer: Any) -> None:
    """A client that retries a request forever gets the recorded reply at most max_turns times, then HTTP 400."""
    engine = SlowScriptedEngine(tokenizer, ["one", "two"], delay=0.0)
    sessions, server = _serve(engine, tokenizer)
    try:
        sessions.open("c", PARAMS, SessionLimits(max_turns=2, max_context_length=1024))
        client = _client(server, "c")
        hi = [{"role": "user", "content": "a"}]
        first = client.chat.completions.create(model="m", messages=hi).choices[0].message.content
        again = [
            client.chat.completions.create(model="m", messages=hi, extra_headers=RETRY).choices[0].message.content
            for _ in range(2)
        ]
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=hi, extra_headers=RETRY)
        assert exc.value.code == "too_many_retries"
        session = sessions.close("c")
    finally:
        server.close()
    assert first == "one" and again == ["one", "one"] and engine.requests == 1 and session.replays == 2


def test_a_closed_session_answers_410_to_requests_and_reward_reports(tokenizer: Any) -> None:
    """close() (the episode timed out) forgot the session: its agent's next request got 404 session_not_found,
    not the documented 410 session_closed; an id never opened is still 404."""
    sessions, server = _serve(ScriptedEngine(tokenizer, ["a"]), tokenizer)
    try:
        sessions.open("x", PARAMS, SessionLimits(max_context_length=1024))
        hi = [{"role": "user", "content": "hi"}]
        r = _client(server, "x").chat.completions.create(model="m", messages=hi)
        sessions.close("x")
        with pytest.raises(openai.APIStatusError) as gone:
            _client(server, "x").chat.completions.create(
                model="m", messages=[*hi, r.choices[0].message, {"role": "user", "content": "more"}]
            )
        assert gone.value.status_code == 410 and gone.value.code == "session_closed"
        status, body = _post(server.reward_url("x"), b'{"reward": 1.0}')
        assert status == 410 and body["error"]["code"] == "session_closed"
        status, body = _post(server.reward_url("never"), b'{"reward": 1.0}')
        assert status == 404 and body["error"]["code"] == "session_not_found"
    finally:
        server.close()


def test_a_context_refusal_the_agent_recovers_from_does_not_end_the_trajectory(tokenizer: Any) -> None:
    """A request over the context limit is refused (400) and marks the trajectory ended there; the agent truncates
    the observation and goes on, its later turns are served, and the mark goes: the episode did not end at the
    limit, so a later crash is the program's failure (the mark stayed, and the crash was trained with reward 0)."""
    from roll_core.pipelines.collectors.agents import _outcome

    sessions, server = _serve(ScriptedEngine(tokenizer, ["one", "two", "three"]), tokenizer)
    try:
        sessions.open("o", PARAMS, SessionLimits(max_turns=8, max_tokens_per_turn=16, max_context_length=200))
        client = _client(server, "o")
        messages: list[Any] = [{"role": "user", "content": "run ls"}]
        messages.append(client.chat.completions.create(model="m", messages=messages).choices[0].message)
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=[*messages, {"role": "user", "content": "file " * 400}])
        assert exc.value.code == "context_length_exceeded" and sessions.get("o").traj.end == "max_context"
        assert _outcome({"error": RuntimeError("400")}, sessions.get("o"), timed_out=False) == (0.0, None, "")
        messages.append({"role": "user", "content": "file (truncated)"})
        r = client.chat.completions.create(model="m", messages=messages)
        session = sessions.close("o")
    finally:
        server.close()
    assert r.choices[0].message.content == "two" and session.traj.turns == 2 and session.traj.end == ""
    assert _outcome({"error": KeyError("bug")}, session, timed_out=False)[1] == "error"
    assert session.finish(0.0, "env_error").end == "env_error"


def _request(url: str, method: str, body: bytes | None = None) -> tuple[int, str, Any]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
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
    sessions, server = _serve(ScriptedEngine(tokenizer, []), tokenizer)
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


def test_request_fields_are_read_as_openai_defines_them(tokenizer: Any) -> None:
    """`max_completion_tokens: null` beside `max_tokens` (clients that send every field): max_tokens holds (it was
    ignored: the turn ran the session's whole budget); `stream` must be a JSON boolean ("false" streamed)."""
    from roll_core.agentic.openai_server import chat_turn

    hi = [{"role": "user", "content": "hi"}]
    assert chat_turn({"messages": hi, "max_completion_tokens": None, "max_tokens": 3}).max_tokens == 3
    assert chat_turn({"messages": hi, "max_completion_tokens": 2, "max_tokens": 3}).max_tokens == 2
    infer = Recorder(ScriptedEngine(tokenizer, ["a", "b"]))
    sessions, server = _serve(infer, tokenizer)
    try:
        sessions.open("f", PARAMS, SessionLimits(max_context_length=1024))
        url = server.base_url("f") + "/chat/completions"
        status, _ = _post(url, json.dumps({"messages": hi, "max_completion_tokens": None, "max_tokens": 1}).encode())
        assert status == 200 and infer.calls[0][0].params.max_new_tokens == 1
        for bad in ("false", 1):
            status, body = _post(url, json.dumps({"messages": hi, "stream": bad}).encode())
            assert (status, body["error"]["code"]) == (400, "invalid_parameter"), bad
        assert len(infer.calls) == 1  # refused before sampling
    finally:
        server.close()


def test_a_client_leaving_a_streamed_turn_logs_no_error_and_keeps_the_turn(
    tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The client times out while the turn runs and closes the connection: writing the stream failed with an
    unhandled ClientConnectionResetError (a server error with a traceback in the log). The turn stays recorded and
    the client's retry gets it."""
    import logging
    import time

    engine = SlowScriptedEngine(tokenizer, ["slow one"], delay=0.6)
    sessions, server = _serve(engine, tokenizer)
    try:
        sessions.open("d", PARAMS, SessionLimits(max_context_length=1024))
        hasty = openai.OpenAI(base_url=server.base_url("d"), api_key="unused", max_retries=0, timeout=0.1)
        hi = [{"role": "user", "content": "hi"}]
        with caplog.at_level(logging.DEBUG), pytest.raises(openai.APITimeoutError):
            list(hasty.chat.completions.create(model="m", messages=hi, stream=True))
        session = sessions.get("d")
        deadline = time.monotonic() + 5
        while session.traj.turns == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # the handler writes the stream to the closed connection now
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        retried = _client(server, "d").chat.completions.create(model="m", messages=hi, stream=True, extra_headers=RETRY)
        text = "".join(c.choices[0].delta.content or "" for c in retried if c.choices)
        sessions.close("d")
    finally:
        server.close()
    assert not errors, [r.getMessage() for r in errors]
    assert session.traj.turns == 1 and text == "slow one" and engine.requests == 1 and session.replays == 1


class PreemptingEngine(ScriptedEngine):
    """ScriptedEngine that aborts its first `aborts` requests on its own after `partial` of the text's tokens."""

    def __init__(self, tokenizer: Any, texts: list[str], aborts: int, partial: int) -> None:
        super().__init__(tokenizer, texts)
        self.aborts, self.partial, self.requests = aborts, partial, []

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.requests.append(request)
        if len(self.requests) > self.aborts:
            return super().submit_request(request, route_key)
        ids = self.tokenizer(self.texts[0], add_special_tokens=False)["input_ids"][: self.partial]
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), "abort"))
        return fut


def test_a_turn_the_engine_aborts_on_its_own_is_resumed_and_a_refusal_is_a_503(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own abort (preemption) ended the session's trajectory (`abort`) and answered 410 session_closed
    to an agent whose session was open, which then failed as if it had erred. The turn is resumed from its partial
    output within its budget; an engine that aborts every time without a token gets HTTP 503 engine_aborted, the
    conversation unchanged and the session still open."""
    from roll_core.agentic.agent_sessions import ChatTurn, SessionError

    hi = ChatTurn(messages=[{"role": "user", "content": "hi"}])
    text_ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    engine = PreemptingEngine(tokenizer, ["hello there"], aborts=1, partial=1)
    sessions = AgentSessions(engine, TurnTemplate(tokenizer), lambda ids: tokenizer.decode(ids), HermesToolParser())
    sessions.open("p", PARAMS, SessionLimits(max_tokens_per_turn=16, max_context_length=1024))
    reply = sessions.chat("p", hi)
    session = sessions.get("p")
    first, resumed = engine.requests
    assert resumed.prompt_ids == first.prompt_ids + text_ids[:1]
    assert resumed.params.max_new_tokens == first.params.max_new_tokens - 1
    assert reply.token_ids == text_ids[:1] + text_ids + [tokenizer.eos_token_id]  # the partial output is kept
    assert (session.resumed, session.traj.turns, session.traj.end, session.closed) == (1, 1, "", False)

    from roll_core import idle_aborts
    from roll_core.agentic.agent_sessions import MAX_IDLE_ABORTS

    # the waits between a refused turn's tries (test_openai_server_refusals.py) are not this test's subject
    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_MAX_S", 0.001)
    refusing = PreemptingEngine(tokenizer, ["x"], aborts=10**6, partial=0)
    sessions = AgentSessions(refusing, TurnTemplate(tokenizer), lambda ids: tokenizer.decode(ids), HermesToolParser())
    sessions.open("r", PARAMS, SessionLimits(max_tokens_per_turn=16, max_context_length=1024))
    with pytest.raises(SessionError) as err:
        sessions.chat("r", hi)
    assert (err.value.status, err.value.code, len(refusing.requests)) == (503, "engine_aborted", MAX_IDLE_ABORTS)
    session = sessions.get("r")
    # The conversation is unchanged and the session open; the trajectory ends there, untrained, unless a turn follows
    # (test_openai_server_refusals.py).
    assert (session.traj.turns, session.traj.end, session.traj.untrained, session.closed) == (0, "abort", True, False)
