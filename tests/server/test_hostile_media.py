"""A hostile probe of the image and embeddings surfaces (the cases not covered by
test_images.py, test_hostile_images.py, test_images_models.py and test_embeddings.py).

The contract: bad input is a 4xx in the protocol's error shape (OpenAI `{"error": {...}}`,
Anthropic `{"type": "error", ...}`), never a 5xx, a traceback, a hang, a stall of other
requests, a filesystem path or a "success" that is not one; the server keeps serving.

Servers: the gemma3_vision fixture (most cases), Gemma 4 with `use_bidirectional_attention:
"vision"` and Qwen2.5-VL (odd images, the same image twice), and the qwen3 text fixture
(`srv` of conftest: image parts on a text-only model, embeddings).

The tests under "findings" assert the correct behaviour where the probe found a bug (each
fixed in 0.5.4; the comment above each says what it was)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from srv_helpers import NO_EOS, sse_events, start_server, stop_server
from starter.vision import ensure_vision_fixture

ROUTES = ("chat", "anth", "resp")
PATHS = {"chat": "/v1/chat/completions", "anth": "/v1/messages", "resp": "/v1/responses",
         "count": "/v1/messages/count_tokens", "emb": "/v1/embeddings"}


# --- images -----------------------------------------------------------------------------

def _enc(img: Image.Image, fmt="PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _noise(w=40, h=30, seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def _raw_png(w, h, depth, color, rows: bytes) -> bytes:
    """A PNG written by hand (16-bit colour, a zero size, a header that lies)."""
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b""))


def _png16(channels: int, w=20, h=10) -> bytes:
    arr = np.random.default_rng(1).integers(0, 65536, (h, w * channels), dtype=np.uint16)
    rows = b"".join(b"\x00" + arr[i].astype(">u2").tobytes() for i in range(h))
    return _raw_png(w, h, 16, {3: 2, 4: 6}[channels], rows)


def _gif(frames=1000) -> bytes:
    ims = [Image.fromarray(np.full((32, 32), (i * 7) % 256, dtype=np.uint8), "L").convert("P")
           for i in range(frames)]
    buf = io.BytesIO()
    ims[0].save(buf, "GIF", save_all=True, append_images=ims[1:], duration=10, loop=0)
    return buf.getvalue()


def _palette_alpha() -> bytes:
    im = _noise().convert("P", palette=Image.ADAPTIVE, colors=16)
    return _enc(im, "PNG", transparency=0)


def _mono(w, h) -> bytes:           # w x h pixels in a few kB
    return _enc(Image.new("1", (w, h)), "PNG")


PNG = _enc(_noise())

ODD_BUT_VALID = {
    "1x1": lambda: _enc(Image.new("RGB", (1, 1), (255, 0, 0))),
    "cmyk-jpeg": lambda: _enc(_noise().convert("CMYK"), "JPEG"),
    "png-16bit-rgb": lambda: _png16(3),
    "png-16bit-rgba": lambda: _png16(4),
    "png-I16-gray": lambda: _enc(Image.fromarray(
        np.random.default_rng(2).integers(0, 65536, (30, 40), dtype=np.uint16))),
    "palette-alpha": _palette_alpha,
    "la": lambda: _enc(_noise().convert("LA")),
    "1-bit": lambda: _mono(40, 30),
    "tiff-float": lambda: _enc(Image.fromarray(
        np.random.default_rng(3).random((30, 40), dtype=np.float32)), "TIFF"),
    "webp": lambda: _enc(_noise(), "WEBP"),
    "bmp": lambda: _enc(_noise(), "BMP"),
    "gif-1000-frames": _gif,
}

BAD = {   # bytes -> the message's needle
    "not-an-image": (lambda: b"hello, not an image", "not an image"),
    "truncated-png": (lambda: _enc(_noise(64, 64))[:200], "truncated"),
    "zero-size-png": (lambda: _raw_png(0, 0, 8, 2, b""), "image 1"),
    "100MP-header": (lambda: _raw_png(10000, 10000, 8, 2, b"\x00" * 10), "over the limit"),
    "ico": (lambda: _enc(_noise(32, 32), "ICO"), "not an image"),
    "svg": (lambda: b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>',
            "not an image"),
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{_b64(data)}"


def body(route, data=None, url=None, n=1, stream=False, media="image/png", text="what",
         max_tokens=3, role="user"):
    """A request of `route` with `n` copies of one image: `data` (bytes: a data: URL or
    an Anthropic base64 source) or `url` (any string: an image URL / url source)."""
    if route == "anth" or route == "count":
        src = ({"type": "url", "url": url} if url is not None else
               {"type": "base64", "media_type": media, "data": _b64(data)})
        msgs = [{"role": role, "content": [{"type": "text", "text": text}]
                 + [{"type": "image", "source": src}] * n}]
        if route == "count":
            return {"model": "x", "messages": msgs}
        return {"model": "x", "max_tokens": max_tokens, "stream": stream, "messages": msgs}
    u = url if url is not None else _data_url(data, media)
    if route == "chat":
        return {"model": "x", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                "messages": [{"role": role, "content": [{"type": "text", "text": text}]
                              + [{"type": "image_url", "image_url": {"url": u}}] * n}]}
    return {"model": "x", "max_output_tokens": max_tokens, "stream": stream, "input": [
        {"role": role, "content": [{"type": "input_text", "text": text}]
         + [{"type": "input_image", "image_url": u}] * n}]}


def post(s, route, payload, timeout=60, **kw):
    return httpx.post(s.url + PATHS[route], json=payload, timeout=timeout, **kw)


_PATH = re.compile(r"(/[\w.-]+){2,}\.py|Traceback|File \"")


def refused(r, route, status=400) -> str:
    """`r` is the protocol's error (JSON, not a stream); its message."""
    if r.status_code >= 500:
        # let the server log its traceback first: CPython 3.11 parses source lines while
        # formatting one (ast state shared by threads), and pytest's own traceback of this
        # failure racing it is an INTERNALERROR instead of the failure
        time.sleep(0.5)
    assert r.status_code == status, (r.status_code, r.text[:400])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert not _PATH.search(r.text), r.text
    j = r.json()
    kind = "invalid_request_error" if status == 400 else j["error"]["type"]
    if route in ("anth", "count"):
        assert j["type"] == "error" and j["error"]["type"] == kind, j
    else:
        assert set(j) == {"error"} and j["error"]["type"] == kind, j
    assert isinstance(j["error"]["message"], str) and j["error"]["message"]
    return j["error"]["message"]


def answered(r, route) -> str:
    """`r` is a successful answer of `route` (non-streamed); its text."""
    assert r.status_code == 200, r.text[:400]
    j = r.json()
    if route == "chat":
        return j["choices"][0]["message"]["content"]
    if route == "anth":
        return j["content"][0]["text"] if j["content"] else ""
    return j["output"][0]["content"][0]["text"]


def alive(s, image=True):
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    r = post(s, "chat", body("chat", PNG) if image else {
        "model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


# --- servers ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vsrv():
    s = start_server(ensure_vision_fixture("bfloat16"), prompt_cache_bytes=64 << 20, batch=4)
    yield s
    stop_server(s)


@contextmanager
def config(s, **kw):
    old = {k: getattr(s.state.config, k) for k in kw}
    for k, v in kw.items():
        setattr(s.state.config, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(s.state.config, k, v)


class _Handler(BaseHTTPRequestHandler):
    """/ok.png, /redirect (302 to loopback), /404, /hang (answers nothing for 5 s),
    /trickle (a byte each 0.3 s for 3 s), /infinite (an endless body)."""
    protocol_version = "HTTP/1.0"

    def do_GET(self):
        p = self.path
        if p.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/ok.png")
            self.end_headers()
        elif p.startswith("/404"):
            self.send_response(404)
            self.end_headers()
        elif p.startswith("/hang"):
            time.sleep(5)
        elif p.startswith("/trickle"):
            self.send_response(200)
            self.end_headers()
            for i in range(10):
                try:
                    self.wfile.write(PNG[i:i + 1])
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.3)
        elif p.startswith("/infinite"):
            self.send_response(200)
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"\0" * 65536)
            except OSError:
                return
        else:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(PNG)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def web():
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_port}"
    http.shutdown()


@pytest.fixture
def no_egress(monkeypatch):
    """Connections to anything but loopback fail at once (a guard that lets a URL through
    must not reach a metadata service from the test run)."""
    real = socket.create_connection

    def guarded(address, *a, **kw):
        host = address[0]
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"test: no egress to {host}")
        return real(address, *a, **kw)
    monkeypatch.setattr(socket, "create_connection", guarded)


# --- images on gemma3_vision ---------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ODD_BUT_VALID))
def test_odd_but_valid_images_are_served(vsrv, name):
    data = ODD_BUT_VALID[name]()
    route = ROUTES[sorted(ODD_BUT_VALID).index(name) % 3]
    text = answered(post(vsrv, route, body(route, data)), route)
    assert isinstance(text, str)


def test_an_animated_gif_is_its_first_frame(vsrv):
    """1000 frames: decoded as the first (the answer equals that of a PNG of it)."""
    gif = _gif()
    first = Image.open(io.BytesIO(gif)).convert("RGB")
    eos = {str(t): -100 for t in vsrv.tokenizer.eos_token_ids}
    ids = []
    for data in (gif, _enc(first)):
        r = post(vsrv, "chat", {**body("chat", data, text="frames", max_tokens=6),
                                "logprobs": True, "logit_bias": eos})
        assert r.status_code == 200, r.text
        ids.append([e["id"] for e in r.json()["choices"][0]["logprobs"]["content"]])
    assert ids[0] == ids[1] and len(ids[0]) == 6


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_images_every_route_streamed_or_not(vsrv, name):
    make, needle = BAD[name]
    data = make()
    for route in ROUTES:
        for stream in (False, True):
            msg = refused(post(vsrv, route, body(route, data, stream=stream)), route)
            assert needle in msg, (route, stream, msg)
    msg = refused(post(vsrv, "count", body("count", data)), "count")
    assert needle in msg
    alive(vsrv)


@pytest.mark.parametrize("route,payload,needle", [
    ("chat", "data:image/png;base64,", "empty"),
    ("chat", "data:image/png;base64," + _b64(PNG)[:-3], "not valid base64"),        # padding
    ("chat", "data:image/png;base64," + base64.urlsafe_b64encode(PNG).decode(), "base64"),
    ("chat", "data:image/png;base64,@@@@", "not valid base64"),
    ("resp", "data:image/png;base64,!!!!", "not valid base64"),
    ("anth", "", "empty"),
    ("anth", "!!!!", "not valid base64"),
])
def test_bad_base64(vsrv, route, payload, needle):
    if route == "anth":
        req = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": payload}}]}]}
    else:
        req = body(route, url=payload)
    assert needle in refused(post(vsrv, route, req), route)


@pytest.mark.parametrize("part", [None, [1, 2], {"url": 7}, {"detail": "high"}],
                         ids=["null", "list", "url-int", "no-url"])
def test_malformed_image_url_parts(vsrv, part):
    req = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": part}]}]}
    assert "needs a URL" in refused(post(vsrv, "chat", req), "chat")
    req = {"model": "x", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-123"}]}]}
    assert "needs a URL" in refused(post(vsrv, "resp", req), "resp")


def test_a_declared_image_type_that_lies_about_the_bytes_is_served(vsrv):
    """JPEG bytes as image/png, PNG bytes as image/gif: the bytes decide (documented)."""
    jpeg = _enc(_noise(), "JPEG")
    answered(post(vsrv, "chat", body("chat", jpeg, media="image/png")), "chat")
    answered(post(vsrv, "anth", body("anth", PNG, media="image/gif")), "anth")
    assert "image/*" in refused(post(vsrv, "anth", body("anth", PNG, media="text/html")), "anth")


def test_200_images_is_a_quick_400_on_every_route(vsrv):
    for route in ROUTES + ("count",):
        t0 = time.monotonic()
        r = post(vsrv, route, body(route, PNG, n=200))
        assert "at most 16 images" in refused(r, route)
        assert time.monotonic() - t0 < 5
    answered(post(vsrv, "chat", body("chat", PNG, n=16)), "chat")


def test_pixel_budget_of_a_request(vsrv):
    """Two images of 39 MP (each under the 40 MP limit) are served; three are over the
    request's 80 MP; the decoding costs well under a second each."""
    big = _mono(6000, 6500)
    t0 = time.monotonic()
    answered(post(vsrv, "chat", body("chat", big, n=2)), "chat")
    assert "80,000,000 pixels" in refused(post(vsrv, "chat", body("chat", big, n=3)), "chat")
    assert time.monotonic() - t0 < 10
    alive(vsrv)


def test_tens_of_megabytes_of_base64(vsrv):
    """22 MB of bytes: over --max-image-mb (400 naming the cap); 40 MB: over
    --max-body-mb (413); both answer quickly and the server goes on."""
    blob = os.urandom(22 << 20)
    for route in ("chat", "anth"):
        assert "over 20,971,520 bytes" in refused(post(vsrv, route, body(route, blob)), route)
    r = post(vsrv, "chat", body("chat", os.urandom(40 << 20)))
    assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]
    alive(vsrv)


def test_images_outside_user_messages_every_protocol(vsrv):
    """A tool message, a developer message, an Anthropic system block / assistant block /
    tool_result, a Responses system item / function_call_output: a clear 400 (chat's
    system and assistant are in test_hostile_images.py)."""
    part = {"type": "image_url", "image_url": {"url": _data_url(PNG)}}
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": _b64(PNG)}}
    ii = {"type": "input_image", "image_url": _data_url(PNG)}
    cases = [
        ("chat", {"model": "x", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [part]}]}),
        ("chat", {"model": "x", "max_tokens": 2, "messages": [
            {"role": "developer", "content": [part]}, {"role": "user", "content": "hi"}]}),
        ("anth", {"model": "x", "max_tokens": 2, "system": [block],
                  "messages": [{"role": "user", "content": "hi"}]}),
        ("anth", {"model": "x", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": [block]},
            {"role": "user", "content": "ok"}]}),
        ("anth", {"model": "x", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [block]}]}]}),
        ("resp", {"model": "x", "max_output_tokens": 2, "input": [
            {"role": "system", "content": [ii]}, {"role": "user", "content": "hi"}]}),
        ("resp", {"model": "x", "max_output_tokens": 2, "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [ii]}]}),
    ]
    for route, req in cases:
        assert "user messages only" in refused(post(vsrv, route, req), route), req


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/", "https://example.com/a.png",
    "file:///etc/passwd", "gopher://127.0.0.1/x", "//127.0.0.1/a.png", "javascript:alert(1)"])
def test_remote_image_urls_off_by_default_every_route(vsrv, no_egress, url):
    for route in ROUTES + ("count",):
        msg = refused(post(vsrv, route, body(route, url=url)), route)
        assert "--allow-image-urls" in msg or "data: or http(s)" in msg, msg


@pytest.mark.parametrize("host", [
    "169.254.169.254", "[::ffff:127.0.0.1]", "[::1]", "0.0.0.0", "localhost", "127.1",
    "2130706433", "10.0.0.1", "192.168.1.1", "[fd00:ec2::254]", "user@127.0.0.1"])
def test_url_guard_refuses_internal_addresses(vsrv, no_egress, host):
    with config(vsrv, allow_image_urls=True, image_url_timeout=1.0):
        for route in ("chat", "anth"):
            msg = refused(post(vsrv, route, body(route, url=f"http://{host}/latest/x.png")),
                          route)
            assert "--allow-private-image-urls" in msg, msg


def test_url_fetch_redirects_errors_and_caps(vsrv, web):
    with config(vsrv, allow_image_urls=True, allow_private_image_urls=True,
                image_url_timeout=1.0, max_image_bytes=1 << 20):
        answered(post(vsrv, "chat", body("chat", url=web + "/ok.png")), "chat")
        assert "302" in refused(post(vsrv, "chat", body("chat", url=web + "/redirect")), "chat")
        assert "404" in refused(post(vsrv, "anth", body("anth", url=web + "/404")), "anth")
        t0 = time.monotonic()
        assert "timed out" in refused(post(vsrv, "resp", body("resp", url=web + "/hang")), "resp")
        assert time.monotonic() - t0 < 3
        msg = refused(post(vsrv, "chat", body("chat", url=web + "/infinite")), "chat")
        assert "over 1,048,576 bytes" in msg
    alive(vsrv)


def test_count_tokens_counts_images(vsrv):
    r = post(vsrv, "count", body("count", PNG))
    assert r.status_code == 200 and r.json()["input_tokens"] > 16, r.text
    r2 = post(vsrv, "count", body("count", PNG, n=2))
    assert r2.json()["input_tokens"] > r.json()["input_tokens"] + 16


def _stream_gaps(s, stop: threading.Event, started: threading.Event, gaps: list, eos: dict):
    body_ = {"model": "x", "max_tokens": 3000, "temperature": 0, "stream": True,
             "logit_bias": eos, "messages": [{"role": "user", "content": "tell me a story"}]}
    last = None
    with httpx.stream("POST", s.v1 + "/chat/completions", json=body_, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                started.set()
            if stop.is_set():
                break


@contextmanager
def innocent_stream(s, eos):
    """A text stream running meanwhile; yields the list of its inter-chunk gaps."""
    stop, started, gaps = threading.Event(), threading.Event(), []
    t = threading.Thread(target=_stream_gaps, args=(s, stop, started, gaps, eos))
    t.start()
    try:
        assert started.wait(60)
        yield gaps
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(60)


def test_innocent_stream_beside_concurrent_image_requests(vsrv):
    """Three requests of 16 images of 5 MP each beside a text stream: all answer, the
    stream is never held more than a couple of seconds."""
    eos = {str(t): -100 for t in vsrv.tokenizer.eos_token_ids}
    req = body("chat", _mono(2500, 2000), n=16)
    with innocent_stream(vsrv, eos) as gaps:
        with ThreadPoolExecutor(3) as ex:
            rs = list(ex.map(lambda _: post(vsrv, "chat", req), range(3)))
    assert all(r.status_code == 200 for r in rs)
    assert gaps and max(gaps) < 2.5, max(gaps)


def test_client_disconnect_mid_image_request(vsrv):
    """A client that goes away while its 16-image stream is prefilled or decoded: the job
    ends, nothing stays active, the server goes on."""
    raw = json.dumps({**body("chat", _mono(2500, 2000), n=16, stream=True), "max_tokens": 500,
                      "logit_bias": {str(t): -100 for t in vsrv.tokenizer.eos_token_ids}}
                     ).encode()
    port = int(vsrv.url.rsplit(":", 1)[1])
    for delay in (0.05, 0.5):
        so = socket.create_connection(("127.0.0.1", port))
        so.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        time.sleep(delay)
        so.close()
    deadline = time.monotonic() + 15
    while vsrv.state.gateway.stats()["active"] or vsrv.state.gateway.queued:
        assert time.monotonic() < deadline, vsrv.state.gateway.stats()
        time.sleep(0.1)
    alive(vsrv)


# --- findings (fixed in 0.5.4) --------------------------------------------------------------

# (a finding of the probe, fixed in 0.5.4: a malformed bracketed host in an image URL
# (urllib.parse.urlsplit raises ValueError) is a 500, on the default server)
@pytest.mark.parametrize("url", ["http://[zz]/a.png", "http://[::1/a.png", "http://a]b/x.png",
                                 "http://[127.0.0.1]/a.png"])
def test_malformed_url_host_is_a_400(vsrv, url):
    for route in ROUTES + ("count",):
        for stream in (False, True):
            if route == "count" and stream:
                continue
            refused(post(vsrv, route, body(route, url=url, stream=stream)), route)
    alive(vsrv)


# (a finding of the probe, fixed in 0.5.4: a non-numeric port in a fetched image URL
# (http.client.InvalidURL, not an OSError) is a 500)
def test_bad_port_in_fetched_url_is_a_400(vsrv, web):
    with config(vsrv, allow_image_urls=True, allow_private_image_urls=True):
        refused(post(vsrv, "chat", body("chat", url="http://127.0.0.1:abc/a.png")), "chat")


# (a finding of the probe, fixed in 0.5.4: the URL guard lets carrier-grade NAT addresses
# (100.64.0.0/10: ipaddress says neither private nor global; Alibaba Cloud's metadata is
# 100.100.100.200) through; is_global is the test)
def test_url_guard_refuses_shared_address_space(vsrv, no_egress):
    with config(vsrv, allow_image_urls=True, image_url_timeout=1.0):
        msg = refused(post(vsrv, "chat", body("chat", url="http://100.64.0.1/x.png")), "chat")
        assert "--allow-private-image-urls" in msg, msg


# (a finding of the probe, fixed in 0.5.4: the URL guard resolves the host, then urllib resolves
# it again to connect (DNS rebinding): a name that answers a public address first and 127.0.0.1
# next reads the server's own loopback)
def test_url_guard_is_not_rebound(vsrv, web, monkeypatch):
    port = int(web.rsplit(":", 1)[1])
    real_gai, real_conn = socket.getaddrinfo, socket.create_connection
    calls = []

    def gai(host, *a, **kw):
        if host != "rebind.test":
            return real_gai(host, *a, **kw)
        calls.append(host)
        ip = "93.184.216.34" if len(calls) == 1 else "127.0.0.1"     # public, then loopback
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))]

    def conn(address, *a, **kw):
        if address[0] == "93.184.216.34":
            raise OSError("test: no egress")
        return real_conn(address, *a, **kw)
    monkeypatch.setattr(socket, "getaddrinfo", gai)
    monkeypatch.setattr(socket, "create_connection", conn)
    with config(vsrv, allow_image_urls=True, image_url_timeout=1.0):
        r = post(vsrv, "chat", body("chat", url=f"http://rebind.test:{port}/ok.png"))
    refused(r, "chat")


# (a finding of the probe, fixed in 0.5.4: --image-url-timeout is a per-read socket timeout, not
# a deadline: a server sending a byte every 0.3 s holds the fetch (and a worker thread) for as
# long as it likes)
def test_image_url_timeout_is_a_deadline(vsrv, web):
    with config(vsrv, allow_image_urls=True, allow_private_image_urls=True,
                image_url_timeout=0.8):
        t0 = time.monotonic()
        refused(post(vsrv, "chat", body("chat", url=web + "/trickle")), "chat")
        assert time.monotonic() - t0 < 2.0


# (a finding of the probe, fixed in 0.5.4: image URL fetches run on asyncio's default executor
# (min(32, cpus + 4) threads); that many slow URLs hold every other request's image decoding (a
# data: image) until they time out)
def test_slow_image_urls_do_not_hold_other_image_requests(vsrv, web):
    n = min(32, (os.cpu_count() or 1) + 4) + 1
    with config(vsrv, allow_image_urls=True, allow_private_image_urls=True,
                image_url_timeout=3.0):
        with ThreadPoolExecutor(n) as ex:
            slow = [ex.submit(post, vsrv, "chat", body("chat", url=web + "/hang"))
                    for _ in range(n)]
            time.sleep(0.4)
            t0 = time.monotonic()
            r = post(vsrv, "chat", body("chat", PNG))
            took = time.monotonic() - t0
            assert all(f.result().status_code == 400 for f in slow)
    assert r.status_code == 200 and took < 1.0, took


# (a finding of the probe, fixed in 0.5.4: /v1/messages/count_tokens fetches, decodes and
# preprocesses images on the event loop (encode() inline): every other request, /health
# included, waits for it)
def test_count_tokens_with_images_does_not_block_the_server(vsrv, web):
    with config(vsrv, allow_image_urls=True, allow_private_image_urls=True,
                image_url_timeout=1.5):
        with ThreadPoolExecutor(1) as ex:
            f = ex.submit(post, vsrv, "count", body("count", url=web + "/hang"))
            time.sleep(0.3)
            t0 = time.monotonic()
            assert httpx.get(vsrv.url + "/health", timeout=30).status_code == 200
            took = time.monotonic() - t0
            refused(f.result(), "count")
    assert took < 0.5, took


# --- Gemma 4 (bidirectional image attention) and Qwen2.5-VL ---------------------------

@pytest.fixture(scope="module", params=["gemma4-bidirectional", "qwen2_5_vl"])
def msrv(request, tmp_path_factory):
    from parity.fixtures import gemma4_vision, qwen2_5_vl
    if request.param == "qwen2_5_vl":
        path = qwen2_5_vl.ensure_fixture("float32")
    else:
        path = gemma4_vision.bidirectional_copy(gemma4_vision.ensure_fixture("float32"),
                                                tmp_path_factory.mktemp("g4bi"))
    s = start_server(path, prompt_cache_bytes=64 << 20, batch=4)
    if request.param != "qwen2_5_vl":
        assert s.model.whole_image_prompts
    s.kind = request.param
    yield s
    stop_server(s)


def test_models_odd_and_bad_images(msrv):
    for i, name in enumerate(("1x1", "cmyk-jpeg", "png-16bit-rgba", "palette-alpha",
                              "gif-1000-frames")):
        route = ROUTES[i % 3]
        answered(post(msrv, route, body(route, ODD_BUT_VALID[name]())), route)
    for name in ("not-an-image", "truncated-png", "100MP-header"):
        make, needle = BAD[name]
        for route in ROUTES:
            assert needle in refused(post(msrv, route, body(route, make(), stream=True)), route)
    assert "at most 16" in refused(post(msrv, "chat", body("chat", PNG, n=200)), "chat")
    alive(msrv)


def test_models_same_image_twice_and_streamed(msrv):
    """The same request again (the prompt cache holds the image's prefix, or on the
    bidirectional model runs whole again) answers the same tokens and logprobs; streamed,
    the same text; a text request beside it still works."""
    eos = {str(t): -100 for t in msrv.tokenizer.eos_token_ids}
    req = {**body("chat", _enc(_noise(50, 37, seed=9)), text="cache me", max_tokens=8),
           "logprobs": True, "logit_bias": eos}
    a, b = (post(msrv, "chat", req).json() for _ in range(2))
    lp = lambda r: [(e["id"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]
    assert lp(a) == lp(b) and len(lp(a)) == 8
    r = post(msrv, "chat", {**req, "stream": True, "logprobs": False})
    text = "".join((d.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                   for _, d in sse_events(r.text) if isinstance(d, dict))
    assert text == a["choices"][0]["message"]["content"]
    alive(msrv, image=False)


# --- the text-only model and embeddings (conftest's qwen3 `srv`) -----------------------

def test_image_parts_on_a_text_only_model(srv):
    for route in ROUTES + ("count",):
        for stream in (False, True):
            if route == "count" and stream:
                continue
            msg = refused(post(srv, route, body(route, PNG, stream=stream)), route)
            assert "no vision tower" in msg, msg
    assert "must be a string" in refused(post(srv, "emb", {"input": [
        {"type": "image_url", "image_url": {"url": _data_url(PNG)}}]}), "emb")
    alive(srv, image=False)


@pytest.mark.parametrize("payload,status,needle", [
    ({"input": ["hello"] * 10_000}, 400, "the limit is 2048"),
    ({"input": "a" * 1_000_000}, 413, "--max-prompt-chars"),
    ({"input": ["a" * 1_000_000]}, 413, "--max-prompt-chars"),
    ({"input": "hello " * 10_000}, 400, "this model's context is"),
    ({"input": [10 ** 30]}, 400, "outside the vocabulary"),
    ({"input": [[[1, 2]]]}, 400, "must be a string or a list of token ids"),
    ({"input": [True, False]}, 400, "must be a string or a list of token ids"),
    ({"input": [[True]]}, 400, "must be a string or a list of token ids"),
    ({"input": [1.0, 2.0]}, 400, "must be a string or a list of token ids"),
    ({"input": [[1, "a"]]}, 400, "must be a string or a list of token ids"),
    ({"input": [1, "a"]}, 400, "must be a string or a list of token ids"),
    ({"input": [1, [2]]}, 400, "must be a string or a list of token ids"),
    ({"input": None}, 400, "input must be a string"),
    ({"input": {"a": 1}}, 400, "input must be a string"),
    ({"input": True}, 400, "input must be a string"),
    ({"input": "x", "dimensions": -1}, 400, "must be >= 1"),
    ({"input": "x", "dimensions": 8.5}, 400, "must be an integer"),
    ({"input": "x", "dimensions": True}, 400, "must be an integer"),
    ({"input": "x", "dimensions": [8]}, 400, "must be an integer"),
    ({"input": "x", "dimensions": 10 ** 30}, 400, "at most"),
    ({"input": "x", "encoding_format": "FLOAT"}, 400, "must be one of"),
    ({"input": "x", "encoding_format": 5}, 400, "must be one of"),
    ({"input": "x", "model": 5}, 400, "model must be a string"),
    (b'{"input": "x", "dimensions": NaN}', 400, "must be an integer"),
    (b'{"input": "\\ud800"}', 400, "surrogate"),
    (b'{"input": ', 400, "invalid JSON"),
    (b'["x"]', 400, "expected an object"),
    (b'{"input": ' + b"[" * 100_001 + b"]" * 100_001 + b"}", 413, "--max-json-nodes"),
], ids=lambda v: (v.decode(errors="replace") if isinstance(v, bytes) else json.dumps(v))[:40]
    if isinstance(v, (bytes, dict)) else None)
def test_hostile_embeddings_input(srv, payload, status, needle):
    t0 = time.monotonic()
    if isinstance(payload, bytes):
        r = httpx.post(srv.url + "/v1/embeddings", content=payload, timeout=60,
                       headers={"content-type": "application/json"})
    else:
        r = post(srv, "emb", payload)
    assert needle in refused(r, "emb", status)
    assert time.monotonic() - t0 < 5
    assert post(srv, "emb", {"input": "still fine"}).status_code == 200


def test_embeddings_edge_inputs_that_are_fine(srv):
    """A whitespace or NUL string has tokens; dimensions null / the hidden size / 8.0
    and encoding_format null are the defaults or the same number; vectors are unit."""
    hidden = srv.state.model.args.hidden_size
    for req in ({"input": " "}, {"input": "\x00"}, {"input": "x", "dimensions": None},
                {"input": "x", "encoding_format": None}):
        r = post(srv, "emb", req)
        assert r.status_code == 200, (req, r.text)
        v = np.array(r.json()["data"][0]["embedding"])
        assert len(v) == hidden and abs(np.linalg.norm(v) - 1) < 1e-5
    full = post(srv, "emb", {"input": "x", "dimensions": hidden}).json()["data"][0]["embedding"]
    assert full == post(srv, "emb", {"input": "x"}).json()["data"][0]["embedding"]
    eight = post(srv, "emb", {"input": "x", "dimensions": 8.0}).json()["data"][0]["embedding"]
    assert eight == post(srv, "emb", {"input": "x", "dimensions": 8}).json()["data"][0]["embedding"]


def test_concurrent_embeddings_beside_a_stream(srv):
    """Two requests of 2048 short strings beside a generation stream: all answer, each
    vector as the request alone, and the stream goes on (the long-input stall is the
    finding below)."""
    alone = post(srv, "emb", {"input": [f"text 0 number {j}" for j in range(2048)]}).json()
    with innocent_stream(srv, NO_EOS) as gaps:
        with ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(lambda i: post(srv, "emb", {"input": [
                f"text {i} number {j}" for j in range(2048)]}), range(2)))
    assert all(r.status_code == 200 and len(r.json()["data"]) == 2048 for r in rs)
    assert rs[0].json()["data"] == alone["data"]
    assert gaps and max(gaps) < 5, max(gaps)


# (a finding of the probe, fixed in 0.5.4: an embeddings request runs all its forwards in one
# worker call between two decode steps: every generation stalls for its whole duration (2048
# inputs of 4000 token ids, a 16 MB body: hours))
def test_a_long_embeddings_request_does_not_stall_a_stream(srv):
    with innocent_stream(srv, NO_EOS) as gaps:
        r = post(srv, "emb", {"input": [[7] * 256] * 192}, timeout=300)
    assert r.status_code == 200
    assert max(gaps) < 2.0, max(gaps)
