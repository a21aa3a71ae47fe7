"""Rank processes start by spawn (the default) or from a preloaded fork server (the suite's choice): either way a
rank sees the environment of the moment it was started and knows the process that started it."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest

from h3serve.errors import ConfigError
from h3serve.parallel.launch import run_on_ranks
from h3serve.parallel.start_method import START_ENV, rank_context


def report(rank: int, world: int) -> dict:
    parent = mp.parent_process()
    return {
        "marker": os.environ.get("H3SERVE_TEST_MARKER"),
        "parent": parent.pid if parent is not None else None,
        "preloaded": "h3serve.rank.model_runner" in sys.modules,  # a spawned rank imports only what it needs
    }


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_rank_sees_the_environment_it_was_started_with_and_its_parent(method, monkeypatch):
    monkeypatch.setenv(START_ENV, method)
    if method == "forkserver":
        run_on_ranks(1, report, threads=1)  # the fork server is up (if it was not) before the variable exists
    monkeypatch.setenv("H3SERVE_TEST_MARKER", method)
    (seen,) = run_on_ranks(1, report, threads=1)
    assert seen["marker"] == method
    assert seen["parent"] == os.getpid()
    assert seen["preloaded"] == (method == "forkserver")


def test_an_unknown_start_method_is_a_config_error(monkeypatch):
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ConfigError, match=f"{START_ENV}='fork' must be one of spawn, forkserver"):
        rank_context()
