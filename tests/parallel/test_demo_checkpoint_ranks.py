"""The trained demo checkpoint under layerwise offload, Ulysses 2 and TP2 (issue 28): `make demo`'s request gives the
one-rank MP4, and what every layout shows passes the same demo-world checks (gloo ranks, 1 thread each)."""

from __future__ import annotations

import numpy as np
import pytest
from rank_harness import run_ranks
from rank_sessions import demo_cases

from h3serve.demo.shipped import DEMO_PROMPT, shipped_demo_checkpoint
from h3serve.demo.world import checks
from h3serve.demo.world.grammar import parse_prompt
from h3serve.media.mp4 import rgb8, write_mp4

pytestmark = pytest.mark.slow

CASES = [("tp2", {"tensor_parallel_size": 2}), ("u2", {"ulysses_degree": 2})]
# The same arithmetic on other devices' memory or split by heads: the same floats, so the same bytes.
BYTE_IDENTICAL = ("layerwise", "u2")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    demo = shipped_demo_checkpoint()
    assert demo is not None, "the demo checkpoint ships with h3serve (h3serve/demo/checkpoint)"
    return run_ranks(2, demo_cases, demo, CASES)


def _runs(ranks: list[dict], name: str) -> list[dict]:
    """What `name` produced: rank 0's one-rank runs, or every rank's copy of a layout's output."""
    return [ranks[0][name]] if name in ("reference", "layerwise") else [rank[name] for rank in ranks]


def _mp4(path, run: dict) -> bytes:
    write_mp4(path, run["video"], run["audio"])
    return path.read_bytes()


@pytest.mark.parametrize("name", BYTE_IDENTICAL)
def test_the_demo_mp4_is_the_one_rank_mp4_byte_for_byte(ranks, name, tmp_path):
    expected = _mp4(tmp_path / "reference.mp4", ranks[0]["reference"])
    for index, run in enumerate(_runs(ranks, name)):
        assert _mp4(tmp_path / f"{name}-{index}.mp4", run) == expected, name


def test_tp2_differs_from_one_rank_only_in_the_last_bits(ranks):
    """TP2 splits each row-parallel matmul's sum over the ranks and all-reduces the halves: another summation order,
    so its floats differ in the last bits and the MP4 is not byte-identical (measured on the weights before run 3:
    27 of 2.6 M frame values one level apart, the soundtrack within 1.1e-6)."""
    reference = ranks[0]["reference"]
    frames = rgb8(reference["video"]).astype(np.int16)
    for run in _runs(ranks, "tp2"):
        diff = np.abs(rgb8(run["video"]).astype(np.int16) - frames)
        assert diff.max() <= 1 and np.count_nonzero(diff) <= 1e-4 * diff.size, (diff.max(), np.count_nonzero(diff))
        assert np.abs(run["audio"] - reference["audio"]).max() <= 1e-5


def test_what_every_layout_shows_passes_the_demo_checks(ranks):
    attrs = parse_prompt(DEMO_PROMPT)
    for name in ("reference", "layerwise", *(name for name, _ in CASES)):
        for run in _runs(ranks, name):
            verdict = checks.verdict_t2va(rgb8(run["video"]), run["audio"], attrs)
            assert verdict.passed, (name, verdict.failed)
