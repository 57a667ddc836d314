"""The L3 gate on a model that has learned something: train a preset on a synthetic language, then gate.

The L3 gate's top-1 bound (0.99) cannot be judged on a random-weight model: its
next-token distributions are nearly flat, so any change of rounding flips near-ties
(even float32 vs bf16 L1 agrees on only ~95% of positions there). A real checkpoint
has peaked distributions. With no model hub at hand, this script makes one: it trains
a preset shape (full weights, AdamW, float32) on a synthetic language whose next token
is mostly determined, and that needs attention:

- each sequence is a walk of a random Markov chain over V tokens (the successor of a
  token is fixed with probability 0.85, else one of 4 alternatives), followed by an
  exact copy of its first part: predicting the copy means finding the earlier
  occurrence (an induction head), so broken attention or RoPE shows;
- the gate's prompts are such sequences cut inside the copy, so the L1 continuation
  (which both paths are then fed) stays in the language.

The trained model is saved in bf16 (`--out/model`), then `parity.l3_gate` runs on it:
L3 against L1, both faults (which must fail), the float32 floor, and with `--batch N`
the batch fast step; with `--bits 4` the same model quantized after training is gated too,
alone and at the same rows (`--out/gate-q4/`; `--quant-only` skips the float gate). Results: `--out/gate/` (l3_gate.md / .json) and `train.json`.

    python experiments/trained_gate.py --preset 1b --steps 500 --out DIR      # GPU
    python experiments/trained_gate.py --quick --out DIR                      # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.levers import parse_spec  # noqa: E402
from engine.loader import load_model  # noqa: E402
from experiments.presets import PRESETS, build_preset  # noqa: E402
from parity import l3_gate  # noqa: E402

# a CPU-size shape for the dry run
SMALL = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=768,
             num_attention_heads=4, num_key_value_heads=4, head_dim=64, vocab_size=1024,
             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
             tie_word_embeddings=False)


class Language:
    """The synthetic language: Markov walk, then a copy of its start."""

    def __init__(self, vocab: int, seed: int = 0, p_next: float = 0.85):
        self.rng = np.random.default_rng(seed)
        self.V = min(vocab, 2048)
        self.succ = self.rng.permutation(self.V)
        self.alts = self.rng.integers(0, self.V, size=(self.V, 4))
        self.p = p_next

    def walk(self, n: int) -> list[int]:
        t = int(self.rng.integers(self.V))
        out = [t]
        for _ in range(n - 1):
            t = int(self.succ[t] if self.rng.random() < self.p else self.alts[t, self.rng.integers(4)])
            out.append(t)
        return out

    def sequence(self, length: int) -> list[int]:
        half = length // 2
        w = self.walk(half)
        return w + w[: length - half]

    def batch(self, n: int, length: int) -> mx.array:
        return mx.array(np.array([self.sequence(length + 1) for _ in range(n)], dtype=np.int32))


def train(model, lang: Language, steps: int, batch: int, length: int, lr: float,
          warmup: int = 0, clip: float = 0.0) -> list[float]:
    """AdamW on the language; `warmup` steps of linear learning-rate warm-up and gradient
    clipping at norm `clip` when given (the gate trains without either, as it always has)."""
    model.set_dtype(mx.float32)
    rate = (optim.join_schedules([optim.linear_schedule(lr / warmup, lr, warmup), lambda _: lr],
                                 [warmup]) if warmup else lr)
    opt = optim.AdamW(learning_rate=rate, weight_decay=0.0)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    step = nn.value_and_grad(model, loss_fn)
    losses = []
    for i in range(steps):
        seq = lang.batch(batch, length)
        loss, grads = step(model, seq[:, :-1], seq[:, 1:])
        if clip:
            grads, _ = optim.clip_grad_norm(grads, clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        if i % max(1, steps // 10) == 0 or i == steps - 1:
            print(json.dumps({"step": i, "loss": round(losses[-1], 4)}), flush=True)
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--quick", action="store_true", help="CPU dry run: a small shape, few steps")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16, help="sequences per training step")
    ap.add_argument("--length", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gate-steps", type=int, default=32)
    ap.add_argument("--gate-batch", default="", help="also gate the fast runner's rows, joining "
                    "and leaving mid-flight, at these row counts (e.g. 1,8,32)")
    ap.add_argument("--gate-verify", default="", help="also gate the fast runner's verify steps "
                    "(speculating rows, up to --gate-k drafts a step, some taken back) at these "
                    "row counts (e.g. 1,8)")
    ap.add_argument("--gate-k", type=int, default=4, help="with --gate-verify: the most drafts")
    ap.add_argument("--bits", default="", help="also gate the trained model quantized to these "
                    "bits (comma list, e.g. 4): saved in --out/model-qN, results in --out/gate-qN")
    ap.add_argument("--quant-only", action="store_true",
                    help="with --bits: gate only the quantized model (the float gate is skipped)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.quick:
        PRESETS["gate-small"] = SMALL
        a.preset, a.steps, a.batch, a.length = "gate-small", min(a.steps, 60), 8, 128
        a.lr = max(a.lr, 2e-3)
    src = build_preset(a.preset, out / "init")
    model = load_model(src)[0]
    lang = Language(model.args.vocab_size)
    t0 = time.perf_counter()
    losses = train(model, lang, a.steps, a.batch, a.length, a.lr)
    train_s = time.perf_counter() - t0
    mdir = save_trained(model, src, out / "model")
    # gate prompts: a walk and the first 8 tokens of its copy (the rest is predictable)
    half = 64
    prompts = []
    for _ in range(a.prompts):
        w = lang.walk(half)
        prompts.append(w + w[:8])
    batches = [int(x) for x in str(a.gate_batch).split(",") if x.strip()]
    verifies = [int(x) for x in str(a.gate_verify).split(",") if x.strip()]

    def gate(model_dir: Path) -> list:
        res = l3_gate.run_gate(model_dir, parse_spec("l3"), prompt_list=prompts, steps=a.gate_steps)
        for rows in batches:
            res += l3_gate.run_batch_gate(model_dir, rows, parse_spec("l3"),
                                          prompt_list=prompts, steps=a.gate_steps)
        for rows in verifies:
            res += l3_gate.run_verify_gate(model_dir, rows, a.gate_k, parse_spec("l3"),
                                           prompt_list=prompts, steps=a.gate_steps)
        return res

    results = [] if (a.quant_only and a.bits) else gate(mdir)
    info = {"preset": a.preset, "steps": a.steps, "batch": a.batch, "length": a.length, "lr": a.lr,
            "first_loss": losses[0], "last_loss": losses[-1], "train_s": round(train_s, 1),
            "device": str(mx.default_device())}
    (out / "train.json").write_text(json.dumps({**info, "losses": losses}, indent=2))
    cmd = "python experiments/trained_gate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if results:
        l3_gate.write(results, out / "gate",
                      f"Preset `{a.preset}` trained {a.steps} steps on the synthetic language of "
                      f"experiments/trained_gate.py (loss {losses[0]:.2f} -> {losses[-1]:.2f}), "
                      f"saved in bf16; device {mx.default_device()}. Reproduce: `{cmd.strip()}`")
    for r in results:
        print(json.dumps(r.__dict__), flush=True)
    print(json.dumps(info))
    for bits in [int(b) for b in a.bits.split(",") if b.strip()]:
        qdir = save_quantized(mdir, out / f"model-q{bits}", bits)
        qres = gate(qdir)
        l3_gate.write(qres, out / f"gate-q{bits}",
                      f"The trained model of `{out / 'gate'}` quantized to {bits} bits (groups of 64) "
                      f"after training; device {mx.default_device()}. Reproduce: `{cmd.strip()}`")
        for r in qres:
            print(json.dumps({"bits": bits, **r.__dict__}), flush=True)
    return 0


def save_trained(model, src: Path, dst: Path) -> Path:
    """`model` saved in bf16 in `dst`, with the config and tokenizer files of `src`."""
    model.set_dtype(mx.bfloat16)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


def save_quantized(src: Path, dst: Path, bits: int, group_size: int = 64) -> Path:
    """The model of `src` affine-quantized (every Linear and the embedding), saved in `dst`."""
    model = load_model(src)[0]
    nn.quantize(model, group_size=group_size, bits=bits)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = {"group_size": group_size, "bits": bits}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


if __name__ == "__main__":
    raise SystemExit(main())
