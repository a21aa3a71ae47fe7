"""A create request's ControlNet control (`extra_params.<type>` and the uploads `control_reference`,
`source_reference`, `mask_reference`) as the request's `ControlRequest`.

A path is read only under the operator's `--control-dir`: without one only uploads are accepted; `..`, a symlink
out of it and an absolute path elsewhere are a 400 before anything is opened. An upload and a path for the same
part are a 400 too.
"""

from __future__ import annotations

from pathlib import Path

from h3serve.api.error_envelope import bad_request
from h3serve.api.intake.request_model import VideoCreateFields
from h3serve.errors import RequestError
from h3serve.rules.names import CONTROL_TYPES
from h3serve.rules.request import ControlRequest, MediaRef
from h3serve.rules.request_paths import is_file, path_under

CONTROL_UPLOADS = {"control_reference": "control", "source_reference": "source", "mask_reference": "mask"}


def allowed_path(text: str, root: Path | None, param: str) -> Path:
    """`text` as a file inside the allow-listed `root`, without opening anything; a 400 naming `param` otherwise
    (h3serve.rules.request_paths: `..`, escapes, over-long names, any OSError)."""
    if root is None:
        raise bad_request(f"{param}: this server reads no control paths (it was started without --control-dir); "
                          "upload the file instead", param)
    try:
        real = path_under(text, root, param, "the control directory the server allows (--control-dir)")
        if not is_file(real, param):
            raise RequestError(param, "no such file under --control-dir")
    except RequestError as e:
        raise bad_request(str(e), param) from None
    return real


def control_types_given(fields: VideoCreateFields) -> list[str]:
    """The control types a request's extra_params names."""
    extra = fields.extra_params
    return [name for name in CONTROL_TYPES if extra is not None and getattr(extra, name) is not None]


def control_request(
    fields: VideoCreateFields, uploads: dict[str, MediaRef], root: Path | None
) -> ControlRequest | None:
    """The request's control, or None; `uploads`: the stored control uploads by field name."""
    extra = fields.extra_params
    given = control_types_given(fields)
    if len(given) > 1:
        raise bad_request(f"extra_params: one control type per request, got {', '.join(given)}",
                          f"extra_params.{given[1]}")
    if not given:
        if uploads:
            name = next(iter(uploads))
            raise bad_request(f"{name}: needs a control type in extra_params ({', '.join(CONTROL_TYPES)})", name)
        return None
    kind = given[0]
    settings = getattr(extra, kind)
    parts: dict[str, MediaRef | None] = {}
    for upload_field, part in CONTROL_UPLOADS.items():
        text = getattr(settings, f"{part}_path")
        param = f"extra_params.{kind}.{part}_path"
        if text is not None and upload_field in uploads:
            raise bad_request(f"{param}: give the path or the upload {upload_field}, not both", param)
        parts[part] = uploads.get(upload_field) or (None if text is None else MediaRef(
            allowed_path(text, root, param), text, "image" if part == "mask" else "video"))
    return ControlRequest(kind, control=parts["control"], source=parts["source"], mask=parts["mask"],
                          scale=settings.control_context_scale)
