"""--kv-quant: uniform bits and the model dir's kv_config.json reach the engine."""

import json
import os
import uuid

import httpx

from srv_helpers import start_server, stop_server


def _chat(s, q, n=8):
    r = httpx.post(s.v1 + "/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": q}], "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_uniform_kv8(qwen_dir):
    s = start_server(qwen_dir, kv_quant="8")
    try:
        kv = httpx.get(s.url + "/stats").json()["kv_quant"]
        # qwen3 fixture head_dim 32: group 64 cannot apply, 32 is used (and reported)
        assert kv == {"mode": "uniform-kv8", "layers": {"kv8": 2},
                      "attention": {"global": 2, "sliding_window": 0}, "group_size": 32}
        # full-attention layers quantized from token 0: requests are rows of the batch
        # (docs/kv-quant.md), not one at a time
        batch = httpx.get(s.url + "/stats").json()["batch"]
        assert batch["batched"] and batch["configured"] > 1, batch
        q = f"kv {uuid.uuid4().hex[:6]}"
        msgs = [{"role": "user", "content": q}]
        assert _chat(s, q) == s.generate(msgs, max_tokens=8, temperature=0.0, kv_bits=8,
                                         kv_group_size=32).text
    finally:
        stop_server(s)


def test_kv_config_from_model_dir(qwen_dir, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    for f in os.listdir(qwen_dir):
        os.symlink(qwen_dir / f, d / f)
    cfg = [{"layer_idx": 1, "bits": 4, "group_size": 32}]
    (d / "kv_config.json").write_text(json.dumps(cfg))
    s = start_server(d)
    try:
        kv = httpx.get(s.url + "/stats").json()["kv_quant"]
        assert kv["mode"] == "mixed (kv_config.json)"
        assert kv["layers"] == {"bf16": 1, "kv4": 1}
        q = f"mixed {uuid.uuid4().hex[:6]}"
        assert _chat(s, q) == s.generate([{"role": "user", "content": q}], max_tokens=8,
                                         temperature=0.0, kv_config=cfg).text
    finally:
        stop_server(s)
    off = start_server(d, kv_quant="off")
    try:
        assert httpx.get(off.url + "/stats").json()["kv_quant"]["mode"] == "bf16"
    finally:
        stop_server(off)
