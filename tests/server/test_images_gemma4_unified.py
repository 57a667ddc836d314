"""Images over the server on the gemma4_unified_vision fixture (encoder-free Gemma 4: one
soft token per 12-pixel model patch): an OpenAI `image_url` part and an Anthropic `image` block each answer as the
engine's own run of the same prompt; the same request again (a prompt-cache hit on the same
image) answers the same; a text request beside it still works; a bad image is a 400."""

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from parity.fixtures.gemma4_unified_vision import ensure_fixture
from srv_helpers import start_server, stop_server


def _encode(arr, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


PNG = _encode(np.random.default_rng(6).integers(0, 256, (40, 57, 3), dtype=np.uint8))


def _chat(text, data: bytes, n=6):
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    return {"model": "x", "max_tokens": n, "temperature": 0, "logprobs": True, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module")
def gsrv():
    s = start_server(ensure_fixture("float32"), prompt_cache_bytes=64 << 20, batch=4)
    yield s
    stop_server(s)


def _expected(s, text, image: bytes, n=6):
    from engine import Engine, SamplingParams

    def run():
        eng = Engine(s.model, s.tokenizer)
        eng.image_preprocess = s.state.engine.image_preprocess
        eng.eos = set()
        ids, vision = eng.vision_prompt([{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image"}]}], [image])
        eng.submit(ids, SamplingParams(max_tokens=n, temperature=0.0), vision=vision)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.token_ids]
        return out, len(ids), vision.tokens
    return s.on_worker(run)


def _ids(r):
    return [e["id"] for e in r.json()["choices"][0]["logprobs"]["content"]]


def test_openai_image_url_equals_the_engine_and_again_from_the_cache(gsrv):
    want, n_prompt, n_image = _expected(gsrv, "What is it?", PNG)
    # 40x57 -> 36x48 pixels -> 3x4 model patches of 12 pixels -> 12 soft tokens
    assert n_image == 12 and n_prompt > n_image
    for _ in range(2):                         # the second: the prompt cache holds it
        r = httpx.post(gsrv.v1 + "/chat/completions", json=_chat("What is it?", PNG),
                       timeout=60)
        assert r.status_code == 200, r.text
        got = _ids(r)
        assert got and got == want[:len(got)]
        assert r.json()["usage"]["prompt_tokens"] == n_prompt


def test_anthropic_image_block_and_text_beside(gsrv):
    b64 = base64.b64encode(PNG).decode()
    r = httpx.post(gsrv.v1 + "/messages", json={"model": "x", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image",
         "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(gsrv.v1 + "/chat/completions", json={
        "model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60)
    assert r.status_code == 200, r.text


def test_bad_image_is_a_400(gsrv):
    r = httpx.post(gsrv.v1 + "/chat/completions", json=_chat("x", b"not an image"), timeout=60)
    assert r.status_code == 400 and "image" in r.text
