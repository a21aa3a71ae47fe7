"""A real-time session on a rank's loaded engine (every rank of the group runs it together).

Rank 0 holds the parent's side of the conversation: at every chunk boundary it drains the session's control messages
(a new prompt, stop, which chunks the parent took) and the cancel flag, decides the boundary (`Boundary`) and
broadcasts it, so every rank applies
the same prompt to the same chunk and leaves at the same boundary. Every rank then runs the chunk
(h3serve.model.realtime.causal_session): the streaming LoRA on for the student and off for the audio teacher through the
engine's LoRA runtime, the causal attention inside the Ulysses all-to-all under sequence parallelism. Rank 0 writes
each chunk's frames and audio to a spool file and tells the parent (`RealtimeChunkReady`).

Interactions follow vLLM-Omni's TaoMate-H3: last write wins between two boundaries (an overwritten prompt is
reported completed, never started); the prompt applied at a boundary is a hard switch (transition_chunks does not
apply: prompts of different lengths cannot be blended), so its event is started, active and completed with the first
chunk generated after it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from weakref import WeakKeyDictionary

import torch.distributed as dist

from h3serve.adapters.serving import dit_config
from h3serve.adapters.taomate import inspect_taomate
from h3serve.engine.realtime_stream import SegmentWriter
from h3serve.errors import RequestError
from h3serve.media.raw import write_chunk
from h3serve.messages import (
    JobCancelled,
    RealtimeChunkReady,
    RealtimeEnded,
    RealtimeInteract,
    RealtimeOpen,
    RealtimeRead,
    RealtimeStop,
    Stop,
)
from h3serve.model.realtime.causal_attention import CausalAttention, whole_heads
from h3serve.model.realtime.causal_session import CausalSession, ChunkMedia
from h3serve.model.realtime.prompt import encode_prompt
from h3serve.model.transformer import H3Transformer
from h3serve.parallel.sequence import SequenceParallel
from h3serve.parallel.ulysses import head_sharded
from h3serve.rank.lora import EngineLora
from h3serve.rank.placement import device_memory_of, realtime_refusal
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.realtime_geometry import CHUNKS_AHEAD
from h3serve.rules.validate.realtime_plan import RealtimePlan

REALTIME_ADAPTER = "realtime-lora"


@dataclass(frozen=True)
class Boundary:
    """What rank 0 decided at a chunk boundary: the prompt to switch to (None: keep), the interaction events this
    boundary starts and completes, and whether the session ends here (stop), is aborted (cancel) or the rank exits."""

    prompt: str | None = None
    started: tuple[str, ...] = ()
    completed: tuple[str, ...] = ()
    stop: bool = False
    cancel: bool = False
    exit: bool = False


class Inbox:
    """Rank 0's reading of the parent's queue for session `seq`: at each boundary, the controls that arrived since
    the last one; the boundary waits while the reader is `CHUNKS_AHEAD` chunks behind (the spool and a new prompt's
    latency stay bounded), unless the session is stopping or cancelled."""

    def __init__(self, requests, seq: int, cancel_value, wake_s: float = 0.2):
        self.requests, self.seq, self.cancel_value, self.wake_s = requests, seq, cancel_value, wake_s
        self.generated = 0  # chunks generated so far (one per boundary but the last)
        self.read = 0  # chunks the parent has taken
        self.prompt: str | None = None
        self.event: str | None = None
        self.superseded: list[str] = []
        self.stop = self.exit = False

    def boundary(self) -> Boundary:
        self._drain(block=False)
        while self.generated - self.read >= CHUNKS_AHEAD and not self._ends():
            self._drain(block=True)
        started = () if self.event is None else (self.event,)
        boundary = Boundary(self.prompt, started, (*self.superseded, *started), self.stop, self._cancelled(),
                            self.exit)
        self.prompt, self.event, self.superseded = None, None, []
        self.generated += 1
        return boundary

    def _cancelled(self) -> bool:
        return self.cancel_value.value == self.seq

    def _ends(self) -> bool:
        return self.stop or self.exit or self._cancelled()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self.requests.get(timeout=self.wake_s) if block else self.requests.get_nowait()
            except queue.Empty:
                return
            block = False  # after the first item, take what else is there and return
            if isinstance(item, Stop):
                self.exit = True
            elif getattr(item, "seq", None) != self.seq:
                continue  # a late control of an earlier session
            elif isinstance(item, RealtimeInteract):
                if self.event is not None:
                    self.superseded.append(self.event)
                self.prompt, self.event = item.prompt, item.event_id
            elif isinstance(item, RealtimeRead):
                self.read = max(self.read, item.index + 1)
            elif isinstance(item, RealtimeStop):
                self.stop = True


class LoraToggle:
    """The session's `LoraSwitch` on the engine's LoRA runtime: the streaming LoRA on the T2VA DiT, or none."""

    def __init__(self, lora: EngineLora, choice: AdapterChoice):
        self.lora, self.choice = lora, choice

    def student(self) -> None:
        self.lora.activate("transformer", self.choice)

    def base(self) -> None:
        self.lora.activate("transformer", None)


def realtime_choice(config) -> AdapterChoice:
    """The engine's --realtime-lora as the adapter the LoRA runtime activates (scale 1: the layers use alpha / r)."""
    info = inspect_taomate(config.realtime_lora, dit_config(config.model, config.dits))
    return AdapterChoice(REALTIME_ADAPTER, str(info.folder), 1.0, 0, info.rank, info.alpha)


def _shared(boundary: Boundary | None, rank: int, world: int) -> Boundary:
    if world == 1:
        assert boundary is not None
        return boundary
    box = [boundary if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


_ATTENTION: WeakKeyDictionary[H3Transformer, CausalAttention] = WeakKeyDictionary()


def _attention(dit: H3Transformer, sequence: SequenceParallel | None) -> CausalAttention:
    """The DiT's causal attention, made once (inside the Ulysses all-to-all under sequence parallelism)."""
    if dit not in _ATTENTION:
        wrap = whole_heads if sequence is None else (lambda core: head_sharded(core, sequence.ulysses_group))
        _ATTENTION[dit] = CausalAttention(dit, wrap)
    return _ATTENTION[dit]


Deliver = Callable[[ChunkMedia, Boundary], None]  # rank 0's hand-over of a chunk (its media, the boundary before it)


def run_session(engine, job: RealtimeOpen, rank: int, world: int, decide: Callable[[], Boundary] | None,
                deliver: Deliver, emit: Callable[[object], None]) -> Boundary:
    """Session `job` on this rank's `engine` (a ModelRunner), boundary by boundary until its last chunk, a stop, a
    cancel or an exit; returns the last boundary. `decide` (rank 0's inbox), `deliver` and `emit` (the end) act on
    rank 0 only."""
    config, plan = engine.config, job.plan
    if config.realtime_lora is None or engine.lora is None:
        raise RequestError("realtime", "this server runs no real-time sessions (start it with --realtime-lora)")
    refusal = realtime_refusal(config, plan, device_memory_of(config, engine.device))
    if refusal is not None:
        raise RequestError("width", f"this server cannot run the session: {refusal}")
    components = engine.pipeline.components
    sequence = engine.parallel.sequence if engine.parallel is not None else None
    ulysses = 1 if sequence is None else sequence.ulysses
    lora = LoraToggle(engine.lora, realtime_choice(config))
    heads = components.transformer.config.num_attention_heads // ulysses
    session = CausalSession(components, engine.device, plan.width, plan.height, plan.seed, plan.chunks, lora,
                            heads=heads, attention=_attention(components.transformer, sequence), emit=rank == 0)
    prompt = encode_prompt(components, plan.prompt)
    try:
        while True:
            boundary = _shared(decide() if rank == 0 and decide is not None else Boundary(), rank, world)
            if rank == 0 and (boundary.cancel or boundary.exit):
                emit(JobCancelled(job.seq))
            if boundary.cancel or boundary.exit:
                return boundary
            if boundary.stop or session.done:
                if rank == 0:
                    emit(RealtimeEnded(job.seq, session.next, stopped=boundary.stop and not session.done))
                return boundary
            if boundary.prompt is not None:
                prompt = encode_prompt(components, boundary.prompt)
            media = session.run_chunk(prompt)
            if rank == 0:
                deliver(media, boundary)
    finally:
        session.close()
        lora.base()


def spool_chunk(job: RealtimeOpen, emit: Callable[[object], None]) -> Deliver:
    """Rank 0's hand-over to the parent: the chunk's media in a spool file, then `RealtimeChunkReady`."""

    def deliver(media: ChunkMedia, boundary: Boundary) -> None:
        path = Path(job.spool_dir) / f"chunk-{job.seq}-{media.chunk.index}.npz"
        write_chunk(path, media.frames.numpy(), media.audio.T.numpy())
        emit(RealtimeChunkReady(job.seq, media.chunk.index, str(path), media.frames.shape[0], media.audio.shape[1],
                                boundary.started, boundary.started, boundary.completed))

    return deliver


def generate_offline(engine, plan: RealtimePlan, writer: SegmentWriter | None) -> int:
    """A whole session on this rank's `engine` (with its peers when it has some; no interactions), each chunk's
    frames uint8 [t, H, W, 3] and audio float32 [S, 2] handed to `writer` as a streaming client of the same plan
    receives them (rank 0's writer; None on the others). Returns the chunks. `h3serve generate --realtime-lora`."""

    def deliver(media: ChunkMedia, _boundary: Boundary) -> None:
        if writer is not None:
            writer.segment(media.frames.numpy(), media.audio.T.numpy())

    run_session(engine, RealtimeOpen(0, plan, ""), engine.rank, engine.world_size, None, deliver, lambda event: None)
    return plan.chunks
