"""LoRA / QLoRA layers and mlx-lm-compatible adapter files (mounting at run time:
`engine.adapters.mount`).

A targeted projection becomes a :class:`LoRALinear` that *wraps* the base layer
(``nn.Linear`` or ``nn.QuantizedLinear``, whose weight is never modified) and
adds low-rank updates on top of it:

    y = base(x) + (scale * ((dropout(x) @ A) @ B)).astype(x.dtype)      (primary)
              [+ (s_k * ((x @ A_k) @ B_k)).astype(x.dtype)  for each stacked adapter k]

The primary adapter (``lora_a`` [in, r], ``lora_b`` [r, out], float32) lives in
the parameter tree under the names mlx-lm uses
(``model.layers.0.self_attn.q_proj.lora_a``), so training, gradients and
``adapters.safetensors`` line up with mlx-lm name for name. Further adapters
mounted at runtime (`engine.adapters.mount.mount_adapter` with a second name) are kept *outside*
the parameter tree, frozen, and applied after the primary in mount order. An
adapter that is inactive or has scale 0 is skipped entirely, so it leaves the
base output bit for bit.

Initialisation follows mlx-lm's ``linear_to_lora_layers`` exactly, so that with
the same ``mx.random.seed`` the A matrices are identical: targets are visited
layer by layer (the last ``num_layers``), within a layer in the order mlx-lm's
``Module.named_modules`` yields them (a stack-based DFS: children in *reverse*
attribute-definition order), and each target draws two uniforms from the global
key - first the (discarded) weight of the ``nn.Linear`` that mlx-lm's
``LoRALinear.__init__`` builds, then A ~ U(-1/sqrt(in), 1/sqrt(in)) - while B
starts at zero. Our block classes define the MLP as gate/up/down, mlx-lm's
llama/qwen3/gemma4 define gate/down/up (minicpm gate/up/down), hence the small
per-family table below.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.adapters.rows import row_mask
from engine.adapters.switch import SWITCH_TYPES, LoRASwitchLinear
from engine.models.switch import SwitchGLU

ADAPTER_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"
DEFAULT_LORA = {"rank": 8, "dropout": 0.0, "scale": 20.0}

TARGET_TYPES = (nn.Linear, nn.QuantizedLinear)
_EMBED_TYPES = (nn.Embedding, nn.QuantizedEmbedding)

# Attribute-definition order of the MLP projections in mlx-lm 0.32.2's model
# files (it decides the order in which mlx-lm draws the LoRA A matrices).
_MLX_LM_MLP_ORDER = {
    "llama": ("gate_proj", "down_proj", "up_proj"),
    "mistral": ("gate_proj", "down_proj", "up_proj"),
    "qwen3": ("gate_proj", "down_proj", "up_proj"),
    "gemma4_text": ("gate_proj", "down_proj", "up_proj"),
    "gemma4": ("gate_proj", "down_proj", "up_proj"),
    "gemma4_unified": ("gate_proj", "down_proj", "up_proj"),
    "qwen2": ("gate_proj", "down_proj", "up_proj"),
    "qwen3_moe": ("gate_proj", "down_proj", "up_proj"),
    "minicpm": ("gate_proj", "up_proj", "down_proj"),
}


class AdapterError(ValueError):
    """An adapter directory or file that cannot be applied to this model."""


class _Stack:
    """Runtime adapters of one layer; a plain object so nothing in it joins the
    parameter tree or the module traversal."""

    def __init__(self):
        self.items: list[dict] = []  # {"name", "a", "b", "scale", "active"}

    def find(self, name):
        return next((it for it in self.items if it["name"] == name), None)


def input_dims(linear) -> int:
    out_dims, in_dims = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        in_dims = in_dims * 32 // linear.bits
    return in_dims


def _add(y, update, rows):
    """y + update, or only in the rows selected (`rows`: a boolean mask; None: every row)."""
    return y + update if rows is None else mx.where(rows, y + update, y)


class LoRALinear(nn.Module):
    """A base projection plus LoRA updates (see the module docstring)."""

    def __init__(self, base: nn.Module, rank: int = 8, scale: float = 20.0,
                 dropout: float = 0.0, with_primary: bool = True, primary_name: str = "default"):
        super().__init__()
        if not isinstance(base, TARGET_TYPES):
            raise TypeError(f"LoRA wraps nn.Linear / nn.QuantizedLinear, not {type(base).__name__}")
        self.linear = base
        self.dropout = nn.Dropout(p=dropout)
        self.scale = float(scale)
        self.rank = int(rank)
        self.enabled = True
        self.primary_name = primary_name
        self._stack = _Stack()
        if with_primary:
            in_dims = input_dims(base)
            out_dims = base.weight.shape[0]
            self.lora_a = mx.zeros((in_dims, rank))
            self.lora_b = mx.zeros((rank, out_dims))

    @property
    def input_dims(self) -> int:
        return input_dims(self.linear)

    @property
    def output_dims(self) -> int:
        return self.linear.weight.shape[0]

    @property
    def has_primary(self) -> bool:
        return "lora_a" in self

    def init_like_mlx_lm(self):
        """Draw A the way mlx-lm's LoRALinear does (two global-key draws), B = 0."""
        in_dims, out_dims = self.input_dims, self.output_dims
        bound = 1 / math.sqrt(in_dims)
        # 1) the weight of the throw-away nn.Linear(in, out) mlx-lm builds first
        mx.random.uniform(low=-bound, high=bound, shape=(out_dims, in_dims))
        # 2) A itself
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(in_dims, self.rank))
        self.lora_b = mx.zeros((self.rank, out_dims))

    def __call__(self, x):
        y = self.linear(x)
        if self.has_primary and self.scale != 0:
            m = row_mask(self.primary_name, y.ndim)   # (rows of a batch: engine.adapters.rows)
            if m is not None or self.enabled:
                z = (self.dropout(x) @ self.lora_a) @ self.lora_b
                y = _add(y, (self.scale * z).astype(x.dtype), m)
        for it in self._stack.items:
            m = row_mask(it["name"], y.ndim)
            if (m is not None or it["active"]) and it["scale"] != 0:
                z = (x @ it["a"]) @ it["b"]
                y = _add(y, (it["scale"] * z).astype(x.dtype), m)
        return y

    def fused_weight(self) -> mx.array:
        """Dense base weight plus every active update (for export / inspection)."""
        w = self.linear.weight
        if isinstance(self.linear, nn.QuantizedLinear):
            w = mx.dequantize(w, self.linear.scales, self.linear.biases,
                              group_size=self.linear.group_size, bits=self.linear.bits,
                              mode=getattr(self.linear, "mode", "affine"))
        terms = []
        if self.enabled and self.has_primary and self.scale != 0:
            terms.append((self.scale, self.lora_a, self.lora_b))
        terms += [(it["scale"], it["a"], it["b"]) for it in self._stack.items
                  if it["active"] and it["scale"] != 0]
        for s, a, b in terms:
            w = w + ((s * b.T) @ a.T).astype(w.dtype)
        return w


# --- targets ------------------------------------------------------------------


def _children_in_mlx_lm_order(mod: nn.Module, model_type: str):
    kids = [(k, v) for k, v in mod.children().items()]
    names = {k for k, _ in kids}
    order = _MLX_LM_MLP_ORDER.get(model_type)
    # (expert switch layers keep their definition order: gate/up/down in both engines)
    if order and names == set(order) and not isinstance(mod, SwitchGLU):
        kids = sorted(kids, key=lambda kv: order.index(kv[0]))
    return kids


def _named_modules_mlx_lm_order(root: nn.Module, model_type: str):
    """(path, module) in the order mlx-lm's named_modules visits an mlx-lm module
    tree of this shape: pop from a stack, push children in definition order."""
    out, stack = [], [("", root)]
    while stack:
        prefix, mod = stack.pop()
        out.append((prefix, mod))
        pre = prefix + "." if prefix else ""
        for k, v in _children_in_mlx_lm_order(mod, model_type):
            flat = tree_flatten(v, prefix="." + pre + k, is_leaf=lambda m: isinstance(m, nn.Module))
            stack.extend((p, m) for p, m in flat if isinstance(m, nn.Module))
    return out


def default_keys(model) -> set:
    """mlx-lm's default targets: every Linear, expert switch layer (and Embedding)
    path inside any block."""
    keys = set()
    for layer in model.layers:
        for p, m in layer.named_modules():
            base = m.linear if isinstance(m, (LoRALinear, LoRASwitchLinear)) else m
            if isinstance(base, TARGET_TYPES + _EMBED_TYPES + SWITCH_TYPES):
                keys.add(p)
    return keys


def _model_type(model) -> str:
    return getattr(model, "model_type", None) or getattr(getattr(model, "args", None),
                                                         "model_type", "")


def lora_targets(model, num_layers: int, keys: Optional[Iterable[str]] = None) -> list[str]:
    """Full module paths mlx-lm's `linear_to_lora_layers` would convert, in its order.

    `keys` are paths relative to a block (``self_attn.q_proj``) or, for modules
    outside the blocks, full model paths; None = :func:`default_keys`.
    num_layers: the last N blocks; -1 (and, as in mlx-lm, 0) = all."""
    layers = model.layers
    if num_layers > len(layers):
        raise ValueError(f"Requested to train {num_layers} layers but the model only has "
                         f"{len(layers)} layers.")
    keys = set(default_keys(model) if keys is None else keys)
    # absolute path of each block, by identity
    block_path = {id(m): p for p, m in model.named_modules()}
    mt = _model_type(model)
    out = []
    start = len(layers) - len(layers[-max(num_layers, 0):])
    for i in range(start, len(layers)):
        layer = layers[i]
        lp = block_path[id(layer)]
        for p, m in _named_modules_mlx_lm_order(layer, mt):
            if p in keys and p:
                out.append(f"{lp}.{p}")
    # model-level keys (full paths) - mlx-lm's second pass over model.named_modules()
    for p, m in _named_modules_mlx_lm_order(model, mt):
        if p in keys and p:
            out.append(p)
    return out


def get_module(model, path: str):
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else getattr(m, part)
    return m


def set_module(model, path: str, new):
    model.update_modules(tree_unflatten([(path, new)]))


def apply_lora(model, rank: int = 8, scale: float = 20.0, dropout: float = 0.0,
               num_layers: int = -1, keys: Optional[Iterable[str]] = None,
               freeze: bool = True) -> list[str]:
    """Wrap the targets in LoRALinear with fresh trainable A/B (mlx-lm's init and
    order). Freezes the rest of the model first (as mlx-lm's trainer does).
    Returns the wrapped paths."""
    targets = lora_targets(model, num_layers, keys)
    if freeze:
        model.freeze()
    done = []
    for path in targets:
        m = get_module(model, path)
        if isinstance(m, LoRALinear):
            if m.has_primary:
                raise AdapterError(f"{path} already has a trainable LoRA adapter")
            m.rank, m.scale = int(rank), float(scale)
            m.dropout = nn.Dropout(p=dropout)
            m.init_like_mlx_lm()
            done.append(path)
            continue
        if isinstance(m, _EMBED_TYPES):
            raise NotImplementedError(f"LoRA on embeddings ({path}) is not supported")
        if isinstance(m, SWITCH_TYPES):   # MoE experts: one adapter pair per expert
            set_module(model, path, LoRASwitchLinear(m, rank=rank, scale=scale, dropout=dropout))
            done.append(path)
            continue
        if isinstance(m, LoRASwitchLinear):
            raise AdapterError(f"{path} already has a trainable LoRA adapter")
        if not isinstance(m, TARGET_TYPES):
            raise AdapterError(f"can't convert {path} ({type(m).__name__}) to LoRA")
        lora = LoRALinear(m, rank=rank, scale=scale, dropout=dropout, with_primary=False)
        lora.init_like_mlx_lm()
        set_module(model, path, lora)
        done.append(path)
    return done


def lora_layers(model) -> list[tuple[str, LoRALinear]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_weights(model) -> dict:
    """The primary adapter tensors, named as mlx-lm names them."""
    return {k: v for k, v in tree_flatten(model.trainable_parameters())
            if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}


# --- files --------------------------------------------------------------------


def adapter_config(rank, scale, dropout, num_layers, keys=None, **extra) -> dict:
    lp = {"rank": int(rank), "dropout": float(dropout), "scale": float(scale)}
    if keys is not None:
        lp["keys"] = sorted(keys)
    cfg = {"fine_tune_type": "lora", "num_layers": int(num_layers), "lora_parameters": lp}
    cfg.update(extra)
    return dict(sorted(cfg.items()))


def save_adapter(model, adapter_dir, config: dict, weights_file: str = ADAPTER_FILE):
    """Write `adapters.safetensors` + `adapter_config.json` (mlx-lm's format)."""
    d = Path(adapter_dir)
    d.mkdir(parents=True, exist_ok=True)
    w = adapter_weights(model)
    if not w:
        raise AdapterError("the model has no trainable LoRA weights to save")
    mx.save_safetensors(str(d / weights_file), w)
    (d / CONFIG_FILE).write_text(json.dumps(config, indent=4))
    return d


def read_adapter(adapter_dir):
    """(config, weights) of an mlx-lm-format adapter directory, validated."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise AdapterError(f"{d}: adapter directory does not exist")
    cfg_f, w_f = d / CONFIG_FILE, d / ADAPTER_FILE
    if not cfg_f.exists():
        raise AdapterError(f"{d}: no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_f.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_f}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_f}: expected a JSON object")
    ftype = cfg.get("fine_tune_type", "lora")
    if ftype != "lora":
        raise AdapterError(f"{d}: fine_tune_type {ftype!r} is not supported (only 'lora')")
    lp = cfg.get("lora_parameters")
    if not isinstance(lp, dict) or "rank" not in lp or "scale" not in lp:
        raise AdapterError(f"{cfg_f}: lora_parameters{{rank, scale}} missing")
    if not w_f.exists():
        raise AdapterError(f"{d}: no {ADAPTER_FILE}")
    return cfg, mx.load(str(w_f))


__all__ = [
    "ADAPTER_FILE", "CONFIG_FILE", "DEFAULT_LORA", "AdapterError", "LoRALinear", "TARGET_TYPES",
    "adapter_config", "adapter_weights", "apply_lora", "default_keys", "get_module",
    "input_dims", "lora_layers", "lora_targets", "read_adapter", "save_adapter", "set_module",
]
