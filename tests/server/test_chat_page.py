"""The chat page: served self-contained, and driven in a real headless Chromium
(selenium + Debian's chromium/chromium-driver, which scripts/test.sh installs):
it types a message, sees the streamed text arrive while the request is still
running, stops a long generation (the server cancels it), and sees reasoning
apart from the answer and a tool call rendered as a call."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest

from srv_helpers import TOOLS, ForcedModel, Served, start_server, stop_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


def test_page_is_served_self_contained(srv):
    for path in ("/", "/chat"):
        r = httpx.get(srv.url + path, timeout=30)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        assert "v1/chat/completions" in r.text
        # nothing is fetched from outside the server: no absolute URLs at all
        assert not re.search(r"https?://|//cdn|@import", r.text)


def test_page_loads_without_the_key_but_the_api_does_not(qwen_dir):
    s = start_server(qwen_dir, api_key="k1", prompt_cache_bytes=0)
    try:
        assert httpx.get(s.url + "/", timeout=30).status_code == 200
        assert httpx.get(s.url + "/v1/models", timeout=30).status_code == 401
    finally:
        stop_server(s)


class SlowModel:
    """A real model that takes `delay` seconds more per forward (a long generation
    the browser can stop while it runs)."""

    def __init__(self, model, delay: float):
        object.__setattr__(self, "_inner", model)
        object.__setattr__(self, "_delay", delay)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, *a, **kw):
        time.sleep(self._delay)
        return self._inner(*a, **kw)


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        msg = "no chromium/chromedriver on PATH (scripts/test.sh installs Debian's chromium)"
        print(f"SKIP browser test: {msg}")
        pytest.skip(msg)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1200,800"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def slow_srv(qwen_dir):
    from server.app import create_app
    from server.cli import BackgroundServer
    from server.state import ServerConfig, build_state
    cfg = ServerConfig(model=str(qwen_dir), prompt_cache_bytes=0, stream_interval_ms=0)
    state = build_state(cfg, wrap_model=lambda m, t: ForcedModel(SlowModel(m, 0.02), t))
    bg = BackgroundServer(create_app(state)).start()
    s = Served(bg.url, state, None, state.tokenizer, qwen_dir, state.model, bg)
    yield s
    stop_server(s)


def wait_for(fn, timeout=30.0, every=0.02):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = fn()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("timed out waiting")


def test_browser_streams_and_stops(browser, slow_srv):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    d, s = browser, slow_srv
    forced = s.forced
    d.get(s.url + "/chat")
    find = d.find_element
    wait_for(lambda: find(By.ID, "model").text == s.state.model_id)

    # 1. a message streams in, piece by piece, and ends with tokens/s
    reply = "Streaming works from the model to the page one token at a time."
    forced.arm(reply)
    box = find(By.ID, "input")
    box.send_keys("Say something", Keys.ENTER)
    content = lambda: d.execute_script(  # noqa: E731
        "const c = document.querySelectorAll('.assistant .content');"
        "return c.length ? c[c.length - 1].textContent : '';")
    partial = wait_for(lambda: (t := content()) and not find(By.ID, "stop").get_attribute(
        "disabled") and t != reply and t)
    assert reply.startswith(partial)               # seen mid-stream, a prefix of the answer
    wait_for(lambda: find(By.ID, "status").text == "done")
    assert content() == reply
    meta = d.find_elements(By.CSS_SELECTOR, ".assistant .meta")[-1].text
    assert re.search(r"\d+ tokens · [\d.]+ tok/s", meta), meta

    # 2. a long generation is stopped from the page; the server cancels it
    cancelled = s.state.gateway.stats()["cancelled"]
    forced.arm("word " * 3000)
    find(By.ID, "max_tokens").clear()
    find(By.ID, "max_tokens").send_keys("3000")
    box.send_keys("Go on for a long time", Keys.ENTER)
    wait_for(lambda: len(content()) > 20)
    find(By.ID, "stop").click()
    wait_for(lambda: find(By.ID, "status").text == "stopped")
    wait_for(lambda: s.state.gateway.stats()["cancelled"] == cancelled + 1, timeout=20)
    assert s.state.gateway.stats()["active"] == 0
    assert len(content().split()) < 3000
    # the conversation keeps both turns; the page can send again
    assert len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2

    # 3. reasoning is shown apart from the answer; a tool call is rendered as a call
    def last(sel):
        return d.find_elements(By.CSS_SELECTOR, sel)[-1].text

    find(By.ID, "max_tokens").clear()
    find(By.ID, "max_tokens").send_keys("200")
    forced.arm("<think>pondering the question</think>The answer is four.")
    box.send_keys("What is 2+2?", Keys.ENTER)
    wait_for(lambda: find(By.ID, "status").text == "done")
    assert last(".assistant .reasoning") == "pondering the question"
    assert last(".assistant .content").strip() == "The answer is four."
    find(By.ID, "tools").send_keys(json.dumps(TOOLS))
    forced.arm('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>')
    box.send_keys("Weather in Paris?", Keys.ENTER)
    wait_for(lambda: find(By.ID, "status").text == "done")
    assert last(".assistant .tools") == 'tool call: get_weather({"city": "Paris"})'
    assert "tool_calls" in last(".assistant .meta")

    shot = os.environ.get("MLXP_CHAT_SCREENSHOT")
    if shot:
        d.save_screenshot(shot)


SAMPLING = ("temperature", "top_p", "max_tokens")


def test_sampling_inputs_start_empty_and_are_sent_only_when_filled():
    """Static check of the page: the sampling inputs carry no preset value (a preset
    would be sent with every request, overriding the server's and the model's
    defaults) and the request body does not name them unconditionally."""
    from pathlib import Path

    import server
    html = (Path(server.__file__).parent / "static" / "chat.html").read_text()
    for name in SAMPLING:
        tag = re.search(rf'<input id="{name}"[^>]*>', html, re.S).group(0)
        assert "value=" not in tag and 'class="sampling"' in tag, tag
    body = re.search(r"const body = \{(.*?)\};", html, re.S).group(1)
    assert not any(name in body for name in SAMPLING), body


def test_browser_sends_only_the_sampling_fields_the_user_set(browser, slow_srv):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    d, s = browser, slow_srv
    d.get(s.url + "/chat")
    find = d.find_element
    wait_for(lambda: find(By.ID, "model").text == s.state.model_id)
    d.execute_script("window.__bodies = []; const f = window.fetch;"
                     "window.fetch = (u, o) => { if (o && o.body) window.__bodies.push(o.body);"
                     " return f(u, o); };")

    def send(text):
        s.forced.arm("ok")
        find(By.ID, "input").send_keys(text, Keys.ENTER)
        wait_for(lambda: find(By.ID, "status").text == "done")
        return json.loads(d.execute_script("return window.__bodies[window.__bodies.length - 1];"))

    body = send("hello")
    assert not set(SAMPLING) & set(body), body
    find(By.ID, "temperature").send_keys("0.3")
    body = send("again")
    assert body["temperature"] == 0.3 and "top_p" not in body and "max_tokens" not in body
    find(By.ID, "temperature").clear()
    find(By.ID, "max_tokens").send_keys("7")
    body = send("once more")
    assert body["max_tokens"] == 7 and not {"temperature", "top_p"} & set(body)


def test_browser_attaches_an_image(browser, tmp_path):
    """On a model with a vision tower the page sends an attached image as an image_url
    part (a data: URL): the answer streams, the image shows in the user's bubble, and the
    server ran one request with images."""
    import numpy as np
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from starter.vision import ensure_vision_fixture
    png = tmp_path / "cat.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(png)
    s = start_server(ensure_vision_fixture("bfloat16"), prompt_cache_bytes=0)
    try:
        d = browser
        d.get(s.url + "/chat")
        wait_for(lambda: d.find_element(By.ID, "model").text == s.state.model_id)
        d.find_element(By.ID, "max_tokens").clear()
        d.find_element(By.ID, "max_tokens").send_keys("4")
        d.find_element(By.ID, "attach").send_keys(str(png))
        d.find_element(By.ID, "input").send_keys("What is this?", Keys.ENTER)
        wait_for(lambda: d.find_element(By.ID, "status").text in ("done", "error"))
        assert d.find_element(By.ID, "status").text == "done"
        img = d.find_elements(By.CSS_SELECTOR, ".msg.user img")
        assert len(img) == 1 and img[0].get_attribute("src").startswith("data:image/png;base64,")
        st = s.state.engine.stats()      # (a row of the batch, issue #40)
        assert st["lanes"]["batch"] >= 1 and not st["solo_reasons"].get("images")
        assert d.find_element(By.ID, "attach").get_attribute("value") == ""   # cleared
    finally:
        stop_server(s)
