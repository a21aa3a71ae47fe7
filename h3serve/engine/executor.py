"""Executor: owns the rank processes and runs one request at a time on all of them.

The parent never touches the model. It sends a request to rank 0 over a queue; rank 0 broadcasts it to the
other ranks over `torch.distributed`; every rank runs the pipeline; rank 0 streams progress back and writes
the result arrays to a spool file (so multi-GB frames never travel through a pipe). The ranks stay alive
across requests. If any rank dies, the request in flight fails with a clear error and the executor
restarts every rank (collectives of the survivors would otherwise hang), so the next request succeeds; across
nodes that restart runs behind the error, as it waits for every node's ranks (`_recover`).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import multiprocessing.queues
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.realtime_stream import (
    RealtimeBusy,
    RealtimeSpec,
    RealtimeStream,
    RealtimeUnavailable,
    SegmentWriterFactory,
)
from h3serve.errors import ConfigError, ServerError
from h3serve.media.fragments import FragmentWriter
from h3serve.media.mp4 import EncoderOptions
from h3serve.messages import (
    Done,
    Event,
    Fatal,
    GenerationOutput,
    JobCancelled,
    JobFailed,
    JobProgress,
    RankJob,
    Ready,
    RealtimeEnded,
    RealtimeOpen,
    Stop,
    spool_file,
)
from h3serve.parallel.rendezvous import Rendezvous
from h3serve.parallel.start_method import rank_context, start_rank
from h3serve.rules.validate import GenerationPlan, ModelDefaults
from h3serve.rules.validate.realtime_plan import plan_realtime

log = logging.getLogger("h3serve.engine")
ProgressCallback = Callable[[int, int], None]
SPOOL_PREFIX = "h3serve-spool-"
# How often a wait for rank events wakes to check a cancel request or deadline (a dead rank wakes it at once).
WAKE_S = 0.2


class EngineError(ServerError, RuntimeError):
    """The request could not run: a rank died, failed to start, or raised. The message is client-safe.

    `client_error` is True when the request itself was at fault (its media or fields failed a check at run
    time): a 4xx for HTTP clients, not a server error; `code` is then the rank's own error code.
    """

    client_safe = True

    def __init__(self, message: str, client_error: bool = False, code: str = "invalid_request"):
        super().__init__(message)
        self.client_error = client_error
        self.kind = "client" if client_error else "server"
        self.code = code if client_error else "generation_failed"


# The rank processes' entry point, named rather than imported: the parent process never loads torch.
RANK_ENTRY = ("h3serve.rank.worker", "worker_main")


def _rank_process(*args: Any, **kwargs: Any) -> None:
    """Runs in the spawned rank process: import the rank side there, then run the worker loop."""
    module, name = RANK_ENTRY
    getattr(importlib.import_module(module), name)(*args, **kwargs)


class Cancelled(ServerError, RuntimeError):
    """The request was cancelled before it finished."""

    code = "cancelled"


def remove_stale_spools(root: Path | None = None) -> list[Path]:
    """Remove spool folders whose server process is gone (a SIGKILLed server cannot clean up after itself)."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{SPOOL_PREFIX}*"):
        pid = folder.name[len(SPOOL_PREFIX) :].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


class Executor:
    """Starts `config.world_size` rank processes and serves `generate` calls, one at a time.

    Across several nodes (see `h3serve.parallel.rendezvous`) each node's executor starts its share of the
    ranks; only the leader (global rank 0's node) serves `generate`, the others call `run_follower`.
    `replica` (data parallelism, see `h3serve.engine.replicas`): this executor's GPUs are the replica's slice,
    devices `replica * world_size ...`; it shares nothing else with the other replicas' executors.
    Start-up raises `EngineError`, or `ConfigError` for a flag the ranks' own check refused (rank.device_checks).
    """

    def __init__(
        self, config: EngineConfig, start_timeout_s: float | None = None, rendezvous: Rendezvous | None = None,
        replica: int = 0,
    ):
        self.config = config
        self.replica = replica
        self.rendezvous = rendezvous or Rendezvous.from_env()
        self.start_timeout_s = config.init_timeout_s if start_timeout_s is None else start_timeout_s
        self._ctx = rank_context()  # spawn, or a preloaded fork server (parallel/start_method.py)
        self._lock = threading.Lock()  # one request at a time
        self._seq = itertools.count(1)
        self._spool: Path | None = None  # created once the ranks are up, removed by close()
        self._procs: list[mp.process.BaseProcess] = []
        self._ready = False  # rank 0 reported Ready: the ranks take requests (and a Stop) from the queue
        self._ranks: list[int] = []  # global rank of each local process
        self.defaults: ModelDefaults = ModelDefaults()
        self.tasks: tuple[str, ...] = ()  # what the loaded DiTs serve (sent by rank 0 when ready)
        self.restarts = 0
        self.loads = 0  # times the ranks loaded the model (start-up and every restart)
        # A cancelled job (DELETE, shutdown, timeout) must stop within this; a step that takes longer (a runaway
        # request) is interrupted by restarting the ranks, so the engine is free for the next job.
        self.cancel_grace_s = 30.0
        self._cancel_requested: tuple[int, float] | None = None  # (seq, when)
        self._closed = False  # after close(), a dying rank is not restarted (shutdown, not a failure)
        self._start()

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _start(self) -> None:
        self._requests = self._ctx.Queue()
        self._events: multiprocessing.queues.Queue[Event] = self._ctx.Queue()
        self._cancel = self._ctx.Value("q", 0)  # seq of the job to cancel
        rendezvous = self.rendezvous.fresh()
        world = self.config.world_size
        self._ranks = list(rendezvous.local_ranks(world))
        self._procs = [
            start_rank(
                self._ctx,
                _rank_process,
                (rank, world, rendezvous.init_method, self.config, self._requests, self._events, self._cancel),
                {"local_rank": self.replica * len(self._ranks) + local_rank},
                name=f"h3serve-rank{rank}" if not self.replica else f"h3serve-replica{self.replica}-rank{rank}",
            )
            for local_rank, rank in enumerate(self._ranks)
        ]
        if not rendezvous.is_leader:
            return  # rank 0 (and its "ready") lives on the leader node
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                event = self._next_event(deadline, starting=True)
            except (TimeoutError, EngineError) as e:
                self._stop_procs()
                if isinstance(e, TimeoutError):
                    nodes = "; every node's h3serve must be running" if rendezvous.nnodes > 1 else ""
                    raise EngineError(
                        f"engine failed to start: the ranks did not load within {self.start_timeout_s:g}s "
                        f"(raise --init-timeout{nodes})"
                    ) from None
                raise
            if isinstance(event, Ready):
                self._ready = True
                self.defaults, self.tasks = event.defaults, event.tasks
                self.loads += 1
                if self._spool is None:
                    remove_stale_spools()
                    self._spool = Path(tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-"))
                return
            if isinstance(event, Fatal):
                self._stop_procs()
                if event.config_error:
                    raise ConfigError(event.message)
                raise EngineError(f"engine failed to start: {event.message}")

    def _stop_procs(self) -> None:
        self._ready = False
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

    def _recover(self) -> None:
        """Restart the ranks after a failure, so that the next request finds them loaded.

        Across nodes the new ranks wait until every node's ranks rejoin (a lost node may take long to come back,
        up to --init-timeout), so only this node's ranks stop now: they restart behind the failed request instead
        of holding back its error, and the next request waits for that restart (it takes the lock)."""
        if self.rendezvous.nnodes == 1:
            self.restart()
            return
        self._stop_procs()
        threading.Thread(target=self._restart_when_free, name="h3serve-rank-restart", daemon=True).start()

    def _restart_when_free(self) -> None:
        with self._lock:
            if self._closed or self.alive():
                return
            try:
                self.restart()
            except (EngineError, ConfigError) as e:
                if not self._closed:
                    log.warning("the ranks did not restart (the next request tries again): %s", e)
            if self._closed:  # closed while the ranks were starting
                self._stop_procs()

    def close(self) -> None:
        self._closed = True
        if self._ready and self.alive():  # else no rank reads the queue (starting, or a node without rank 0)
            self._requests.put(Stop())
            for p in self._procs:
                p.join(timeout=10)
        self._stop_procs()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def run_follower(self, poll_s: float = 1.0, restart: bool = True) -> None:
        """Non-leader nodes: keep the local ranks alive until they exit cleanly, which they do when the leader
        closes the engine. A rank that fails is restarted (it rejoins the leader's next group); with
        `restart=False` (one request, `h3serve generate`) the wait ends with `EngineError` instead, naming why."""
        while True:
            mp_connection.wait([p.sentinel for p in self._procs], timeout=poll_s)  # wakes when a rank exits
            codes = [p.exitcode for p in self._procs]
            if all(code == 0 for code in codes):
                return
            failed = [(rank, code) for rank, code in zip(self._ranks, codes, strict=True) if code not in (None, 0)]
            if failed and not restart:
                raise EngineError(self._follower_failure(*failed[0]))
            if failed:
                self.restart()

    def _follower_failure(self, rank: int, code: int) -> str:
        """Why a follower's rank ended: its own report (a rank reports before it exits), else its exit code."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return f"rank {rank} exited with code {code}"
            if isinstance(event, JobFailed):
                return event.message

    # -- requests --------------------------------------------------------------------------------------------

    def cancel(self, seq: int) -> None:
        """Ask the ranks to stop job `seq` at its next denoise step (several ranks: the one after, see
        h3serve.rank.worker.CancelVote); if that takes more than `cancel_grace_s` (one step running away),
        `generate` restarts the ranks instead."""
        self._cancel.value = seq
        self._cancel_requested = (seq, time.monotonic())

    def generate(
        self,
        plan: GenerationPlan,
        on_progress: ProgressCallback | None = None,
        on_start: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
        encoder: EncoderOptions | None = None,
    ) -> GenerationOutput:
        """Run one plan on all ranks. `on_start(seq)` gives the handle `cancel` takes.

        With `encoder` and `--decode-mode stream`, rank 0 writes the MP4 (and its previews) into the spool as the
        VAE clips come, and the output names those files; otherwise it holds the decoded arrays."""
        with self._lock:
            if self._closed:
                raise EngineError("the engine is shut down")
            if not self.alive():
                self.restart()
            job = RankJob(
                seq=next(self._seq),
                plan=plan,
                spool=str(self.spool_dir / f"job-{os.getpid()}-{time.time_ns()}.npz"),
                encoder=encoder if self.config.decode_mode == "stream" else None,
            )
            if on_start is not None:
                on_start(job.seq)
            self._requests.put(job)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                while True:
                    try:
                        event = self._next_event(self._wait_until(job.seq, deadline))
                    except TimeoutError:
                        self._give_up(job.seq, timeout_s, deadline)
                        continue
                    if getattr(event, "seq", None) != job.seq:
                        continue  # a late message about an earlier job
                    if isinstance(event, JobProgress) and on_progress is not None:
                        on_progress(event.done, event.total)
                    elif isinstance(event, Done):
                        return self._output(job.spool, event)
                    elif isinstance(event, JobCancelled):
                        if deadline is not None and time.monotonic() >= deadline:
                            raise TimeoutError(f"generation timed out after {timeout_s:g}s")
                        raise Cancelled(f"job {job.seq} was cancelled")
                    elif isinstance(event, JobFailed):
                        raise EngineError(self._root_cause(event), client_error=event.client_error, code=event.code)
            except EngineError:
                # With several ranks a failing rank exits (see worker_main), so the group is always rebuilt.
                if not self.alive() or self.config.world_size > 1:
                    self._recover()
                raise
            finally:
                self._cancel_requested = None

    # -- real-time sessions (h3serve.engine.realtime_stream) ----------------------------------------------------------

    def open_realtime(self, spec: RealtimeSpec, writer_factory: SegmentWriterFactory | None = None) -> RealtimeStream:
        """Check `spec`, take the ranks for a session (`RealtimeBusy` while a job or another session runs) and start
        it; `writer_factory` makes its segment writer (default: the fragmented-MP4 writer)."""
        if self.config.realtime_lora is None:
            raise RealtimeUnavailable()
        plan = plan_realtime(spec.prompt, spec.width, spec.height, spec.seed, spec.num_frames, spec.negative_prompt,
                             spec.extra, self.defaults)
        if writer_factory is None:
            writer_factory = FragmentWriter
        if not self._lock.acquire(blocking=False):
            raise RealtimeBusy()
        try:
            if self._closed:
                raise EngineError("the engine is shut down")
            if not self.alive():
                self.restart()
            seq = next(self._seq)
            writer = writer_factory(plan.width, plan.height)
            self._requests.put(RealtimeOpen(seq, plan, str(self._spool)))
        except BaseException:
            self._lock.release()
            raise
        return RealtimeStream(self, seq, plan, writer, self._end_session)

    @property
    def spool_dir(self) -> Path:
        assert self._spool is not None
        return self._spool

    def send(self, message: object) -> None:
        """A control message for the session in flight (rank 0 reads it at its next chunk boundary)."""
        self._requests.put(message)

    def next_event_for(self, seq: int, deadline: float | None) -> Event:
        """The next event about session `seq` (older ones skipped); `EngineError` when a rank died (the ranks are
        restarted first), `TimeoutError` past `deadline`."""
        while True:
            try:
                event = self._next_event(deadline)
            except EngineError:
                self._recover()
                raise
            if getattr(event, "seq", None) == seq:
                return event

    def failed(self, event: JobFailed) -> None:
        """Raise a session's failure as `EngineError` (several ranks: they exited, so they are restarted first)."""
        message = self._root_cause(event)
        if not self.alive() or self.config.world_size > 1:
            self._recover()
        raise EngineError(message, client_error=event.client_error, code=event.code)

    def abort(self, seq: int) -> None:
        """Stop session `seq` now: at its next chunk boundary, or by restarting the ranks after `cancel_grace_s`."""
        self.cancel(seq)
        deadline = time.monotonic() + self.cancel_grace_s
        while True:
            try:
                event = self.next_event_for(seq, deadline)
            except TimeoutError:
                self._recover()
                return
            except EngineError:
                return
            if isinstance(event, JobCancelled | RealtimeEnded | JobFailed):
                if isinstance(event, JobFailed) and self.config.world_size > 1:
                    self._recover()
                return

    def _end_session(self) -> None:
        self._cancel_requested = None
        self._lock.release()

    def _wait_until(self, seq: int, deadline: float | None) -> float | None:
        """When to stop waiting for events: the job's deadline, or the end of a pending cancel's grace."""
        requested = self._cancel_requested
        if requested is not None and requested[0] == seq:
            return requested[1] + self.cancel_grace_s  # stopping already: the grace decides, not the deadline
        return deadline

    def _give_up(self, seq: int, timeout_s: float | None, deadline: float | None) -> None:
        """The job's time is up or its cancel was not honoured in time: ask it to stop, and once the grace is
        over interrupt it by restarting the ranks (the only way into a step that runs away)."""
        requested = self._cancel_requested
        if requested is None or requested[0] != seq:
            self.cancel(seq)  # first: stop at the next step, with `cancel_grace_s` to do so
            return
        self._recover()
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"generation timed out after {timeout_s:g}s; the ranks were restarted to stop it")
        raise Cancelled(f"job {seq} was cancelled; the ranks were restarted to stop it within its step")

    def _root_cause(self, error: JobFailed, settle_s: float = 2.0) -> str:
        """With several ranks, a rank's error is often a symptom (its collective lost a peer that died): give
        the processes a moment to settle and name a rank that died without reporting, if any."""
        if len(self._procs) <= 1:
            return error.message
        reporters = {error.rank} if error.rank is not None else set()
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
                if isinstance(event, JobFailed) and event.rank is not None:
                    reporters.add(event.rank)
            silent = [(rank, code) for rank, code in dead if rank not in reporters]
            if silent:
                return f"rank {silent[0][0]} exited with code {silent[0][1]} while the request was running"
            if reporters <= {rank for rank, _ in dead}:
                break  # every reporter is gone and no other rank died: the report is the cause
        return error.message

    def _next_event(self, deadline: float | None, starting: bool = False) -> Event:
        """The next event from rank 0; EngineError if a rank died, TimeoutError past `deadline`.

        Waits on the event pipe and on every rank's sentinel together: a rank's death is noticed at once."""
        sentinels = [p.sentinel for p in self._procs]
        while True:
            # Checked before every read, not only when the queue is idle: steady progress events must not
            # postpone a timeout.
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError("the engine did not answer in time")
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            wake_s = WAKE_S if deadline is None else min(WAKE_S, max(0.0, deadline - now))
            # Queue._reader is the pipe end `get` reads: waiting on it with the sentinels avoids polling.
            ready = mp_connection.wait([self._events._reader, *sentinels], timeout=wake_s)  # type: ignore[attr-defined]
            if not any(r in sentinels for r in ready):
                continue
            try:  # a report a rank flushed before it exited comes first
                return self._events.get(timeout=0.05)
            except queue.Empty:
                pass
            dead = [p for p in self._procs if not p.is_alive()]
            if not dead:
                continue
            p = dead[0]
            rank = self._ranks[self._procs.index(p)]
            what = "starting the engine" if starting else "the request was running"
            raise EngineError(f"rank {rank} exited with code {p.exitcode} while {what}")

    def _output(self, spool: str, done: Done) -> GenerationOutput:
        """The job's output: the files rank 0 streamed, or the arrays it spooled; with the engine's counters."""
        from h3serve.media.raw import read_raw

        counters = {**(done.counters or {}), "engine_loads": self.loads}
        if done.files is not None:
            first, *others = (GenerationOutput(None, None, files=dict(files), streamed_frames=done.frames)
                              for files in done.files)
        else:
            media = []
            for index in range(done.outputs):
                path = spool_file(spool, index)
                video, audio, _, _ = read_raw(path)  # the file rank 0 wrote with write_raw
                os.unlink(path)
                media.append(GenerationOutput(video, audio))
            first, *others = media
        first.stage_durations, first.peak_memory_mb = done.stage_durations, done.peak_memory_mb
        first.stage_timeline = list(done.stage_timeline)
        first.counters = counters
        first.others = others
        return first
