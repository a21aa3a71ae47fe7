"""One error hierarchy: every error class says whose fault it is and its job code; one mapping to job errors."""

from __future__ import annotations

import importlib
import pkgutil

import h3serve
from h3serve.api.error_envelope import APIError
from h3serve.engine.executor import EngineError
from h3serve.errors import INTERNAL_ERROR_MESSAGE, ClientError, ConfigError, H3ServeError, ServerError, job_error_for
from h3serve.jobstore.records import CLIENT_ERROR_CODES, JobError
from h3serve.media.media_inputs import MediaFormatError
from h3serve.rules.validate import RequestError


def _all_error_classes() -> set[type]:
    for info in pkgutil.walk_packages(h3serve.__path__, "h3serve."):
        importlib.import_module(info.name)
    found, todo = set(), [H3ServeError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found


# Control flow, not errors: a selftest check signals its verdict with these (they never leave the selftest runner);
# a real-time session's socket reports its client gone with the last (it never leaves the session).
CONTROL_FLOW = {"h3serve.tools.verdicts.Skip", "h3serve.tools.verdicts.CheckFailed",
                "h3serve.api.realtime.session.ClientGone"}
# Client error codes that never become a job's error: refused before a job exists (admission, the body, the WS route,
# a webhook endpoint's URL, a download's Range header).
NOT_JOB_CODES = {"request_too_costly", "invalid_body", "realtime_unavailable", "invalid_url", "range_not_satisfiable"}


def test_every_exception_class_of_the_package_is_on_the_hierarchy():
    stray = []
    for info in pkgutil.walk_packages(h3serve.__path__, "h3serve."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, Exception) and value.__module__ == module.__name__
                    and not issubclass(value, H3ServeError) and not value.__name__.startswith("_")):
                stray.append(f"{module.__name__}.{value.__name__}")
    assert sorted(set(stray) - CONTROL_FLOW) == []


def test_client_errors_carry_a_client_code_and_server_errors_do_not():
    for cls in _all_error_classes():
        if cls in (ClientError, ServerError, APIError):  # APIError: kind and code per instance (its HTTP status)
            continue
        assert cls.code and cls.code != "internal_error", cls
        if issubclass(cls, ClientError):
            assert cls.code in CLIENT_ERROR_CODES | NOT_JOB_CODES, cls
            assert JobError(cls.code, "x").client_error or cls.code in NOT_JOB_CODES
        else:
            assert cls.code not in CLIENT_ERROR_CODES, cls


def test_job_error_for():
    assert job_error_for(RequestError("seconds", "must be <= 15")) == (
        job_error_for(RequestError("seconds", "must be <= 15")))
    failure = job_error_for(RequestError("seconds", "must be <= 15"))
    assert (failure.code, failure.message, failure.client) == ("invalid_request", "seconds: must be <= 15", True)
    media = job_error_for(MediaFormatError("a.png", "input_reference", "not an image", "PNG or JPEG"))
    assert (media.code, media.client) == ("invalid_media", True)
    # A server error raised on purpose keeps its code but not its text (it names the operator's paths) ...
    config = job_error_for(ConfigError("--model: /srv/secret/ckpt is not an H3 checkpoint"))
    assert (config.code, config.message, config.client) == ("invalid_config", INTERNAL_ERROR_MESSAGE, False)
    # ... unless it is client-safe by contract, as the engine's messages are.
    assert job_error_for(EngineError("rank 1 exited with code -9")).code == "generation_failed"
    assert job_error_for(EngineError("seconds: too long", client_error=True)).client
    assert job_error_for(EngineError("bad file", client_error=True, code="invalid_media")).code == "invalid_media"
    bug = job_error_for(KeyError("/srv/path"))
    assert (bug.code, bug.message, bug.client) == ("internal_error", INTERNAL_ERROR_MESSAGE, False)
