"""Images: JPEG, PNG, WEBP or HEIC/HEIF, decoded with PIL to RGB with the EXIF orientation applied."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from PIL import Image, ImageOps

from h3serve.media.media_checks import ACCEPTED, check_image_size, inspect_file, reason
from h3serve.media.media_errors import MediaDecodeError, MediaError, MediaFormatError, MediaLimitError
from h3serve.rules import limits
from h3serve.rules.request import MediaRef

IMAGE_FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "heif": "HEIF"}  # sniffed name -> PIL format


@dataclass(frozen=True, eq=False)
class ImageMedia:
    name: str
    image: Image.Image  # RGB, EXIF orientation applied


@functools.cache
def register_heif() -> None:
    import pillow_heif

    pillow_heif.register_heif_opener()


def load_image(ref: MediaRef, field: str = "image") -> ImageMedia:
    """Decode a JPEG/PNG/WEBP/HEIC/HEIF image to RGB with its EXIF orientation applied."""
    fmt = inspect_file(ref, field, "image")
    if fmt.name not in IMAGE_FORMATS:
        raise MediaFormatError(ref.name, field, f"unsupported image format {fmt.label}", ACCEPTED["image"])
    try:
        if fmt.name == "heif":
            register_heif()
        with Image.open(ref.path, formats=[IMAGE_FORMATS[fmt.name]]) as img:
            # The header's size is checked before any pixel is decoded: refuses decompression bombs cheaply. The
            # limits are symmetric in width and height, so the orientation applied below cannot change the outcome.
            check_image_size(ref, field, *img.size)
            img.load()
            try:
                upright = ImageOps.exif_transpose(img)
            except Exception:  # a broken EXIF block does not make the pixels unusable
                upright = img
            image = upright.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError:
        raise MediaLimitError(
            ref.name,
            field,
            "image has too many pixels",
            f"both image edges {limits.MEDIA_IMAGE_MIN_EDGE}-{limits.MEDIA_IMAGE_MAX_EDGE} px",
        ) from None
    except ImportError:
        raise MediaFormatError(
            ref.name, field, "HEIC/HEIF support (pillow-heif) is not installed", ACCEPTED["image"]
        ) from None
    except Exception as exc:
        raise MediaDecodeError(
            ref.name, field, f"cannot decode the {fmt.label} image ({reason(exc, ref)})", "a complete, valid file"
        ) from None
    return ImageMedia(name=ref.name, image=image)
