"""The job store's own errors (a leaf: the API maps them to HTTP answers without knowing the database)."""

from __future__ import annotations

from h3serve.errors import ServerError


class StoreUnavailable(ServerError, RuntimeError):
    """The job database cannot be reached right now (down, restarting, unreachable). Nothing was changed by the
    call that raised; the next call tries to reconnect."""

    code = "store_unavailable"


class StoreClosed(StoreUnavailable):
    """The store was closed (the server is stopping): a call that comes after `close` (a request the shutdown
    gave up waiting for) gets this, answered 503 like an unreachable database, never a driver error."""

    def __init__(self) -> None:
        super().__init__("the job store is closed: the server is stopping")
