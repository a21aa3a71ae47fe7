"""`h3serve bench --realtime`: the figures of a session (time to first chunk, interval mean and p95, real-time factor),
and one measured session through the executor on the tiny checkpoint with a tiny streaming LoRA."""

from __future__ import annotations

import json

import pytest

from h3serve.engine.realtime_stream import RealtimeSpec
from h3serve.entrypoints.cli import main
from h3serve.tools.bench.realtime_latency import ChunkTiming, SessionTiming, summary


def test_the_figures_of_a_session():
    # chunks of 34 frames (1 5/12 s) then one of 17; the first chunk carries the start-up
    session = SessionTiming((ChunkTiming(0, 34, 4.0), ChunkTiming(1, 34, 0.5), ChunkTiming(2, 34, 1.5),
                             ChunkTiming(3, 17, 1.0)))
    assert session.first_chunk_s == 4.0
    assert session.interval_s() == pytest.approx(1.0)
    assert session.interval_s(95) == pytest.approx(1.45)  # numpy's linear percentile of 0.5, 1.0, 1.5
    assert session.realtime_factor() == pytest.approx(3.0 / (85 / 24))  # all the time over all the media
    assert session.realtime_factor(95) == pytest.approx(1.0 / (17 / 24), rel=0.05)  # the short chunk's factor
    table = summary([session], RealtimeSpec("p", 64, 64, 0, 119), "cpu")
    assert "| 1 | 4.000 | 1.000 | 1.450 |" in table and "119 frames" in table


@pytest.mark.slow  # rank processes
def test_bench_realtime_on_the_tiny_checkpoint(tiny_checkpoint, tmp_path, capsys):
    code = main(["bench", "--realtime", "--model", str(tiny_checkpoint), "--realtime-lora", str(_lora(tmp_path)),
                 "--shape", "64x64x124", "--warmup", "0", "--runs", "1", "--engine", "threads=1",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| session | first chunk s |" in printed and "| 1 |" in printed
    record = json.loads((tmp_path / "out" / "realtime.json").read_text())
    assert record["command"].startswith("h3serve bench --model") and "--realtime" in record["command"]
    chunks = record["sessions"][0]
    assert [c["frames"] for c in chunks] == [34, 34, 34, 22]  # the session's published frames: 124 in all
    assert all(c["interval_s"] > 0 for c in chunks)


def test_bench_realtime_refuses_a_model_without_its_lora(tmp_path, capsys):
    assert main(["bench", "--realtime", "--model", str(tmp_path)]) == 2
    assert "--realtime-lora" in capsys.readouterr().err


def _lora(tmp_path):
    from h3serve.tools.tiny.make_adapter import make_tiny_adapter

    return make_tiny_adapter(tmp_path / "taomate", "taomate")
