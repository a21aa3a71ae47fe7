"""A completed job's file as an HTTP answer, from wherever the output store keeps it:

- the data dir: the file itself (Starlette's file response: ranges, conditional requests);
- a bucket: streamed from the bucket with the client's `Range` header passed through (a 206 with the bucket's
  Content-Range, or a 416), or with `--output-redirect` a 302 to a presigned GET URL valid for
  `--output-url-ttl` seconds (after a HEAD, so a missing object is a 404 with a reason, not the bucket's).

Blocking calls (the bucket's GET and HEAD, every chunk) run in the thread pool, never on the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC
from email.utils import format_datetime

from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse

from h3serve.api.context import ServerContext
from h3serve.api.error_envelope import APIError
from h3serve.output_store.interface import ObjectRead, OutputMissing, RangeNotSatisfiable

log = logging.getLogger("h3serve.api")


def _missing(video_id: str, what: str) -> APIError:
    return APIError(404, f"The {what} of video '{video_id}' is missing from the output store (removed outside the "
                         "server); retrieve the job, or create it again.", "file_not_found")


def output_response(ctx: ServerContext, video_id: str, name: str, what: str, media_type: str, filename: str,
                    byte_range: str | None) -> Response:
    """The answer to a download of object `name` of job `video_id` (`what`: "video", "thumbnail", ... for errors).
    Call it from the thread pool."""
    outputs = ctx.manager.outputs
    if not outputs.remote:
        path = outputs.local_path(video_id, name)
        if path is None:
            raise APIError(404, f"The {what} of video '{video_id}' is not on disk.", "file_not_found")
        return FileResponse(path, media_type=media_type, filename=filename)
    if ctx.config.output_redirect:
        if outputs.head(video_id, name) is None:
            log.warning("job %s: %s is not in %s", video_id, name, outputs.describe())
            raise _missing(video_id, what)
        url = outputs.presigned_url(video_id, name, ctx.config.output_url_ttl_s, media_type, filename)
        return RedirectResponse(url or "", status_code=302, headers={"Cache-Control": "no-store"})
    try:
        read = outputs.read(video_id, name, byte_range)
    except OutputMissing:
        log.warning("job %s: %s is not in %s", video_id, name, outputs.describe())
        raise _missing(video_id, what) from None
    except RangeNotSatisfiable as e:
        raise APIError(416, f"Range: {e}.", "range_not_satisfiable", "Range",
                       headers={"Content-Range": f"bytes */{e.total}"} if e.total is not None else {}) from None
    headers = {
        "Content-Length": str(read.length),
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    if read.content_range is not None:
        headers["Content-Range"] = read.content_range
    if read.etag is not None:
        headers["ETag"] = read.etag
    if read.last_modified is not None:
        headers["Last-Modified"] = format_datetime(read.last_modified.astimezone(UTC), usegmt=True)
    return StreamingResponse(_body(read), status_code=206 if read.content_range else 200, media_type=media_type,
                             headers=headers)


def _body(read: ObjectRead) -> Iterator[bytes]:
    """The object's chunks (Starlette iterates a plain iterator in the thread pool); the bucket's stream is closed
    when the client has it all or goes away."""
    try:
        yield from read.chunks
    finally:
        read.close()
