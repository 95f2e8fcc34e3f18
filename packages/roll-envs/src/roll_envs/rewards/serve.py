"""A reference verifier service: any installed roll reward, served over the remote reward's HTTP protocol.

    python -m roll_envs.rewards.serve --reward math --port 8000 -o last_number_weight=0.5
    # then train with: env/reward=remote env.reward.url=http://<this host>:8000/score

so that a reward that needs another machine (a sandboxed code verifier, a GPU judge) scores for a run elsewhere.
`--reward` is a `roll.rewards` entry point name (`math`, `code`, `countdown`, ...; its options `-o key=value` are
checked against its config schema, the `env.reward` keys) or a class path (`my_pkg.rewards.MyReward`, options
passed to its constructor as they are). Values are YAML (`-o timeout_s=5`, `-o headers={a: b}`).

Protocol (roll_envs.rewards.remote): POST `/score` (or `/`) with `{"rows": [{"response", "answer", "prompt"?,
"metadata"?}, ...]}`; the reply is `{"rows": [{"score", "correct", "formatted", "failed"?}, ...], "counters": {...}}`
(the reward's own failure counters; a non-finite score is sent as null, which the client counts as malformed; a
row the reward could not score, its `RewardResult.failed` flag, carries `"failed": true`, which the client counts
as unscored instead of training on its fallback score: a code verifier whose sandbox broke). A
malformed request gets 400 with `{"error": message}`, more than `--max-rows` rows 413, a reward that raised 500
(the client retries 5xx). `prompt` and `metadata` reach the reward when its `score` declares them. GET `/health`
answers `{"status": "ok", "reward": name}`.

Scoring runs in `--threads` worker threads (default 1: one batch at a time, rewards need not be thread-safe), off
the event loop, so requests queue rather than time out at the socket. Binds 127.0.0.1 unless `--host` says
otherwise: the service has no authentication of its own (put it behind a proxy that checks the API key).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import logging
import math
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from roll_core.errors import ConfigError
from roll_core.interfaces import Reward
from roll_core.interfaces.tasks import reward_kwargs
from roll_envs.rewards.remote import AIOHTTP

log = logging.getLogger(__name__)

#: Largest request body accepted, bytes (16 rows of long responses fit many times over).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds `RunningServer.stop` lets requests in flight finish before cutting them off (aiohttp's own default, 60 s,
#: outlasted stop's wait: stop returned with the server thread still running a slow score).
STOP_GRACE_S = 5.0


def _web() -> Any:
    """aiohttp.web, or the one-line error naming roll-envs[remote]."""
    AIOHTTP.load()
    return importlib.import_module("aiohttp.web")


def _schema_of(name: str) -> type | None:
    """The `env/reward` config schema of the entry point `name`, if it has one."""
    from roll_envs.config import REWARD_SCHEMAS, SCHEMAS_BESIDE_CODE

    if name in REWARD_SCHEMAS:
        return REWARD_SCHEMAS[name]
    ref = SCHEMAS_BESIDE_CODE.get("env/reward", {}).get(name)
    if ref is None:
        return None
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_reward(name: str, options: Mapping[str, Any] | None = None) -> Reward:
    """The reward `name` (a `roll.rewards` entry point or a class path) built with `options`.

    An entry point with a config schema has its options checked and typed by that schema (an unknown key or a
    wrong type is a `ConfigError`), and its `check_installed()` run; anything else gets `options` as keyword
    arguments."""
    from omegaconf import OmegaConf

    from roll_core import registry

    options = dict(options or {})
    if name in registry.available("roll.rewards"):
        cls = registry.load("roll.rewards", name)
        schema = _schema_of(name)
        if schema is not None:
            try:
                cfg = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(options))
                typed = OmegaConf.to_object(cfg)
            except Exception as exc:
                known = ", ".join(f.name for f in dataclasses.fields(schema) if f.name != "_target_")
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ConfigError(f"--reward {name}: {first}; its options (-o key=value): {known}") from exc
            check = getattr(typed, "check_installed", None)
            if callable(check):
                check()
            options = {f.name: getattr(typed, f.name) for f in dataclasses.fields(typed) if f.name != "_target_"}
    elif "." in name or ":" in name:
        from hydra.utils import get_object

        try:
            cls = get_object(name.replace(":", "."))
        except Exception as exc:
            raise ConfigError(f"--reward {name}: cannot import it ({exc})") from exc
    else:
        installed = ", ".join(registry.available("roll.rewards")) or "none"
        raise ConfigError(f"--reward {name}: no such reward; installed: {installed} (or give a class path)")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigError(f"--reward {name}: {exc}") from exc


class _BadRequest(ValueError):
    """A request the protocol does not allow; `status` is the HTTP status of the reply."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_rows(body: Any, max_rows: int) -> tuple[list[str], list[str], list[str] | None, list[dict[str, Any]]]:
    """(responses, answers, prompts or None, metadata) of a request body; raises `_BadRequest` naming the fault.
    Prompts are passed only when every row has one."""
    if not isinstance(body, dict) or not isinstance(body.get("rows"), list):
        raise _BadRequest('the body must be a JSON object {"rows": [{"response": ..., "answer": ...}, ...]}')
    rows = body["rows"]
    if len(rows) > max_rows:
        raise _BadRequest(f"{len(rows)} rows in one request; this server takes at most {max_rows}", status=413)
    responses, answers, prompts, metadata = [], [], [], []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise _BadRequest(f"row {i} is not an object")
        if not isinstance(row.get("response"), str):
            raise _BadRequest(f'row {i}: "response" must be a string')
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise _BadRequest(f'row {i}: "answer" must be a string (or a number)')
        prompt, meta = row.get("prompt"), row.get("metadata")
        if prompt is not None and not isinstance(prompt, str):
            raise _BadRequest(f'row {i}: "prompt" must be a string or null')
        if meta is not None and not isinstance(meta, dict):
            raise _BadRequest(f'row {i}: "metadata" must be an object or null')
        responses.append(row["response"])
        answers.append(str(answer))
        prompts.append(prompt)
        metadata.append(meta or {})
    return responses, answers, (None if None in prompts else prompts), metadata


def make_app(reward: Reward, *, name: str = "reward", threads: int = 1, max_rows: int = 4096) -> Any:
    """The aiohttp application serving `reward` (routes and replies: the module docstring)."""
    web = _web()
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"score-{name}")

    def score(responses: list[str], answers: list[str], prompts: Any, metadata: Any) -> dict[str, Any]:
        res = reward.score(responses, answers, **reward_kwargs(reward, prompts=prompts, metadata=metadata))
        if len(res.scores) != len(responses):
            raise RuntimeError(f"the reward returned {len(res.scores)} scores for {len(responses)} rows")
        failed = list(res.failed) if res.failed is not None else [False] * len(res.scores)
        out = [
            {"score": float(s) if math.isfinite(s) else None, "correct": float(c), "formatted": float(f)}
            | ({"failed": True} if bad else {})
            for s, c, f, bad in zip(res.scores, res.correct, res.formatted, failed)
        ]
        return {"rows": out, "counters": {k: int(v) for k, v in res.counters.items()}}

    async def handle_score(request: Any) -> Any:
        try:
            body = json.loads(await request.text())
        except ValueError as exc:
            return web.json_response({"error": f"the body is not JSON: {exc}"}, status=400)
        try:
            parsed = parse_rows(body, max_rows)
        except _BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        try:
            reply = await asyncio.get_running_loop().run_in_executor(executor, score, *parsed)
        except Exception as exc:  # the reward's own fault: 500, which the client retries and then counts
            log.exception("reward %s failed on a request of %d rows", name, len(parsed[0]))
            return web.json_response({"error": f"{name} failed: {type(exc).__name__}: {exc}"}, status=500)
        return web.json_response(reply)

    async def handle_health(request: Any) -> Any:
        return web.json_response({"status": "ok", "reward": name})

    async def shutdown(app: Any) -> None:
        executor.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.add_routes([web.post("/score", handle_score), web.post("/", handle_score), web.get("/health", handle_health)])
    app.on_cleanup.append(shutdown)
    return app


class RunningServer:
    """A server started by `serve_in_thread`: `url` is its scoring endpoint; `stop()` (or leaving the `with`
    block) shuts it down: requests in flight get `grace_s` seconds to finish, then their connections are closed (a
    score still running in a worker thread finishes there, its reply unsent). Its thread is a daemon: it also ends
    with the process."""

    def __init__(self, app: Any, host: str, port: int, grace_s: float = STOP_GRACE_S) -> None:
        web = _web()
        self._loop = asyncio.new_event_loop()
        self._grace_s = grace_s
        # aiohttp waits shutdown_timeout for a handler to finish, then as long again after cancelling its request,
        # before it cancels the handler: half each keeps the whole cut-off within grace_s.
        self._runner = web.AppRunner(app, shutdown_timeout=grace_s / 2)
        ready, box = threading.Event(), {}

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, host, port)
                self._loop.run_until_complete(site.start())
                box["port"] = self._runner.addresses[0][1]
            except BaseException as exc:
                box["error"] = exc
                return
            finally:
                ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="roll-verifier", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in box:
            raise box["error"]
        self.host, self.port = host, box["port"]
        self.url = f"http://{host}:{self.port}/score"

    def stop(self) -> None:
        """Shut the server down, waiting up to `grace_s` + 10 s for its thread to end."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=self._grace_s + 10)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_in_thread(reward: Reward, *, host: str = "127.0.0.1", port: int = 0, **app_options: Any) -> RunningServer:
    """Serve `reward` from a background thread of this process (port 0: a free one; see `RunningServer.url`)."""
    return RunningServer(make_app(reward, **app_options), host, port)


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"-o {pair!r}: expected key=value")
        out[key] = yaml.safe_load(value) if value else ""
    return out


async def _serve(app: Any, host: str, port: int, name: str) -> None:
    web = _web()
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1]
    # One line a script (or a test) can read the address from, port 0 included.
    print(f"roll verifier: serving reward {name!r} at http://{host}:{bound}/score", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m roll_envs.rewards.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--reward", required=True, help="a roll.rewards name (math, code, ...) or a class path")
    parser.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="reward option")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed at start)")
    parser.add_argument(
        "--threads", type=int, default=1, help="batches scored at once (>1: the reward must be thread-safe)"
    )
    parser.add_argument("--max-rows", type=int, default=4096, help="rows one request may hold")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        AIOHTTP.require()
        if args.threads < 1 or args.max_rows < 1:
            raise ConfigError("--threads and --max-rows must be >= 1")
        reward = build_reward(args.reward, _options(args.option))
    except Exception as exc:  # a config or install problem: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = make_app(reward, name=args.reward, threads=args.threads, max_rows=args.max_rows)
    asyncio.run(_serve(app, args.host, args.port, args.reward))
    return 0


if __name__ == "__main__":
    sys.exit(main())
