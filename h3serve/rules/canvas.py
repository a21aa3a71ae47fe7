"""The canvas rule: the width x height a request generates. Its one home; `validate` applies it, the README and the
OpenAPI description state it.

- `aspect_ratio`: "W:H" (also "WxH", "W/H") or a number (`1.7778`), between 1:4 and 4:1; or `auto` / `adaptive`:
  FL2VA follows its first keyframe, Ref2VA takes 16:9, T2VA the checkpoint's default canvas (16:9).
- Without a size the canvas comes from the ratio (the request's, else the first keyframe's for FL2VA, else 16:9):
  short edge first, the area capped, both edges rounded to multiples of 32 (`geometry.resolve_canvas_size`).
- `short_edge` picks one of the model card's two canvas modes, 768 or 1440: 768 is the checkpoint's own canvas
  (`canvas_short_edge`, `canvas_max_pixels`: 768 and 768 x 1344 on the released checkpoint); 1440 scales both by
  1440 / 768 (short edge 1440, area cap 1440 x 2520: 16:9 gives 2528x1440).
- An explicit size (width/height, already floored to multiples of 32 by the HTTP layer) is generated as given;
  an `aspect_ratio` beside it must describe the same canvas: the ratio must be one that a canvas flooring to that
  size can have (W / (H + 32) <= ratio <= (W + 32) / H); `short_edge` beside it must give exactly that size.
"""

from __future__ import annotations

import math

from h3serve.errors import ClientError
from h3serve.rules import geometry, limits
from h3serve.rules.defaults import ModelDefaults
from h3serve.rules.shown import shown

AUTO_RATIOS = ("auto", "adaptive")
SHORT_EDGE_MODES = (768, 1440)  # the model card's canvas modes; the first is the checkpoint's own canvas
_TOLERANCE = 1e-6


class CanvasError(ClientError, ValueError):
    """A canvas field breaks the rule; `validate` turns it into its `RequestError` (same field, same text)."""

    code = "invalid_request"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def parse_aspect_ratio(text: str) -> tuple[float, float] | None:
    """"W:H" / "WxH" / "W/H" or a number -> (W, H); `auto` / `adaptive` -> None (the task decides)."""
    stripped = text.strip()
    if stripped.lower() in AUTO_RATIOS:
        return None
    parts = next((stripped.split(sep) for sep in (":", "x", "X", "/") if sep in stripped), [stripped, "1"])
    try:
        w, h = (float(p) for p in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        w = h = math.nan
    if not (math.isfinite(w) and math.isfinite(h) and w > 0 and h > 0):
        raise CanvasError(
            "aspect_ratio", f"must look like 16:9 (W:H), a number such as 1.7778, or auto, got {shown(text)}"
        )
    return w, h


def check_ratio(field: str, w: float, h: float) -> None:
    ratio = w / h
    if not limits.MIN_ASPECT_RATIO <= ratio <= limits.MAX_ASPECT_RATIO:
        raise CanvasError(field, f"aspect ratio {w:g}:{h:g} ({ratio:.3g}) is outside the supported range 1:4 to 4:1")


def mode_canvas(defaults: ModelDefaults, short_edge: object) -> tuple[int, float]:
    """(short edge, pixel cap) of the canvas mode `short_edge` names (None: the checkpoint's own)."""
    if short_edge is None:
        return defaults.canvas_short_edge, defaults.canvas_max_pixels
    if isinstance(short_edge, bool) or short_edge not in SHORT_EDGE_MODES:
        modes = " or ".join(map(str, SHORT_EDGE_MODES))
        raise CanvasError("short_edge", f"must be {modes} (the model card's canvas modes), got {shown(short_edge)}")
    scale = short_edge / SHORT_EDGE_MODES[0]
    return round(defaults.canvas_short_edge * scale), defaults.canvas_max_pixels * scale**2


def resolve_canvas(
    defaults: ModelDefaults,
    task: str,
    width: object = None,
    height: object = None,
    aspect_ratio: str | None = None,
    short_edge: object = None,
    keyframe_size: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """(height, width) by the module's rule; `keyframe_size` is the first FL2VA keyframe's (width, height)."""
    ratio = parse_aspect_ratio(aspect_ratio) if aspect_ratio is not None else None
    short, cap = mode_canvas(defaults, short_edge)
    if width is None and height is None:
        if ratio is None:  # absent, auto or adaptive
            ratio = keyframe_size if task == "fl2va" and keyframe_size is not None else limits.DEFAULT_ASPECT_RATIO
        aspect_w, aspect_h = ratio
        check_ratio("aspect_ratio", aspect_w, aspect_h)
        return geometry.resolve_canvas_size(aspect_w, aspect_h, short, cap)

    if width is None or height is None:
        raise CanvasError("width" if width is None else "height", "width and height must be given together")
    w, h = _explicit_edge("width", width, defaults), _explicit_edge("height", height, defaults)
    check_ratio("width", w, h)
    if ratio is not None:
        _check_agreement(aspect_ratio or "", ratio, w, h)
    if short_edge is not None and geometry.resolve_canvas_size(w, h, short, cap) != (h, w):
        expected_h, expected_w = geometry.resolve_canvas_size(w, h, short, cap)
        raise CanvasError(
            "short_edge", f"{short_edge} conflicts with width/height (size) {w}x{h}: that mode's canvas at this "
            f"aspect is {expected_w}x{expected_h}; send one of them, or values that agree"
        )
    return h, w


def _explicit_edge(field: str, value: object, defaults: ModelDefaults) -> int:
    m = limits.SPATIAL_MULTIPLE
    if isinstance(value, bool) or not isinstance(value, int):
        raise CanvasError(field, f"must be an integer, got {shown(value)}")
    if value < m or value > defaults.max_edge:
        raise CanvasError(field, f"must be between {m} and {defaults.max_edge} pixels, got {shown(value)}")
    if value % m:
        raise CanvasError(field, f"must be a multiple of {m}, got {shown(value)}")
    return value


def _check_agreement(text: str, ratio: tuple[float, float], w: int, h: int) -> None:
    """The ratio must be one a canvas that floors to w x h can have."""
    m = limits.SPATIAL_MULTIPLE
    r = ratio[0] / ratio[1]
    lo, hi = w / (h + m), (w + m) / h
    if not lo - _TOLERANCE <= r <= hi + _TOLERANCE:
        raise CanvasError(
            "aspect_ratio", f"{text.strip()!r} ({r:.4g}:1) conflicts with width/height (size) {w}x{h}: canvases "
            f"that floor to it on the {m}-pixel grid have ratios {lo:.4g} to {hi:.4g}; send one of them, or values "
            "that agree"
        )
