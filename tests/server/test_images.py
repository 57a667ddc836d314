"""Images over the three protocols on the gemma3_vision fixture: OpenAI `image_url` data:
URLs, Anthropic base64 `image` blocks, Responses `input_image`; each answer equals the
engine's own run of the same prompt; the prompt cache reuses a prefix only for the same
image; bad images and URLs are 400s with a clear message and the server keeps serving."""

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from starter.vision import ensure_vision_fixture
from srv_helpers import sse_events, start_server, stop_server


def _encode(arr, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


RNG = np.random.default_rng(3)
PNG = _encode(RNG.integers(0, 256, (40, 30, 3), dtype=np.uint8))
OTHER = _encode(RNG.integers(0, 256, (40, 30, 3), dtype=np.uint8))


def _url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _chat(text, url):
    return {"model": "x", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module")
def vsrv():
    s = start_server(ensure_vision_fixture("bfloat16"), prompt_cache_bytes=64 << 20, batch=4)
    yield s
    stop_server(s)


def _expected(s, text, image: bytes, n=6):
    """The engine's own greedy run of the same chat (vision_prompt + submit)."""
    from engine import Engine, SamplingParams

    def run():
        eng = Engine(s.model, s.tokenizer)
        eng.image_preprocess = s.state.engine.image_preprocess
        ids, vision = eng.vision_prompt([{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image"}]}], [image])
        eng.submit(ids, SamplingParams(max_tokens=n, temperature=0.0), vision=vision)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.token_ids]
        return out
    return s.on_worker(run)


def test_openai_image_url_equals_the_engine(vsrv):
    r = httpx.post(vsrv.v1 + "/chat/completions", json={**_chat("What is it?", _url(PNG)),
                                                       "logprobs": True}, timeout=60)
    assert r.status_code == 200, r.text
    got = [e["id"] for e in r.json()["choices"][0]["logprobs"]["content"]]
    assert got == _expected(vsrv, "What is it?", PNG)[:len(got)] and got
    # the prompt counts the image's 16 tokens
    assert r.json()["usage"]["prompt_tokens"] > 16


def test_anthropic_and_responses_images(vsrv):
    b64 = base64.b64encode(PNG).decode()
    r = httpx.post(vsrv.v1 + "/messages", json={"model": "x", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image",
         "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}, timeout=60)
    assert r.status_code == 200, r.text
    r2 = httpx.post(vsrv.v1 + "/responses", json={"model": "x", "max_output_tokens": 4,
                    "input": [{"role": "user", "content": [
                        {"type": "input_text", "text": "What is it?"},
                        {"type": "input_image", "image_url": _url(PNG)}]}]}, timeout=60)
    assert r2.status_code == 200, r2.text
    text = r.json()["content"][0]["text"]
    assert r2.json()["output"][0]["content"][0]["text"] == text
    assert vsrv.tokenizer.decode(_expected(vsrv, "What is it?", PNG, 4)).startswith(text)


def test_prompt_cache_keyed_by_the_image(vsrv):
    body = _chat("Cache me", _url(OTHER))
    first = httpx.post(vsrv.v1 + "/chat/completions", json=body, timeout=60).json()
    again = httpx.post(vsrv.v1 + "/chat/completions", json=body, timeout=60).json()
    other = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("Cache me", _url(PNG)),
                       timeout=60).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    cached = lambda r: (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached(again) > 16          # the image's tokens came from the cache
    assert cached(other) == 0          # another image: no reuse (same text, same token ids)


def _truncated() -> bytes:
    return _encode(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8), "JPEG")[:300]


def _huge() -> bytes:           # 10,000 x 10,000 pixels (100 MP) in a tiny PNG
    buf = io.BytesIO()
    Image.new("1", (10000, 10000)).save(buf, "PNG")
    return buf.getvalue()


BAD = [(_url(b"not an image at all"), "not an image"),
       (_url(_truncated(), "image/jpeg"), "truncated"),
       (_url(_huge()), "over the limit"),
       ("data:image/png;base64,@@@", "base64"),
       ("data:image/png,rawdata", "data:<type>;base64"),
       ("ftp://example.com/a.png", "data: or http(s)"),
       ("http://127.0.0.1:1/a.png", "--allow-image-urls"),
       (_url(b"%PDF-1.4 fake"), "not an image")]


@pytest.mark.parametrize("url,needle", BAD, ids=[n for _, n in BAD])
def test_bad_images_are_400_and_serving_goes_on(vsrv, url, needle):
    r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("hi", url), timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("hi", _url(PNG)), timeout=60)
    assert ok.status_code == 200


def test_marker_in_text_and_anthropic_bad_source(vsrv):
    r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("a \ufffc b", _url(PNG)))
    assert r.status_code == 400 and "U+FFFC" in r.json()["error"]["message"]
    r = httpx.post(vsrv.v1 + "/messages", json={"model": "x", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]})
    assert r.status_code == 400 and "base64 or url" in r.json()["error"]["message"]


class _Png(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *a):
        pass


def test_image_urls_opt_in_and_loopback_guard():
    http = HTTPServer(("127.0.0.1", 0), _Png)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_port}/cat.png"
    guarded = start_server(ensure_vision_fixture("bfloat16"), allow_image_urls=True)
    try:
        r = httpx.post(guarded.v1 + "/chat/completions", json=_chat("hi", url), timeout=60)
        assert r.status_code == 400 and "loopback" in r.json()["error"]["message"]
        guarded.state.config.allow_private_image_urls = True
        r = httpx.post(guarded.v1 + "/chat/completions", json=_chat("hi", url), timeout=60)
        assert r.status_code == 200, r.text
        guarded.state.config.max_image_bytes = 100
        r = httpx.post(guarded.v1 + "/chat/completions", json=_chat("hi", url), timeout=60)
        assert r.status_code == 400 and "over 100 bytes" in r.json()["error"]["message"]
    finally:
        stop_server(guarded)
        http.shutdown()


def test_stream_two_images_beside_text_requests(vsrv):
    """A streamed request with two images is a row of the batch with text requests (issue
    #40; it ran alone before): every answer comes, and the image answer equals the engine's
    own run alone (max_batch 1: bfloat16 logits are batch-invariant on the CPU here)."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "x", "max_tokens": 5, "temperature": 0, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(PNG)}},
                                     {"type": "text", "text": "versus"},
                                     {"type": "image_url", "image_url": {"url": _url(OTHER)}}]}]}

    def text(i):
        return httpx.post(vsrv.v1 + "/chat/completions", json={
            "max_tokens": 5, "messages": [{"role": "user", "content": f"text {i}"}]}, timeout=60)

    before = vsrv.state.engine.stats()
    with ThreadPoolExecutor(4) as ex:
        texts = [ex.submit(text, i) for i in range(3)]
        r = httpx.post(vsrv.v1 + "/chat/completions", json=body, timeout=60)
        assert all(t.result().status_code == 200 for t in texts)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    got = "".join((d.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                  for _, d in sse_events(r.text) if isinstance(d, dict))

    def run():
        from engine import Engine, SamplingParams
        eng = Engine(vsrv.model, vsrv.tokenizer)
        eng.image_preprocess = vsrv.state.engine.image_preprocess
        ids, vision = eng.vision_prompt([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "versus"}, {"type": "image"}]}],
            [PNG, OTHER])
        eng.submit(ids, SamplingParams(max_tokens=5, temperature=0.0), vision=vision)
        toks = []
        while eng.has_unfinished():
            toks += [t for o in eng.step() for t in o.token_ids]
        return vsrv.tokenizer.decode(toks)
    assert got and got == vsrv.on_worker(run)
    after = vsrv.state.engine.stats()
    assert after["solo_reasons"].get("images", 0) == before["solo_reasons"].get("images", 0)
    assert after["lanes"]["batch"] == before["lanes"]["batch"] + 4
