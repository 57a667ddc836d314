"""Rows of the continuous batch that bring their prompt's input embeddings (a request with
images: the text embeddings with the images' features in place, `engine.step.vision`).

When a prefill chunk or a graduation holds such a row, the batch's forward takes
`input_embeddings` [B, T, D] for every row: the image row's slice of its own embeddings, the
other rows' (and every padding position's) token embeddings (`model.token_embeddings`, the
values the model's own embedding lookup gives: `begin` scales both the same way). On the CPU
a row's values do not depend on the other rows of the forward, so the image row computes what
it computes alone and the text rows what they compute without it (full attention; see
docs/batching.md for the sliding-window rings).

A row may also bring its own token positions (`BatchRequest.positions`: Qwen2.5-VL's M-RoPE
table of its prompt, images at their grid positions, and the delta after it). Before every
forward of a group (prefill chunk, graduation, decode, speculation) `bind_row_positions`
puts the rows' positions on the group's first-layer batch cache (`row_positions`: one entry a
row, None for a text row); the model then gives each row its own positions from its offset
(its real tokens: left padding is not counted), so a text row keeps offset + t on every axis
and the image row takes what it takes alone."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx

__all__ = ["embedding_kwargs", "bind_row_positions"]


def embedding_kwargs(model, rows, starts: Sequence[int], chunks: List[list],
                     width: int) -> dict:
    """The model's keyword arguments for one forward over `chunks` (row i's tokens, right
    padded with token 0 to `width`): {"input_embeddings": [B, width, D]} when a row brings
    its prompt's embeddings (`rows[i].embeds` [1, L, D]; None: a text row, or one whose
    embeddings are used up), else {} (the tokens' own). starts[i]: where row i's chunk
    starts in its prompt."""
    embeds = [r.embeds for r in rows]
    if all(e is None for e in embeds):
        return {}
    parts = []
    for e, s, c in zip(embeds, starts, chunks):
        pad = width - len(c)
        if e is None:
            parts.append(model.token_embeddings(mx.array([list(c) + [0] * pad])))
            continue
        own = e[:, s:s + len(c)]
        if pad:
            own = mx.concatenate([own, model.token_embeddings(mx.zeros((1, pad), mx.int32))
                                  .astype(own.dtype)], axis=1)
        parts.append(own)
    return {"input_embeddings": mx.concatenate(parts, axis=0)}


def bind_row_positions(rows, caches) -> None:
    """Put `rows`' own positions (`rows[i].req.positions`, None for a text row) on the
    first-layer cache of their group's batch caches `caches`, for the next forward; a group
    none of whose rows has any clears what an earlier group of the same caches left."""
    if not isinstance(caches, list) or not caches:       # (the fast runner's slot pool)
        return
    pos = [r.req.positions for r in rows]
    if any(p is not None for p in pos):
        caches[0].row_positions = pos
    elif getattr(caches[0], "row_positions", None) is not None:
        caches[0].row_positions = None
