"""How the MLflow backend (roll_core.trackers.mlflow) makes its requests to the tracking server: bounded in time, and
each failure sorted into "the server is away" (worth sending again) or "the request is wrong" (not).

- `bounded_http(timeout_s, retries, requests_by)`: around every MLflow call. MLflow's defaults retry one request for
  minutes; its own HTTP settings are process-wide environment variables it reads at each request
  (MLFLOW_HTTP_REQUEST_TIMEOUT, _MAX_RETRIES, _BACKOFF_FACTOR), so they are set for the call, one caller at a time
  (HTTP_SETTINGS), and removed after. Variables the user set are left alone. A failed request costs about
  `(retries + 1) * timeout_s` plus MLflow's backoff against a hung server.
- While the backend closes (`requests_by`, a time.monotonic() deadline): no retries, each call's timeout is cut to
  the whole seconds left before `requests_by` (MLflow's timeout is whole seconds), and a call that would have less
  than 1 s is not made: `CloseDeadline` is raised instead. So the calls `close()` makes end by `requests_by`.
- `is_network_error(exc)`: whether a failed call may succeed when sent again (unreachable, timed out, a 5xx, a call
  not made: `CloseDeadline`), as opposed to one MLflow refuses (an error code of PERMANENT_ERRORS).
- `Unreachable`: the server did not answer when the MLflow run was to be started or reopened.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HTTP_SETTINGS", "PERMANENT_ERRORS", "CloseDeadline", "Unreachable", "bounded_http", "is_network_error"]

# MLflow error codes that mean "this request is wrong", not "the server is away": resending would not help.
PERMANENT_ERRORS = frozenset(
    {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "PERMISSION_DENIED"}
)
#: MLflow's own HTTP settings are process-wide variables (`bounded_http`): one caller sets them at a time.
HTTP_SETTINGS = threading.RLock()


def is_network_error(exc: BaseException) -> bool:
    """Whether a failed MLflow call may succeed when sent again (the server was unreachable, timed out or failed
    with a 5xx), as opposed to a request MLflow refuses."""
    code = getattr(exc, "error_code", None)
    return code not in PERMANENT_ERRORS


class Unreachable(RuntimeError):
    """The tracking server did not answer (`is_network_error`) when the MLflow run was to be started or reopened."""


class CloseDeadline(RuntimeError):
    """A call `close()` had no time left for (`tracking.mlflow.close_timeout_s`): not made, so not a failed send."""


@contextmanager
def bounded_http(timeout_s: float, retries: int, requests_by: float | None = None) -> Iterator[None]:
    """Around an MLflow call: at most `retries` retries of `timeout_s` each (whole seconds, at least 1); with
    `requests_by` (time.monotonic()), no retries and the timeout cut to the whole seconds left, `CloseDeadline`
    when under 1 s is left. The settings the user exported win (the module docstring)."""
    timeout = max(1, int(timeout_s))
    if requests_by is not None:
        left = math.floor(requests_by - time.monotonic())
        if left < 1:
            raise CloseDeadline("no time left before tracking.mlflow.close_timeout_s for another request")
        timeout, retries = min(timeout, left), 0
    settings = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(timeout),
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(retries),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    with HTTP_SETTINGS:
        added = [k for k in settings if k not in os.environ]
        os.environ.update({k: settings[k] for k in added})
        try:
            yield
        finally:
            for k in added:
                os.environ.pop(k, None)
