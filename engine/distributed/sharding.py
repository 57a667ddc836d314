"""Tensor parallelism: shard a loaded model across the ranks of an `mx.distributed` group.

An optional transform over the model files (they stay single-device code): each
block's attention gets its query/key/value projections split by output rows
(each rank computes its share of the heads) and its output projection split by
input columns followed by an all-reduce; the gated MLP gets gate/up split by
rows and down split by columns. Embeddings, norms and the LM head stay whole on
every rank, so every rank ends with the same full logits.

This is mlx-lm's ``shard()`` convention, built on MLX's own sharded layers
(``mlx.nn.layers.distributed.shard_linear``, which also handles quantized
linears), so a sharded model here computes exactly what mlx-lm's
``sharded_load`` model computes under the same launch.

Launch with ``mlx.launch -n N [--backend ring|mpi|nccl] ...``; outside a launch
the group has one rank and sharding is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

# Families whose blocks are `self_attn.{q,k,v,o}_proj` + `mlp.{gate,up,down}_proj`
# with `n_heads` / `n_kv_heads` read at call time.  mlx-lm 0.32.2 shards llama
# (and mistral, which loads as llama) and qwen3; it has no `shard` for minicpm,
# gemma4_text or gemma4, so those have no reference to be proved against and
# are refused here rather than sharded unproven.
SHARDABLE = ("llama", "mistral", "qwen3")


class ShardingError(ValueError):
    """The model cannot be split over this group."""


@dataclass(frozen=True)
class ShardPlan:
    """What `shard_model` did: the group size and each rank's head counts."""
    world_size: int
    rank: int
    n_heads: int
    n_kv_heads: int
    layers: int


def group_or_world(group: Optional[mx.distributed.Group] = None) -> mx.distributed.Group:
    return group if group is not None else mx.distributed.init()


def check_shardable(model, n: int):
    kind = getattr(model, "model_type", None)
    if kind not in SHARDABLE:
        raise ShardingError(f"tensor parallelism supports model types {list(SHARDABLE)}, "
                            f"not {kind!r}")
    a = model.args
    for what, count in (("attention heads", a.num_attention_heads),
                        ("key/value heads", a.num_key_value_heads),
                        ("intermediate size", a.intermediate_size)):
        if count % n:
            raise ShardingError(f"{kind}: {count} {what} do not split over {n} ranks")


def _shard_block(layer, group, n: int):
    attn, mlp = layer.self_attn, layer.mlp
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= n
    attn.n_kv_heads //= n
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_model(model: nn.Module, group: Optional[mx.distributed.Group] = None) -> ShardPlan:
    """Shard `model` in place over `group` (default: the launched world).

    Works on float and quantized weights, lazily loaded or not: only this rank's
    slices are kept (evaluate the parameters afterwards to materialise them).
    """
    group = group_or_world(group)
    n = group.size()
    check_shardable(model, n)
    if n > 1:
        for layer in model.layers:
            _shard_block(layer, group, n)
    first = model.layers[0].self_attn
    return ShardPlan(world_size=n, rank=group.rank(), n_heads=first.n_heads,
                     n_kv_heads=first.n_kv_heads, layers=len(model.layers))


def barrier(group: Optional[mx.distributed.Group] = None):
    """Wait until every rank gets here (a one-element all-reduce on the CPU stream)."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group_or_world(group), stream=mx.cpu))


def agreed_seed(group: Optional[mx.distributed.Group] = None) -> int:
    """A random seed drawn on rank 0 and shared with every rank."""
    import secrets
    group = group_or_world(group)
    mine = secrets.randbelow(2 ** 31) if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu).item())


FRAME_BYTES = 4096   # broadcast_json's first all-reduce: the length and the first bytes


def broadcast_json(obj=None, group: Optional[mx.distributed.Group] = None):
    """Rank 0's JSON-serialisable `obj`, delivered to every rank (others pass anything).

    The building block for driving every rank through the same request: a sum where
    only rank 0 contributes, of one fixed frame holding the UTF-8 length and the first
    bytes; a message longer than the frame takes a second sum for the rest. (One
    collective per message in the common case: each one is a network round trip.)
    Every rank also adds 1 to one byte of the frame, so a sum that did not reach every
    rank (a ring that lost a peer may hand back a partial sum instead of an error) raises
    RuntimeError rather than deliver a message that only some ranks saw."""
    import json

    import numpy as np
    group = group_or_world(group)
    if group.size() == 1:
        return obj
    mx.synchronize()  # no collective still queued on the default stream may interleave
    root = group.rank() == 0
    data = json.dumps(obj).encode() if root else b""
    room = FRAME_BYTES - 5
    frame = np.zeros(FRAME_BYTES, dtype=np.uint8)
    frame[4] = 1                      # every rank: the count of ranks that took part
    if root:
        frame[:4] = np.frombuffer(np.array([len(data)], dtype="<u4").tobytes(), dtype=np.uint8)
        frame[5:5 + min(len(data), room)] = np.frombuffer(data[:room], dtype=np.uint8)
    got = np.array(mx.distributed.all_sum(mx.array(frame), group=group, stream=mx.cpu))
    if int(got[4]) != group.size() % 256:
        raise RuntimeError(f"broadcast reached {int(got[4])} of {group.size()} ranks "
                           "(a rank was lost)")
    n = int(got[:4].view("<u4")[0])
    body = got[5:5 + min(n, room)].tobytes()
    if n > room:
        rest = (np.frombuffer(data[room:], dtype=np.uint8) if root
                else np.zeros(n - room, dtype=np.uint8))
        body += np.array(mx.distributed.all_sum(mx.array(rest), group=group,
                                                stream=mx.cpu)).tobytes()
    return json.loads(body.decode())
