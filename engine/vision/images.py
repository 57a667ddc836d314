"""Image bytes -> an RGB Pillow image, refusing what is not a decodable image of a
format we take, or too many pixels (checked from the header, before decoding).

Formats: PNG, JPEG, WebP, GIF (first frame), BMP, TIFF, plus HEIC/HEIF and AVIF where the
`pillow-heif` / `pillow-avif-plugin` packages are installed (Pillow 11.2+ reads AVIF
itself when built with libavif). Orientation follows the EXIF tag; the mode becomes RGB
(`Image.convert`, as mlx-vlm's `load_image` does: an alpha channel is dropped, not
composited)."""

from __future__ import annotations

import io
import warnings

from engine.step.request import PromptError

DEFAULT_MAX_PIXELS = 40_000_000            # 40 MP: a 100 MP image is refused unread
BASE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO")


class ImageError(PromptError):
    """An image the request carries that cannot be used (a 400 for the server)."""


def _plugins() -> tuple:
    """The optional formats whose Pillow plugins import here."""
    extra = []
    try:
        import pillow_heif
        pillow_heif.register_heif_opener()
        extra += ["HEIF"]
    except Exception:          # not installed (or unusable): HEIC stays unsupported
        pass
    try:
        import importlib
        importlib.import_module("pillow_avif")     # (registers the AVIF plugin)
        extra.append("AVIF")
    except Exception:
        pass
    from PIL import features
    if "AVIF" not in extra and features.check("avif"):
        extra.append("AVIF")
    return tuple(extra)


_FORMATS = None


def formats() -> tuple:
    """The image formats this process decodes (Pillow format names)."""
    global _FORMATS
    if _FORMATS is None:
        from PIL import Image
        extra = _plugins()
        Image.init()
        _FORMATS = tuple(f for f in BASE_FORMATS + extra if f in Image.OPEN)
    return _FORMATS


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS, where: str = "image"):
    """`data` (an encoded image) as an RGB `PIL.Image.Image`; ImageError if it is empty,
    not an image, a format not taken, over `max_pixels` pixels, or truncated/corrupt."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError(f"{where}: no image data")
    allowed = formats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # (ours below)
            img = Image.open(io.BytesIO(bytes(data)), formats=list(allowed))
            w, h = img.size
            if w < 1 or h < 1:
                raise ImageError(f"{where}: the image has no pixels ({w}x{h})")
            if w * h > max_pixels:
                raise ImageError(f"{where}: the image is {w}x{h} = {w * h:,} pixels, over the "
                                 f"limit of {max_pixels:,}")
            img.load()                     # decodes now: a truncated file fails here
            img = ImageOps.exif_transpose(img)
            return img.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not an image of a supported format "
                         f"({', '.join(f.lower() for f in allowed)})") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{where}: the image has too many pixels, over the limit ({e})") from None
    except Exception as e:     # any decoder failure is the image's fault, never a 5xx
        raise ImageError(f"{where}: the image could not be decoded "
                         f"(truncated or corrupt: {type(e).__name__}: {e})") from None
