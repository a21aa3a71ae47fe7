"""`h3serve bench --gpu-acceptance` on CPU: the GPU rows say "skipped: no GPU", the selftest's CPU part and the
planner's row run, and the JSON and the table are written whatever happens to a row."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from h3serve.entrypoints import cli
from h3serve.entrypoints.plan import plan_from_argv
from h3serve.tools.bench import acceptance
from h3serve.tools.bench.acceptance import AcceptanceContext, CheckFailed, Row, Skip

ROW_KEYS = {"name", "what", "status", "budget_s", "seconds", "figure", "message", "data"}
QUICK = ("environment", "numerics", "memory", "throughput")  # the selftest's CPU part without spawned ranks


@pytest.mark.slow  # a selftest child process and the released plan: ~30-40 s on a loaded 2-core host
def test_the_acceptance_command_runs_end_to_end_on_cpu(tiny_checkpoint, tmp_path, capsys):
    out, md = tmp_path / "acceptance.json", tmp_path / "gpu.md"
    argv = ["bench", "--gpu-acceptance", "--json", str(out), "--table", str(md), "--out", str(tmp_path / "work")]
    for prefix in QUICK:
        argv += ["--selftest-only", prefix]
    start = time.perf_counter()
    code = cli.main(argv)
    assert time.perf_counter() - start < 120
    record = json.loads(out.read_text())
    assert code == 0, record
    assert set(record) == {"schema", "device", "cuda", "budget_s", "seconds", "verdict", "rows"}
    assert record["schema"] == acceptance.SCHEMA and record["cuda"] is False
    assert record["budget_s"] == acceptance.GLOBAL_BUDGET_S
    rows = {r["name"]: r for r in record["rows"]}
    assert [r["name"] for r in record["rows"]] == [row.name for row in acceptance.ROWS]
    assert all(set(r) == ROW_KEYS for r in record["rows"])
    status = {name: (r["status"], r["message"]) for name, r in rows.items()}
    ran = {"selftest", "plan.fl2va_32gib"}
    assert all(status[name] == ("skipped", "no GPU") for name in set(rows) - ran), status
    assert rows["selftest"]["status"] == "pass" and rows["selftest"]["figure"].startswith("OK (5 passed")
    checks = {o["name"]: o["status"] for o in rows["selftest"]["data"]["outcomes"]}
    assert checks["memory.offload_paths"] == "pass" and "end_to_end" not in checks
    plan = rows["plan.fl2va_32gib"]
    assert plan["status"] == "pass" and plan["data"]["device_memory"] == 32 * 2**30
    assert plan["data"]["peak_stage"] == "denoise" and isinstance(plan["data"]["fits"], bool)
    assert record["verdict"] == f"OK: 2 passed, {len(rows) - 2} skipped"
    table = md.read_text()
    assert table in capsys.readouterr().out
    assert table.count("| skipped: no GPU |") == len(rows) - 2
    assert all(f"| {name} |" in table for name in rows)


def _ctx(tmp_path: Path, budget_s: float = 10.0) -> AcceptanceContext:
    return AcceptanceContext(cuda=False, device_name="test", out=tmp_path, budget_s=budget_s,
                             plan_from_argv=plan_from_argv)


def test_rows_past_the_global_budget_are_skipped_and_a_crash_fails_only_its_row(tmp_path):
    def slow(ctx: AcceptanceContext, budget: float) -> tuple[str, dict]:
        time.sleep(0.3)
        return "done", {"x": 1}

    def crash(ctx: AcceptanceContext, budget: float) -> tuple[str, dict]:
        raise KeyError("boom")

    def wrong(ctx: AcceptanceContext, budget: float) -> tuple[str, dict]:
        raise CheckFailed("peak over plan")

    def gpu(ctx: AcceptanceContext, budget: float) -> tuple[str, dict]:
        ctx.gpu()
        raise AssertionError("unreachable on CPU")

    rows = (Row("a", "first", 0.5, slow), Row("b", "crash", 0.1, crash), Row("c", "wrong", 0.1, wrong),
            Row("d", "gpu", 0.1, gpu), Row("e", "too big", 0.5, slow))
    record = acceptance.run(_ctx(tmp_path, budget_s=0.7), rows)
    got = {r["name"]: r for r in record["rows"]}
    assert got["a"]["status"] == "pass" and got["a"]["data"] == {"x": 1}
    assert got["b"]["status"] == "fail" and got["b"]["message"] == "KeyError: 'boom'"
    assert (got["c"]["status"], got["c"]["message"]) == ("fail", "peak over plan")
    assert (got["d"]["status"], got["d"]["message"]) == ("skipped", "no GPU")
    assert got["e"]["status"] == "skipped" and got["e"]["message"].startswith("the global budget (1 s) has")
    assert record["verdict"] == "FAIL (b, c): 1 passed, 2 skipped"
    table = acceptance.table(record)
    assert "| e | too big | skipped |" in table and "fail: KeyError: 'boom'" in table


def test_a_row_past_its_budget_is_killed_and_fails(tmp_path):
    start = time.perf_counter()
    with pytest.raises(CheckFailed, match="over its budget of 1 s") as failed:
        acceptance.h3serve(["selftest", "--device", "cpu"], 1.0, lambda line: None)
    assert time.perf_counter() - start < 10
    assert "its last output: " in str(failed.value)  # where the child was when it was killed


def test_a_failed_childs_message_ends_with_its_last_printed_line():
    assert acceptance._last_line("loading\n  [bench] run 1 of 2: denoise  \n\n") == "[bench] run 1 of 2: denoise"
    assert acceptance._last_line("") == acceptance._last_line(None) == "no output"
    assert len(acceptance._last_line("x" * 1000)) == 300


def test_the_request_rows_matrices_are_valid_bench_matrices(tiny_checkpoint):
    """They only run on a GPU: their matrix files and engine configs are checked here."""
    from h3serve.tools.bench.matrix import matrix_from_dict

    bodies = acceptance.matrix_bodies(str(tiny_checkpoint), "/adapters/turbo")
    assert set(bodies) == {"offload_modes", "turbo", "fl2va_32gib"}
    engines = {}
    for body in bodies.values():
        matrix = matrix_from_dict(json.loads(json.dumps(body))).check()  # as the child reads the file
        engines.update({e.name: e.config(tiny_checkpoint) for e in matrix.engines})
    assert set(engines) == {*acceptance.OFFLOAD_ENGINES, "base-50", "turbo-4", "fl2va-32gib"}
    assert engines["layerwise"].offload.streamed == {"dit"} and engines["adaln-host"].offload.adaln
    assert engines["fl2va-32gib"].offload.streamed == {"text_encoder"} and engines["fl2va-32gib"].quantization
    assert all(e.device == "cuda" for e in engines.values())


def test_skip_and_the_gpu_guard():
    ctx = AcceptanceContext(cuda=True, device_name="gpu", out=Path("."), budget_s=1.0)
    ctx.gpu()  # no exception on a GPU
    with pytest.raises(Skip, match="the checkpoint row did not build"):
        acceptance._needs_checkpoint(ctx)


def test_every_row_fits_in_the_global_budget():
    """A row starts only while the global budget still holds its own: together they must fit, or the last rows never
    run on a GPU."""
    assert sum(row.budget_s for row in acceptance.ROWS) <= acceptance.GLOBAL_BUDGET_S
