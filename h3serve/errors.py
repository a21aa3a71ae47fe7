"""One error hierarchy: each error h3serve raises on purpose says whose fault it is and its stable job code.

Leaf module (imports nothing of h3serve). Every module's own error class derives from `ClientError` (the
request was at fault: a 4xx, its message safe to show) or `ServerError` (configuration, checkpoint, engine:
the server's problem). `job_error_for` is the one place that turns an exception into a job's error code and
client-visible message; the rank worker, the job manager, the API and the CLI all ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

ErrorKind = Literal["client", "server"]

# What a client reads for a failure that is not an H3ServeError (a bug, an OSError): its text may name paths.
INTERNAL_ERROR_MESSAGE = "the server hit an internal error while running the job"


class H3ServeError(Exception):
    """Base of every error h3serve raises on purpose. `kind` and `code` may be overridden per instance.

    `client_safe`: the message may be shown to the client (client errors always; a server error only when it
    says so, since a checkpoint or configuration message names the operator's paths)."""

    kind: ErrorKind = "server"
    code: str = "internal_error"
    client_safe: ClassVar[bool] = False


class ClientError(H3ServeError):
    """The request (its fields, media or cost) was at fault; the message names what and the limit."""

    kind: ErrorKind = "client"
    code: str = "invalid_request"
    client_safe: ClassVar[bool] = True


class ServerError(H3ServeError):
    """The server's configuration, checkpoint or engine failed; not the client's fault."""

    kind: ErrorKind = "server"
    code: str = "server_error"


class RequestError(ClientError, ValueError):
    """A request field breaks a rule. `str(err)` is one line: "field: what is wrong (the limit)"."""

    code: str = "invalid_request"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(ServerError, ValueError):
    """An illegal flag or combination; the message says which and how to fix it."""

    code: str = "invalid_config"


@dataclass(frozen=True)
class JobFailure:
    """A job's error as stored and shown: a stable code, a client-safe message, and whose fault it was."""

    code: str
    message: str
    client: bool


def job_error_for(exc: BaseException) -> JobFailure:
    """The job error for `exc`: an H3ServeError keeps its code, and its message where that is client-safe;
    anything else is an internal error whose own text (paths, tracebacks) stays in the server log."""
    if not isinstance(exc, H3ServeError):
        return JobFailure("internal_error", INTERNAL_ERROR_MESSAGE, False)
    message = str(exc) if exc.client_safe else INTERNAL_ERROR_MESSAGE
    return JobFailure(exc.code, message, exc.kind == "client")


def is_client_error(exc: BaseException) -> bool:
    return isinstance(exc, H3ServeError) and exc.kind == "client"
