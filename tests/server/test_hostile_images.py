"""Hostile images on the gemma3_vision fixture (found by the hostile probe of the vision
surfaces): an image's base64 is not prompt text (it is capped by --max-image-mb and
--max-body-mb, not --max-prompt-chars); a data: URL or Anthropic media_type that names a
non-image type is a 400; a request's images are decoded one at a time (a request of many
large images never holds all of them decoded at once)."""

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from starter.vision import ensure_vision_fixture
from srv_helpers import start_server, stop_server


def _png(w, h, seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _chat(url, n=1):
    return {"model": "x", "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what"}]
         + [{"type": "image_url", "image_url": {"url": url}}] * n}]}


@pytest.fixture(scope="module")
def vsrv():
    s = start_server(ensure_vision_fixture("bfloat16"), batch=2)
    yield s
    stop_server(s)


def test_an_image_larger_than_the_prompt_character_limit_is_served(vsrv):
    # the fixture's context is 4096 tokens: --max-prompt-chars derives 65,536 characters;
    # a 200x200 PNG of noise is ~160k characters of base64, far under --max-image-mb
    data = _png(200, 200)
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    assert len(url) > 65_536
    r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat(url), timeout=60)
    assert r.status_code == 200, r.text
    src = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    r = httpx.post(vsrv.v1 + "/messages", json={"model": "x", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": src}]}]}, timeout=60)
    assert r.status_code == 200, r.text
    # the text of the request still counts
    r = httpx.post(vsrv.v1 + "/chat/completions", json={
        "model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "a" * 70_000}]},
        timeout=60)
    assert r.status_code == 413, r.text


def test_a_non_image_media_type_is_refused(vsrv):
    b64 = base64.b64encode(_png(8, 8)).decode()
    r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat(f"data:text/plain;base64,{b64}"),
                   timeout=30)
    assert r.status_code == 400 and "image/" in r.json()["error"]["message"], r.text
    r = httpx.post(vsrv.v1 + "/messages", json={"model": "x", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "application/pdf", "data": b64}}]}]}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    # no type, generic bytes or any image type (the bytes decide the format) is served
    for head in ("data:;base64,", "data:image/jpeg;base64,",
                 "data:application/octet-stream;base64,"):
        r = httpx.post(vsrv.v1 + "/chat/completions", json=_chat(head + b64), timeout=30)
        assert r.status_code == 200, (head, r.text)


def test_an_image_outside_a_user_message_is_a_clear_400(vsrv):
    """(It was a 400 "chat template failed: 'dict object' has no attribute 'text'".)"""
    url = f"data:image/png;base64,{base64.b64encode(_png(8, 8)).decode()}"
    for role in ("system", "assistant"):
        body = {"model": "x", "max_tokens": 2, "messages": [
            {"role": role, "content": [{"type": "image_url", "image_url": {"url": url}}]},
            {"role": "user", "content": "hi"}]}
        r = httpx.post(vsrv.v1 + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert "user messages only" in r.json()["error"]["message"], r.text
