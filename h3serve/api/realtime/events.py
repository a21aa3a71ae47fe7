"""The messages of `WS /v1/realtime/video`, with vLLM-Omni's names and shapes (serving_video_output_stream.py).

Client -> server, JSON text: `session.start` (first), then `session.interaction`, `session.ping`, `session.stop`.
Server -> client: `video.start`; per chunk a `video.chunk_metadata` then one binary fragmented-MP4 segment;
`session.interaction.queued`, `session.pong`, `session.done`, `error`.

`session.start` carries vLLM-Omni's video request fields; its `sampling_params` are folded in as vLLM-Omni folds
them (a key the request has moves to the top level unless given there, any other joins `extra_params`). What a
session cannot do is refused by the session's rules (h3serve.rules.validate.realtime_plan), naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from h3serve.engine.realtime_stream import RealtimeChunk, RealtimeSpec
from h3serve.errors import RequestError
from h3serve.rules import limits
from h3serve.rules.shown import shown

# Counts are checked against the session's rules (h3serve.rules.validate.realtime); this bound only keeps what a
# message may carry small: seconds x fps must never make a number too long to work with (a 4,300-digit `seconds`
# ended a session as an internal error while its check formatted it).
MAX_COUNT = 1_000_000
Count = Annotated[StrictInt, Field(ge=1, le=MAX_COUNT)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VideoParams(_Message):
    width: Count | None = None
    height: Count | None = None
    num_frames: Count | None = None
    fps: Count | None = None


class SessionStart(_Message):
    """The session's settings (vLLM-Omni's VideoGenerationRequest fields, plus `format` and `sampling_params`)."""

    type: Literal["session.start"]
    format: Literal["m4s"] = "m4s"
    model: str | None = None
    prompt: str
    negative_prompt: str | None = None
    size: Annotated[str, Field(pattern=r"^\d{1,6}x\d{1,6}$")] | None = None
    seconds: Annotated[str, Field(pattern=r"^[1-9]\d{0,5}$")] | Count | None = None  # at most 999,999 either way
    width: Count | None = None
    height: Count | None = None
    num_frames: Count | None = None
    fps: Count | None = None
    seed: Annotated[StrictInt, Field(ge=limits.SEED_MIN, le=limits.SEED_MAX)] | None = None
    video_params: VideoParams | None = None
    user: str | None = None
    sampling_params: dict[str, Any] | None = None
    extra_params: dict[str, Any] | None = None
    # vLLM-Omni request fields a session gives no meaning to: taken, and handed to the session's rules, which refuse
    # those that contradict the streaming LoRA (steps, shifts, an adapter, an image) and ignore the others
    num_inference_steps: Any = None
    guidance_scale: Any = None
    guidance_scale_2: Any = None
    true_cfg_scale: Any = None
    boundary_ratio: Any = None
    flow_shift: Any = None
    generate_sound: Any = None
    lora: Any = None
    image_reference: Any = None

    @classmethod
    def fold(cls, message: dict[str, Any]) -> dict[str, Any]:
        """`message` with its `sampling_params` folded in, as vLLM-Omni does (`_coerce_request_data`)."""
        sampling, extra = message.get("sampling_params"), message.get("extra_params")
        if not isinstance(sampling, dict) or not isinstance(extra, dict | None):
            return message  # the schema names what is wrong
        folded = {k: v for k, v in message.items() if k != "sampling_params"}
        extra = dict(extra or {})
        for key, value in sampling.items():
            if key in cls.model_fields and key not in folded and key not in ("type", "format", "sampling_params"):
                folded[key] = value
            else:
                extra[key] = value
        if extra:
            folded["extra_params"] = extra
        return folded

    def spec(self, served_model: str) -> RealtimeSpec:
        """The session the fields ask for (a `RequestError` naming the field for the few rules checked here; the
        rest are the engine's)."""
        if self.model is not None and self.model != served_model:
            raise RequestError("model", f"this server runs {served_model!r}, not {shown(self.model)}")
        params = self.video_params or VideoParams()
        width, height = self.width or params.width, self.height or params.height
        if self.size is not None:
            width, height = (int(edge) for edge in self.size.split("x"))
        if width is None and height is None:
            width, height = limits.REALTIME_DEFAULT_SIZE
        elif width is None or height is None:
            raise RequestError("width" if width is None else "height", "give width and height together (or size)")
        fps = self.fps or params.fps
        num_frames = self.num_frames or params.num_frames
        if num_frames is None and self.seconds is not None:
            num_frames = int(self.seconds) * (fps or limits.FPS)
            if num_frames > limits.MAX_REALTIME_FRAMES:
                raise RequestError("seconds", f"at most {limits.MAX_REALTIME_FRAMES // limits.FPS} s of "
                                              f"{limits.FPS} fps video per session, got {int(self.seconds):,} s")
        extra = self._passed_on() | (self.extra_params or {})
        if fps is not None:
            extra.setdefault("fps", fps)
        return RealtimeSpec(self.prompt, width, height, limits.DEFAULT_SEED if self.seed is None else self.seed,
                            limits.MAX_REALTIME_FRAMES if num_frames is None else num_frames,
                            self.negative_prompt, extra)

    def _passed_on(self) -> dict[str, Any]:
        names = ("num_inference_steps", "guidance_scale", "guidance_scale_2", "true_cfg_scale", "boundary_ratio",
                 "flow_shift", "generate_sound", "lora", "image_reference")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class InteractionEvent(_Message):
    prompt: str
    negative_prompt: None = None  # vLLM-Omni: "not supported in this release"


class InteractionBody(_Message):
    event_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    event: InteractionEvent
    transition_chunks: Annotated[StrictInt, Field(ge=0)] | None = None


class SessionInteraction(_Message):
    type: Literal["session.interaction"]
    interaction: InteractionBody


class SessionPing(_Message):
    type: Literal["session.ping"]


class SessionStop(_Message):
    type: Literal["session.stop"]


ControlMessage = Annotated[SessionInteraction | SessionPing | SessionStop, Field(discriminator="type")]
CONTROL_TYPES = ("session.interaction", "session.ping", "session.stop")


# -- server -> client ----------------------------------------------------------------------------------------------


class VideoStart(BaseModel):
    type: Literal["video.start"] = "video.start"
    request_id: str
    format: Literal["m4s"] = "m4s"
    config: dict[str, Any]  # the session's settings as understood (the defaults filled in)


class ChunkMetadata(BaseModel):
    """Announces the binary segment that follows it."""

    type: Literal["video.chunk_metadata"] = "video.chunk_metadata"
    request_id: str
    kind: Literal["media", "trailer"]
    num_frames: int
    num_audio_samples: int
    audio_sample_rate: int
    byte_length: int
    generation_chunk_index: int | None  # the engine's chunk index; None for the trailer
    transport_chunk_index: int  # segments sent before this one
    started_event_ids: list[str]
    active_event_ids: list[str]
    completed_event_ids: list[str]

    @classmethod
    def of(cls, chunk: RealtimeChunk, request_id: str, transport_index: int) -> ChunkMetadata:
        media = chunk.kind == "media"
        return cls(request_id=request_id, kind=chunk.kind, num_frames=chunk.frames,
                   num_audio_samples=chunk.audio_samples, audio_sample_rate=chunk.sample_rate,
                   byte_length=len(chunk.segment), generation_chunk_index=chunk.index if media else None,
                   transport_chunk_index=transport_index, started_event_ids=list(chunk.started_event_ids),
                   active_event_ids=list(chunk.active_event_ids), completed_event_ids=list(chunk.completed_event_ids))


class InteractionQueued(BaseModel):
    type: Literal["session.interaction.queued"] = "session.interaction.queued"
    request_id: str
    event_id: str


class Pong(BaseModel):
    type: Literal["session.pong"] = "session.pong"


class SessionDone(BaseModel):
    type: Literal["session.done"] = "session.done"
    request_id: str
    chunks: int  # segments sent, the trailer included
    stopped: bool  # ended by session.stop before its last chunk


class ErrorMessage(BaseModel):
    type: Literal["error"] = "error"
    message: str
    code: str
    request_id: str | None = None
    event_id: str | None = None
