"""Images in requests, from the three protocols' wire shapes to the engine's
`vision_prompt` (the server only translates; decoding and preprocessing are the engine's).

- OpenAI chat: `{"type": "image_url", "image_url": {"url": ...}}` (or the URL as a string);
- Anthropic Messages: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`
  (or `{"type": "url", "url"}`);
- OpenAI Responses: `{"type": "input_image", "image_url": ...}`.

`data:` URLs (base64) always; http(s) URLs only with `--allow-image-urls`, fetched with a
size cap and a timeout, never from loopback, link-local, private or reserved addresses
unless `--allow-private-image-urls`. While a protocol's messages are normalized
(`collect`), each image part becomes the marker U+FFFC in the message's text; `as_parts`
turns the markers into the templates' `{"type": "image"}` parts."""

from __future__ import annotations

import base64
import binascii
import contextvars
import ipaddress
import socket
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from .errors import bad_request

MARK = "\ufffc"          # an image part's place in a message's text
IMAGE_TYPES = ("image_url", "image", "input_image")
IMAGE_PAYLOAD_KEYS = ("image_url", "source")    # an image part's keys that hold the image
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_URL_TIMEOUT_S = 10.0
MAX_IMAGES = 16


@dataclass
class ImageRef:
    data: Optional[bytes] = None      # decoded data: URL / base64 source
    url: Optional[str] = None         # an http(s) URL, fetched by `fetch_all`
    where: str = "image"


@dataclass
class Collector:
    vision: bool
    refs: list


_active: contextvars.ContextVar = contextvars.ContextVar("image_collector", default=None)


@contextmanager
def collect(state):
    """Collect the image parts of the messages normalized inside (into the yielded list)."""
    from engine import has_vision
    refs: list = []
    token = _active.set(Collector(has_vision(getattr(state, "model", None)), refs))
    try:
        yield refs
    finally:
        _active.reset(token)


def _media_type(media, where: str) -> None:
    """A declared media type must be an image's or none/generic bytes (a browser's
    FileReader names a file of unknown type application/octet-stream); the bytes then
    decide the format."""
    if media is None or str(media).strip().lower() in ("", "application/octet-stream"):
        return
    if not isinstance(media, str) or not media.strip().lower().startswith("image/"):
        raise bad_request(f"{where}: the image's media type must be image/* (such as "
                          f"image/png), got {str(media)[:64]!r}")


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise bad_request(f"{where}: a data: URL must be data:<type>;base64,<data>")
    _media_type(head[5:-7].split(";")[0], where)
    return _b64(payload, where)


def _b64(payload, where: str) -> bytes:
    if not isinstance(payload, str) or not payload:
        raise bad_request(f"{where}: the image data is empty")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the image data is not valid base64") from None


def _from_url(url, where: str) -> ImageRef:
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}: the image needs a URL (a data: URL or http(s))")
    if url.startswith("data:"):
        return ImageRef(data=_data_url(url, where), where=where)
    if urllib.parse.urlsplit(url).scheme.lower() in ("http", "https"):
        return ImageRef(url=url, where=where)
    raise bad_request(f"{where}: image URLs must be data: or http(s) URLs")


def image_part(part: dict, where: str) -> str:
    """An image part of any protocol, recorded in the active collector: its MARK.
    A 400 when images are not taken here or the part is malformed."""
    c = _active.get()
    if c is None or not c.vision:
        raise bad_request(f"{where}: {part.get('type')} content is not supported: this model "
                          "has no vision tower")
    t = part.get("type")
    if t == "image_url":
        v = part.get("image_url")
        ref = _from_url(v.get("url") if isinstance(v, dict) else v, where)
    elif t == "input_image":
        ref = _from_url(part.get("image_url"), where)
    else:                                    # Anthropic's image block
        src = part.get("source")
        if not isinstance(src, dict):
            raise bad_request(f"{where}: an image block needs a source object")
        if src.get("type") == "base64":
            _media_type(src.get("media_type"), where)
            ref = ImageRef(data=_b64(src.get("data"), where), where=where)
        elif src.get("type") == "url":
            ref = _from_url(src.get("url"), where)
        else:
            raise bad_request(f"{where}: image source type must be base64 or url")
    if len(c.refs) >= MAX_IMAGES:
        raise bad_request(f"at most {MAX_IMAGES} images per request")
    c.refs.append(ref)
    return MARK


def as_parts(messages: list, count: int) -> list:
    """Messages whose text holds MARKs with `{"type": "image"}` parts in their places."""
    seen, out = 0, []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and MARK in c:
            if m.get("role") != "user":
                raise bad_request(f"images are accepted in user messages only (a {m.get('role')!r} "
                                  "message holds one)")
            parts = []
            for i, piece in enumerate(c.split(MARK)):
                if i:
                    parts.append({"type": "image"})
                    seen += 1
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
        out.append(m)
    if seen != count:
        raise bad_request("the messages' text may not contain U+FFFC (the image marker)")
    return out


def _check_host(url: str, allow_private: bool) -> None:
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        raise bad_request(f"{url!r}: no host")
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as e:
        raise bad_request(f"image URL host {host!r} does not resolve ({e})") from None
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if not allow_private and (ip.is_loopback or ip.is_link_local or ip.is_private
                                  or ip.is_reserved or ip.is_multicast or ip.is_unspecified):
            raise bad_request(f"image URL host {host!r} is a loopback, link-local or private "
                              "address (--allow-private-image-urls to allow)")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **k):    # a redirect could point anywhere: not followed
        return None


def fetch(url: str, max_bytes: int, timeout: float, allow_private: bool) -> bytes:
    _check_host(url, allow_private)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "mlx-parity"}),
                         timeout=timeout) as r:
            if r.status != 200:
                raise bad_request(f"image URL answered HTTP {r.status}")
            data = r.read(max_bytes + 1)
    except OSError as e:
        raise bad_request(f"image URL could not be fetched ({e})") from None
    if len(data) > max_bytes:
        raise bad_request(f"image at URL is over {max_bytes:,} bytes")
    return data


def fetch_all(refs: list, config) -> list:
    """The images' bytes (URLs fetched when allowed); runs on a worker thread."""
    out = []
    cap = getattr(config, "max_image_bytes", DEFAULT_MAX_IMAGE_BYTES)
    for ref in refs:
        if ref.data is not None:
            data = ref.data
        elif not getattr(config, "allow_image_urls", False):
            raise bad_request(f"{ref.where}: http(s) image URLs are off on this server "
                              "(--allow-image-urls); send the image as a data: URL")
        else:
            data = fetch(ref.url, cap, getattr(config, "image_url_timeout", DEFAULT_URL_TIMEOUT_S),
                         getattr(config, "allow_private_image_urls", False))
        if len(data) > cap:
            raise bad_request(f"{ref.where}: the image is over {cap:,} bytes")
        out.append(data)
    return out


def vision_encode(state, call) -> tuple:
    """(prompt ids, engine.VisionInput) of a call with images; a 400 for any bad image."""
    from engine import PromptError

    if getattr(state.config, "tensor_parallel", False):
        raise bad_request("images are not supported on a tensor-parallel server")
    data = fetch_all(call.images, state.config)
    messages = as_parts(call.messages, len(data))
    try:
        return state.engine.vision_prompt(messages, data, tools=call.tools,
                                          template_kwargs=call.template_kwargs)
    except PromptError as e:
        raise bad_request(str(e)) from None
