"""The two signals a check raises to give its verdict (the selftest's checks and the GPU acceptance rows): not errors
of the service, so they stay off the h3serve.errors hierarchy."""

from __future__ import annotations


class Skip(Exception):
    """Raised by a check that cannot apply here; the message says why."""


class CheckFailed(Exception):
    """Raised by a check whose result is wrong; the message says what and the fix."""
