"""LoRA adapters: mount / use / stack / switch / unmount over HTTP (llama fixture).

Every server here runs twice: L1 as is, and with merged projections (`--merged-proj`,
whose merged q/k/v and gate/up groups split when an adapter is mounted onto them)."""

import json
import threading
import time
import uuid

import httpx
import pytest

from srv_helpers import make_adapter, start_server, stop_server

NO_EOS = {"1009": -100, "1016": -100, "1017": -100}   # the llama fixture's EOS ids


@pytest.fixture(scope="module")
def adapters(llama_dir, qwen_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {"A": make_adapter(llama_dir, d / "A", seed=1),
            "B": make_adapter(llama_dir, d / "B", seed=2, keys=("self_attn.q_proj",
                                                                 "mlp.up_proj")),
            "qwen": make_adapter(qwen_dir, d / "qwen", seed=3)}


@pytest.fixture(scope="module", params=["l1", "l1+merged_proj"])
def levers(request):
    from engine.levers import parse_spec
    return parse_spec(request.param)


@pytest.fixture(scope="module")
def lsrv(llama_dir, adapters, levers):
    s = start_server(llama_dir, prompt_cache_bytes=64 << 20, levers=levers)
    for name in ("A", "B"):
        r = httpx.post(s.v1 + "/adapters", json={"id": name, "path": str(adapters[name])})
        assert r.status_code == 200, r.text
    yield s
    stop_server(s)


def ref(served, prompt, adapter_paths=(), max_tokens=8):
    """engine.generate on a fresh model with `adapter_paths` mounted (on the model thread)."""
    import engine
    from engine.adapters import mount as lora_mount
    def run():
        m, t = engine.load(served.model_dir)
        for i, p in enumerate(adapter_paths):
            lora_mount.mount_adapter(m, p, name=f"ref{i}")
        return engine.generate(m, t, prompt, max_tokens=max_tokens, temperature=0.0).text
    return served.on_worker(run)


def complete(s, prompt, adapter=None, max_tokens=8, **kw):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    if adapter is not None:
        body["adapter"] = adapter
    r = httpx.post(s.v1 + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def text(s, prompt, adapter=None, **kw):
    return complete(s, prompt, adapter, **kw)["choices"][0]["text"]


def test_list(lsrv, adapters):
    r = httpx.get(lsrv.v1 + "/adapters").json()
    got = {a["id"]: a for a in r["adapters"]}
    assert list(got) == ["A", "B"]
    a = got["A"]
    assert a["path"] == str(adapters["A"]) and a["rank"] == 4 and a["scale"] == 2.0
    # 2 layers x (q_proj, v_proj, down_proj)
    assert a["mounted_layers"] == 6 and got["B"]["mounted_layers"] == 4
    assert a["size_bytes"] > 0


def test_selection_equals_in_process(lsrv, adapters):
    p = f"The capital {uuid.uuid4().hex[:6]}"
    base = text(lsrv, p)
    assert base == ref(lsrv, p)
    assert text(lsrv, p, "none") == base
    a = text(lsrv, p, "A")
    assert a == ref(lsrv, p, [adapters["A"]])
    assert a != base                      # the adapter really changes the output
    b = text(lsrv, p, "B")
    assert b == ref(lsrv, p, [adapters["B"]]) and b != a
    # switching back and forth equals isolated runs
    assert text(lsrv, p, "A") == a and text(lsrv, p) == base and text(lsrv, p, "B") == b
    ab = text(lsrv, p, "A+B")
    assert ab == ref(lsrv, p, [adapters["A"], adapters["B"]])
    assert text(lsrv, p, "B,A") == ab     # a stack is applied in mount order
    assert text(lsrv, p, ["A", "B"]) == ab


def test_prompt_cache_is_namespaced_per_adapter_stack(lsrv):
    p = f"Namespace test {uuid.uuid4().hex[:6]} " * 3
    cached = lambda a=None: complete(lsrv, p, a)["usage"]["prompt_tokens_details"]["cached_tokens"]
    first, second = cached(), cached()
    n = len(lsrv.tokenizer.encode(p))
    assert first <= 1 and second == n - 1     # (BOS may be shared with earlier prompts)
    # the base KV for this prefix exists, but A must not reuse it
    assert cached("A") <= 1
    assert cached("A") == n - 1
    assert cached("A+B") <= 1


def test_bad_mounts_are_all_or_nothing(lsrv, adapters, tmp_path):
    p = f"Stable {uuid.uuid4().hex[:6]}"
    base = text(lsrv, p)
    cases = [({"id": "Q", "path": str(adapters["qwen"])}, "do not fit"),
             ({"id": "M", "path": str(tmp_path / "missing")}, "does not exist"),
             ({"id": "A", "path": str(adapters["A"])}, "already mounted"),
             ({"id": "a+b", "path": str(adapters["A"])}, "adapter id"),
             ({"id": "X"}, "path required")]
    for body, needle in cases:
        r = httpx.post(lsrv.v1 + "/adapters", json=body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], r.json()
    assert [a["id"] for a in httpx.get(lsrv.v1 + "/adapters").json()["adapters"]] == ["A", "B"]
    assert text(lsrv, p) == base          # the failed mounts left the model untouched
    r = httpx.post(lsrv.v1 + "/completions", json={"prompt": p, "adapter": "Q"})
    assert r.status_code == 400 and 'unknown adapter "Q"' in r.json()["error"]["message"]


def test_mount_does_not_wait_for_the_running_generation(lsrv, adapters):
    """A mount runs between two steps (L1): the running stream goes on, its tokens unchanged
    (the new adapter is off for it; merged projections split back give the same values)."""
    body = {"prompt": "long", "max_tokens": 300, "temperature": 0, "stream": True,
            "logit_bias": NO_EOS}
    quiet = {**body, "stream": False}
    want = httpx.post(lsrv.v1 + "/completions", json=quiet, timeout=120).json()
    want = want["choices"][0]["text"]
    times, got = {}, []

    def mount():
        r = httpx.post(lsrv.v1 + "/adapters", json={"id": "C", "path": str(adapters["A"])},
                       timeout=60)
        times["mounted"] = time.monotonic()
        times["status"] = r.status_code

    with httpx.stream("POST", lsrv.v1 + "/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        t = None
        for line in lines:
            if line.startswith("data: {"):
                got.append(json.loads(line[6:])["choices"][0]["text"])
                if t is None:
                    t = threading.Thread(target=mount)
                    t.start()
        times["stream_end"] = time.monotonic()
    t.join()
    assert times["status"] == 200
    assert times["mounted"] < times["stream_end"] - 0.05     # it did not wait for the stream
    assert "".join(got) == want                               # the stream is unchanged
    assert httpx.delete(lsrv.v1 + "/adapters/C").status_code == 200


def _merged_groups(s):
    """(q/k/v merged, gate/up merged) in the served model's first layer."""
    from engine.fast.merge import Part
    layer = s.model.layers[0]
    return isinstance(layer.self_attn.q_proj, Part), isinstance(layer.mlp.gate_proj, Part)


def test_unmount(llama_dir, adapters, levers):
    s = start_server(llama_dir, levers=levers)
    try:
        p = f"Unmount {uuid.uuid4().hex[:6]}"
        base = text(s, p)
        r = httpx.post(s.v1 + "/adapters", json={"id": "A", "path": str(adapters["A"])}).json()
        assert r["mounted_layers"] == 6
        assert text(s, p, "A") != base
        # mounted at scale 0 it is the base model
        z = httpx.post(s.v1 + "/adapters", json={"id": "Z", "path": str(adapters["B"]),
                                                 "scale": 0}).json()
        assert z["scale"] == 0.0
        assert text(s, p, "Z") == base and text(s, p, "A+Z") == text(s, p, "A")
        assert httpx.delete(s.v1 + "/adapters/Z").status_code == 200
        assert _merged_groups(s) == ((False, True) if levers.merged_proj else (False, False))
        r = httpx.delete(s.v1 + "/adapters/A")
        assert r.status_code == 200 and r.json() == {"id": "A", "removed_layers": 6}
        assert text(s, p) == base
        # no adapter left: with merged_proj the groups are merged again
        assert _merged_groups(s) == ((True, True) if levers.merged_proj else (False, False))
        r = httpx.post(s.v1 + "/completions", json={"prompt": p, "adapter": "A"})
        assert r.status_code == 400
        r = httpx.delete(s.v1 + "/adapters/A")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        # remount under the same id: a new namespace, never the old adapter's KV
        httpx.post(s.v1 + "/adapters", json={"id": "A", "path": str(adapters["B"])})
        assert text(s, p, "A") == ref(s, p, [adapters["B"]])
    finally:
        stop_server(s)


def test_startup_adapter_is_the_default(llama_dir, adapters, levers):
    s = start_server(llama_dir, adapter=str(adapters["A"]), levers=levers)
    try:
        p = f"Default {uuid.uuid4().hex[:6]}"
        assert text(s, p) == ref(s, p, [adapters["A"]])
        assert text(s, p, "none") == ref(s, p)
        st = httpx.get(s.url + "/stats").json()["adapters"]
        assert st == {"mounted": ["A"], "default": ["A"]}
    finally:
        stop_server(s)


@pytest.mark.parity
def test_served_adapter_tokens_equal_mlx_lm(lsrv, adapters):
    """L1: with adapter A selected, the served tokens *and* their log-probabilities (the
    full-vocab log-softmax of the logits) equal mlx_lm.load(adapter_path=A)'s."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    msgs = [{"role": "user", "content": f"parity {uuid.uuid4().hex[:6]}"}]
    r = httpx.post(lsrv.v1 + "/chat/completions", timeout=60, json={
        "messages": msgs, "max_tokens": 12, "temperature": 0, "adapter": "A",
        "logprobs": True, "top_logprobs": 5}).json()
    content = r["choices"][0]["logprobs"]["content"]
    ours = [e["id"] for e in content]
    from engine.step.generation import encode_prompt
    ids = encode_prompt(lsrv.tokenizer, msgs)
    model, _ = mlx_lm.load(str(lsrv.model_dir), adapter_path=str(adapters["A"]))
    steps = [(int(t), lp) for t, lp in generate_step(mx.array(ids), model, max_tokens=12)]
    theirs = [t for t, _ in steps]
    assert ours == theirs[:len(ours)]
    if len(ours) < 12:
        assert theirs[len(ours)] in lsrv.tokenizer.eos_token_ids
    for e, (t, lp) in zip(content, steps):
        assert e["logprob"] == lp[t].item()
        assert [x["logprob"] for x in e["top_logprobs"]] == \
            sorted(lp.tolist(), reverse=True)[:5]


@pytest.mark.parity
def test_mounted_but_inactive_equals_base_mlx_lm(lsrv):
    """L1: with A and B mounted but not selected, the served log-probabilities equal
    mlx_lm.load(model) without any adapter, bit for bit."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    prompt = f"inactive {uuid.uuid4().hex[:6]}"
    r = complete(lsrv, prompt, "none", max_tokens=6, logprobs=3)
    lp = r["choices"][0]["logprobs"]
    model, tok = mlx_lm.load(str(lsrv.model_dir))
    steps = [(int(t), l) for t, l in generate_step(mx.array(tok.encode(prompt)), model,
                                                   max_tokens=len(lp["token_logprobs"]))]
    assert lp["token_logprobs"] == [l[t].item() for t, l in steps]
