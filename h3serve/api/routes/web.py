"""A small web page at `/`: submit a prompt, watch the jobs, play the results."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(include_in_schema=False)
_PAGE = resources.files("h3serve.api").joinpath("static/index.html")


@router.get("/")
def index() -> HTMLResponse:
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"))
