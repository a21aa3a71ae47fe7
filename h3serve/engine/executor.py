"""Executor: owns the rank processes and runs one request at a time on all of them.

The parent never touches the model. It sends a request to rank 0 over a queue; rank 0 broadcasts it to the
other ranks over `torch.distributed`; every rank runs the pipeline; rank 0 streams progress back and writes
the result arrays to a spool file (so multi-GB frames never travel through a pipe). The ranks stay alive
across requests. If any rank dies, the request in flight fails with a clear error and the executor
restarts every rank (collectives of the survivors would otherwise hang), so the next request succeeds.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from h3serve.config import EngineConfig
from h3serve.engine.output import GenerationOutput
from h3serve.parallel.rendezvous import Rendezvous
from h3serve.validate import GenerationPlan, ModelDefaults

ProgressCallback = Callable[[int, int], None]


class EngineError(RuntimeError):
    """The request could not run: a rank died, failed to start, or raised. The message is client-safe.

    `client_error` is True when the request itself was at fault (its media or fields failed a check at run
    time): a 4xx for HTTP clients, not a server error.
    """

    def __init__(self, message: str, client_error: bool = False):
        super().__init__(message)
        self.client_error = client_error


class Cancelled(RuntimeError):
    """The request was cancelled before it finished."""


@dataclass(frozen=True)
class RankJob:
    """What travels from the parent to rank 0 (and from rank 0 to every rank)."""

    seq: int
    plan: GenerationPlan
    spool: str  # file rank 0 writes the result arrays into


class Executor:
    """Starts `config.world_size` rank processes and serves `generate` calls, one at a time.

    Across several nodes (see `h3serve.parallel.rendezvous`) each node's executor starts its share of the
    ranks; only the leader (global rank 0's node) serves `generate`, the others call `run_follower`.
    """

    def __init__(
        self, config: EngineConfig, start_timeout_s: float | None = None, rendezvous: Rendezvous | None = None
    ):
        self.config = config
        self.rendezvous = rendezvous or Rendezvous.from_env()
        self.start_timeout_s = config.init_timeout_s if start_timeout_s is None else start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()  # one request at a time
        self._seq = itertools.count(1)
        self._spool: Path | None = None  # created once the ranks are up, removed by close()
        self._procs: list[mp.process.BaseProcess] = []
        self._ranks: list[int] = []  # global rank of each local process
        self.defaults: ModelDefaults = ModelDefaults()
        self.tasks: tuple[str, ...] = ()  # what the loaded DiTs serve (sent by rank 0 when ready)
        self.restarts = 0
        self.cancel_grace_s = 120.0
        self._closed = False  # after close(), a dying rank is not restarted (shutdown, not a failure)
        self._start()

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        from h3serve.engine.worker import worker_main

        self._requests = self._ctx.Queue()
        self._events = self._ctx.Queue()
        self._cancel = self._ctx.Value("q", 0)  # seq of the job to cancel
        rendezvous = self.rendezvous.fresh()
        world = self.config.world_size
        self._ranks = list(rendezvous.local_ranks(world))
        self._procs = [
            self._ctx.Process(
                target=worker_main,
                args=(rank, world, rendezvous.init_method, self.config, self._requests, self._events, self._cancel),
                kwargs={"local_rank": local_rank},
                name=f"h3serve-rank{rank}",
                daemon=True,
            )
            for local_rank, rank in enumerate(self._ranks)
        ]
        for p in self._procs:
            p.start()
        if not rendezvous.is_leader:
            return  # rank 0 (and its "ready") lives on the leader node
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                event = self._next_event(deadline, starting=True)
            except (TimeoutError, EngineError) as e:
                self._stop_procs()
                if isinstance(e, TimeoutError):
                    raise EngineError(
                        f"engine failed to start: the ranks did not load within {self.start_timeout_s:g}s "
                        "(raise --init-timeout)"
                    ) from None
                raise
            if event[0] == "ready":
                self.defaults, self.tasks = event[1], event[2]
                if self._spool is None:
                    self._spool = Path(tempfile.mkdtemp(prefix="h3serve-spool-"))
                return
            if event[0] == "fatal":
                self._stop_procs()
                raise EngineError(f"engine failed to start: {event[1]}")

    def _stop_procs(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def restart(self) -> None:
        if self._closed:
            return
        self._stop_procs()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        self._closed = True
        if self._procs and all(p.is_alive() for p in self._procs):
            self._requests.put(None)
            for p in self._procs:
                p.join(timeout=10)
        self._stop_procs()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run_follower(self, poll_s: float = 1.0) -> None:
        """Non-leader nodes: keep the local ranks alive (restarting them after a failure) until they exit
        cleanly, which they do when the leader closes the engine."""
        while True:
            time.sleep(poll_s)
            codes = [p.exitcode for p in self._procs]
            if all(code == 0 for code in codes):
                return
            if any(code not in (None, 0) for code in codes):
                self.restart()

    # -- requests --------------------------------------------------------------------------------------------

    def cancel(self, seq: int) -> None:
        """Ask the ranks to stop job `seq` at its next denoise step."""
        self._cancel.value = seq

    def generate(
        self,
        plan: GenerationPlan,
        on_progress: ProgressCallback | None = None,
        on_start: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
    ) -> GenerationOutput:
        """Run one plan on all ranks. `on_start(seq)` gives the handle `cancel` takes."""
        with self._lock:
            if self._closed:
                raise EngineError("the engine is shut down")
            if not self.alive():
                self.restart()
            job = RankJob(
                seq=next(self._seq), plan=plan, spool=str(self._spool / f"job-{os.getpid()}-{time.time_ns()}.npz")
            )
            if on_start is not None:
                on_start(job.seq)
            self._requests.put(job)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            timed_out = False
            try:
                while True:
                    try:
                        event = self._next_event(deadline)
                    except TimeoutError:
                        if timed_out:  # it did not even stop when asked: only a restart is safe
                            self.restart()
                            raise
                        timed_out = True
                        self.cancel(job.seq)  # abort at the next step, then report the timeout
                        deadline = time.monotonic() + self.cancel_grace_s
                        continue
                    kind = event[0]
                    if kind == "progress" and event[1] == job.seq and on_progress is not None:
                        on_progress(event[2], event[3])
                    elif kind == "done" and event[1] == job.seq:
                        return self._read_result(job.spool, event[2], event[3])
                    elif kind == "cancelled" and event[1] == job.seq:
                        if timed_out:
                            raise TimeoutError(f"generation timed out after {timeout_s:g}s")
                        raise Cancelled(f"job {job.seq} was cancelled")
                    elif kind == "error" and event[1] == job.seq:
                        raise EngineError(self._root_cause(event), client_error=event[4])
            except EngineError:
                # With several ranks a failing rank exits (see worker_main), so the group is always rebuilt.
                if not self.alive() or self.config.world_size > 1:
                    self.restart()
                raise

    def _root_cause(self, error: tuple, settle_s: float = 2.0) -> str:
        """With several ranks, a rank's error is often a symptom (its collective lost a peer that died): give
        the processes a moment to settle and name a rank that died without reporting, if any."""
        if len(self._procs) <= 1:
            return error[2]
        reporters = {error[3]} if error[3] is not None else set()
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            # Exit codes first, reports second: a rank's report is flushed before it exits, so any report from
            # a rank seen dead here is already readable.
            dead = [(rank, p.exitcode) for rank, p in zip(self._ranks, self._procs, strict=True) if p.exitcode]
            while True:
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    break
                if event[0] == "error" and event[3] is not None:
                    reporters.add(event[3])
            silent = [(rank, code) for rank, code in dead if rank not in reporters]
            if silent:
                return f"rank {silent[0][0]} exited with code {silent[0][1]} while the request was running"
            if reporters <= {rank for rank, _ in dead}:
                break  # every reporter is gone and no other rank died: the report is the cause
        return error[2]

    def _next_event(self, deadline: float | None, starting: bool = False) -> tuple:
        """The next event from rank 0; EngineError if a rank died, TimeoutError past `deadline`."""
        while True:
            # Checked before every read, not only when the queue is idle: steady progress events must not
            # postpone a timeout.
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the engine did not answer in time")
            try:
                return self._events.get(timeout=0.2)
            except queue.Empty:
                pass
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                p = dead[0]
                rank = self._ranks[self._procs.index(p)]
                what = "starting the engine" if starting else "the request was running"
                raise EngineError(f"rank {rank} exited with code {p.exitcode} while {what}")

    @staticmethod
    def _read_result(spool: str, stage_durations: dict, peak_memory_mb: float) -> GenerationOutput:
        from h3serve.media.raw import read_raw

        video, audio, _, _ = read_raw(spool)  # the file rank 0 wrote with write_raw
        os.unlink(spool)
        return GenerationOutput(
            video=video, audio=audio, stage_durations=stage_durations, peak_memory_mb=peak_memory_mb
        )
