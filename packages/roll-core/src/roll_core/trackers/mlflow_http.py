"""How the MLflow backend (roll_core.trackers.mlflow) makes its requests to the tracking server: bounded in time, and
each failure sorted into "the server is away" (worth sending again) or "the request is wrong" (not).

- `bounded_http(timeout_s, retries, requests_by)`: around every MLflow call. MLflow's defaults retry one request for
  minutes; its own HTTP settings are environment variables (MLFLOW_HTTP_REQUEST_TIMEOUT, _MAX_RETRIES,
  _BACKOFF_FACTOR) it reads at each request through the objects of `mlflow.environment_variables`. Roll's values
  are the calling thread's own: those three objects get a per-thread layer (installed once per process, HTTP_SETTINGS)
  that a variable the user exported overrides, and that threads outside `bounded_http` never see. No lock is held
  while a request runs: a request stuck in a hung server (one that `close()` gave up on, with the user's long
  MLFLOW_HTTP_REQUEST_TIMEOUT) holds up no other tracker, no later run of the process, no retry, and each of those
  requests gets its own settings. (The settings were process-wide variables set for the call under one lock: a stuck
  request held every other MLflow call of the process until it failed.) A failed request costs about
  `(retries + 1) * timeout_s` plus MLflow's backoff against a hung server. (MLflow's parallel multipart uploads,
  of artifacts over 500 MB, run on threads of its own: they get MLflow's settings; roll's artifacts are small.)
- While the backend closes (`requests_by`, a time.monotonic() deadline): no retries, each call's timeout is cut to
  the whole seconds left before `requests_by` (MLflow's timeout is whole seconds), and a call that would have less
  than 1 s is not made: `CloseDeadline` is raised instead. So the calls `close()` makes end by `requests_by`.
- `is_network_error(exc)`: whether a failed call may succeed when sent again (unreachable, timed out, a 5xx, a call
  not made: `CloseDeadline`), as opposed to one MLflow refuses (an error code of PERMANENT_ERRORS) or one of the
  local file system (`local_failure`).
- `local_failure(exc)`: the error of a store on this machine's disk in `exc`'s chain (a SQLite store or local
  artifacts that cannot be written: a read-only folder, a full disk, a file where a folder should be), not of a
  connection. Resending does not help either (it was taken for an outage: buffered and resent for the whole run, with
  "the server is not answering" for an error that names no server).
- `Unreachable`: the server did not answer when the MLflow run was to be started or reopened.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

__all__ = [
    "HTTP_SETTINGS",
    "PERMANENT_ERRORS",
    "CloseDeadline",
    "Unreachable",
    "bounded_http",
    "is_network_error",
    "local_failure",
]

# MLflow error codes that mean "this request is wrong", not "the server is away": resending would not help.
PERMANENT_ERRORS = frozenset(
    {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "PERMISSION_DENIED"}
)
#: The MLflow variables `bounded_http` sets for the calling thread.
SETTINGS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")
#: Held only while the per-thread layer is installed (once per process), never across a request.
HTTP_SETTINGS = threading.Lock()
_installed = False
_thread = threading.local()  # `settings`: {variable: value} of the `bounded_http` the thread is in, if any


# An OSError of a connection (the others are the local file system's): a plain OSError carries these (ENETUNREACH
# is no ConnectionError subclass); requests' errors are OSErrors too (`_connection_error`).
_NETWORK_ERRNOS = frozenset(
    getattr(errno, name)
    for name in "ECONNREFUSED ECONNRESET ECONNABORTED ETIMEDOUT EHOSTUNREACH ENETUNREACH ENETDOWN EHOSTDOWN".split()
    if hasattr(errno, name)
)
# SQLite's primary result codes of a database file that cannot be used (SQLITE_PERM, _READONLY, _IOERR, _CORRUPT,
# _FULL, _CANTOPEN, _NOTADB), which MLflow's SQL store raises as TEMPORARILY_UNAVAILABLE; not SQLITE_BUSY/_LOCKED
# (another writer: worth trying again).
_SQLITE_LOCAL = frozenset({3, 8, 10, 11, 13, 14, 26})


def _connection_error(exc: OSError) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror, socket.herror, ssl.SSLError)):
        return True
    if any(cls.__module__.split(".")[0] in ("requests", "urllib3") for cls in type(exc).__mro__):
        return True  # (not imported here: requests comes with MLflow)
    return exc.errno in _NETWORK_ERRNOS


def local_failure(exc: BaseException) -> BaseException | None:
    """The error of the local file system in `exc` or what it was raised from (each one's `__cause__`, else its
    `__context__`): the first OSError in that chain when it is not a connection's, or a SQLite error of a file that
    cannot be used (`_SQLITE_LOCAL`); None for anything else (a network failure, a refusal)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError):
            return None if _connection_error(link) else link
        code = getattr(link, "sqlite_errorcode", None)
        if isinstance(code, int) and code & 0xFF in _SQLITE_LOCAL:
            return link
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return None


def is_network_error(exc: BaseException) -> bool:
    """Whether a failed MLflow call may succeed when sent again (the server was unreachable, timed out or failed
    with a 5xx), as opposed to a request MLflow refuses or a local store that cannot be written (`local_failure`)."""
    code = getattr(exc, "error_code", None)
    return code not in PERMANENT_ERRORS and local_failure(exc) is None


class Unreachable(RuntimeError):
    """The tracking server did not answer (`is_network_error`) when the MLflow run was to be started or reopened."""


class CloseDeadline(RuntimeError):
    """A call `close()` had no time left for (`tracking.mlflow.close_timeout_s`): not made, so not a failed send."""


def _thread_value(name: str) -> str | None:
    """A variable's text as MLflow reads it (`_EnvironmentVariable.get_raw`): the environment's (the user's), else
    the calling thread's `bounded_http` value, else none (MLflow's default)."""
    value = os.environ.get(name)
    if value is None:
        value = (getattr(_thread, "settings", None) or {}).get(name)
    return value


def _install() -> None:
    """Give MLflow's objects for SETTINGS the per-thread layer (`_thread_value`), once per process."""
    global _installed
    if _installed:
        return
    with HTTP_SETTINGS:
        if _installed:
            return
        from mlflow import environment_variables

        for name in SETTINGS:
            variable = getattr(environment_variables, name, None)
            if variable is None or getattr(variable, "name", None) != name or not hasattr(variable, "get_raw"):
                raise RuntimeError(
                    f"this MLflow has no mlflow.environment_variables.{name}.get_raw: roll's MLflow backend cannot "
                    "bound its requests (roll-core's mlflow extra pins the versions it supports)"
                )
            # An instance attribute shadows the class's method: MLflow's `get()` reads through it.
            variable.get_raw = partial(_thread_value, name)
        _installed = True


@contextmanager
def bounded_http(timeout_s: float, retries: int, requests_by: float | None = None) -> Iterator[None]:
    """Around an MLflow call, on the calling thread only: at most `retries` retries of `timeout_s` each (whole
    seconds, at least 1); with `requests_by` (time.monotonic()), no retries and the timeout cut to the whole seconds
    left, `CloseDeadline` when under 1 s is left. The settings the user exported win (the module docstring)."""
    timeout = max(1, int(timeout_s))
    if requests_by is not None:
        left = math.floor(requests_by - time.monotonic())
        if left < 1:
            raise CloseDeadline("no time left before tracking.mlflow.close_timeout_s for another request")
        timeout, retries = min(timeout, left), 0
    _install()
    outer = getattr(_thread, "settings", None)
    _thread.settings = dict(zip(SETTINGS, (str(timeout), str(retries), "1"), strict=True))
    try:
        yield
    finally:
        _thread.settings = outer
