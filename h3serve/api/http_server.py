"""The uvicorn server h3serve runs the app on, configured from ServerConfig in one place."""

from __future__ import annotations

from typing import Any

import uvicorn
from fastapi import FastAPI

from h3serve.api.config import ServerConfig


def uvicorn_config(app: FastAPI, config: ServerConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for `config` (`overrides` win, e.g. log_level)."""
    settings: dict[str, Any] = dict(host=config.host, port=config.port, timeout_graceful_shutdown=10)
    return uvicorn.Config(app, **{**settings, **overrides})
