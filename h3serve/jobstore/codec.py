"""Job <-> database row: the request as JSON (media files as tagged objects), errors and stage times as JSON."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from h3serve.jobstore.records import Job, JobError
from h3serve.rules.adapter_choice import AdapterChoice
from h3serve.rules.request import ControlRequest, GenerationRequest, MediaRef, TimelineGuide

log = logging.getLogger("h3serve.store")
COLUMNS = tuple(f.name for f in fields(Job) if f.name != "seq")


def encode_request(request: GenerationRequest) -> str:
    def encode(value: Any) -> Any:
        if isinstance(value, MediaRef):
            return {"$media": {"path": str(value.path), "name": value.name, "kind": value.kind}}
        if isinstance(value, AdapterChoice):
            return {"$lora": dataclasses.asdict(value)}
        if isinstance(value, ControlRequest):
            return {"$control": {f.name: encode(getattr(value, f.name)) for f in fields(value)}}
        if isinstance(value, TimelineGuide):
            return {"$guide": {f.name: encode(getattr(value, f.name)) for f in fields(value)}}
        if isinstance(value, tuple | list):
            return [encode(v) for v in value]
        return value

    return json.dumps({f.name: encode(getattr(request, f.name)) for f in fields(request)})


def decode_request(text: str) -> GenerationRequest:
    def decode(value: Any) -> Any:
        if isinstance(value, dict) and "$media" in value:
            media = value["$media"]
            return MediaRef(path=Path(media["path"]), name=media["name"], kind=media["kind"])
        if isinstance(value, dict) and "$lora" in value:
            return AdapterChoice.from_dict(value["$lora"])
        if isinstance(value, dict) and "$control" in value:
            return ControlRequest(**{k: decode(v) for k, v in value["$control"].items()})
        if isinstance(value, dict) and "$guide" in value:
            return TimelineGuide(**{k: decode(v) for k, v in value["$guide"].items()})
        if isinstance(value, list):
            return tuple(decode(v) for v in value)
        return value

    known = {f.name for f in fields(GenerationRequest)}
    return GenerationRequest(**{k: decode(v) for k, v in json.loads(text).items() if k in known})


def to_sql(name: str, value: Any) -> Any:
    """One field's column value."""
    if name == "request":
        return encode_request(value)
    if name in ("stage_durations", "stage_timeline"):
        return json.dumps(value)
    if name == "error":
        return None if value is None else json.dumps({"code": value.code, "message": value.message})
    if name in ("sync", "expired"):
        return int(bool(value))
    return value


def from_row(row: Mapping[str, Any]) -> Job:
    values = {name: row[name] for name in COLUMNS}
    values["request"] = decode_request(values["request"])
    values["stage_durations"] = json.loads(values["stage_durations"])
    values["stage_timeline"] = tuple((str(s), float(a), float(b)) for s, a, b in json.loads(values["stage_timeline"]))
    values["error"] = None if values["error"] is None else JobError(**json.loads(values["error"]))
    values["sync"], values["expired"] = bool(values["sync"]), bool(values["expired"])
    return Job(seq=row["seq"], **values)


def decoded(row: Mapping[str, Any]) -> Job | None:
    """A listed row; None (logged) for one that no longer decodes, so it cannot break a whole page."""
    try:
        return from_row(row)
    except Exception:
        log.exception("job %s: its stored record does not decode; left out of the listing", row["id"])
        return None
