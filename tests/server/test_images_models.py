"""Images over the server on the fixtures of the models whose image-token count depends on the
image's size — Qwen2.5-VL (M-RoPE positions), Gemma 4, and encoder-free Gemma 4
(`gemma4_unified`: one soft token per 12-pixel model patch): an OpenAI `image_url` part and an
Anthropic `image` block each answer as the engine's own run of the same prompt; the same
request again (a prompt-cache hit on the same image) answers the same; a text request beside
it still works; a bad image is a 400."""

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from parity.fixtures import gemma4_unified_vision, gemma4_vision, qwen2_5_vl
from srv_helpers import start_server, stop_server


def _encode(arr, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def _png(seed):
    return _encode(np.random.default_rng(seed).integers(0, 256, (40, 57, 3), dtype=np.uint8))


# model -> (fixture module, image seed, image tokens of the 40x57 image or None: a lower bound)
MODELS = {
    # 40x57 -> 40x56 pixels -> 10x14 patches -> 35 image tokens
    "qwen2_5_vl": (qwen2_5_vl, 5, None),
    # 40x57 -> 36x48 pixels -> 9x12 patches -> 12 soft tokens
    "gemma4": (gemma4_vision, 6, 12),
    # 40x57 -> 36x48 pixels -> 3x4 model patches of 12 pixels -> 12 soft tokens
    "gemma4_unified": (gemma4_unified_vision, 6, 12),
}


def _chat(text, data: bytes, n=6):
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    return {"model": "x", "max_tokens": n, "temperature": 0, "logprobs": True, "messages": [
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module", params=sorted(MODELS))
def vsrv(request):
    fixtures, seed, tokens = MODELS[request.param]
    s = start_server(fixtures.ensure_fixture("float32"), prompt_cache_bytes=64 << 20, batch=4)
    s.kind, s.png, s.image_tokens = request.param, _png(seed), tokens
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


def test_openai_image_url_equals_the_engine_and_again_from_the_cache(vsrv):
    want, n_prompt, n_image = _expected(vsrv, "What is it?", vsrv.png)
    if vsrv.image_tokens is not None:
        assert n_image == vsrv.image_tokens and n_prompt > n_image
    for _ in range(2):                         # the second: the prompt cache holds it
        r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("What is it?", vsrv.png),
                       timeout=60)
        assert r.status_code == 200, r.text
        got = _ids(r)
        assert got and got == want[:len(got)]
        assert r.json()["usage"]["prompt_tokens"] == n_prompt
    if vsrv.image_tokens is None:
        assert n_prompt > 35


def test_anthropic_image_block_and_text_beside(vsrv):
    b64 = base64.b64encode(vsrv.png).decode()
    r = httpx.post(vsrv.v1 + "/messages", json={"model": "x", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image",
         "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(vsrv.v1 + "/chat/completions", json={
        "model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        timeout=60)
    assert r.status_code == 200, r.text


def test_bad_image_is_a_400(vsrv):
    r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("x", b"not an image"), timeout=60)
    assert r.status_code == 400 and "image" in r.text
    if vsrv.kind == "qwen2_5_vl":
        wide = _encode(np.zeros((2, 500, 3), dtype=np.uint8))        # aspect ratio 250
        r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat("x", wide), timeout=60)
        assert r.status_code == 400 and "aspect ratio" in r.text, r.text
