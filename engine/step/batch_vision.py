"""Rows of the continuous batch that bring their prompt's input embeddings (a request with
images: the text embeddings with the images' features in place, `engine.step.vision`).

When a prefill chunk or a graduation holds such a row, the batch's forward takes
`input_embeddings` [B, T, D] for every row: the image row's slice of its own embeddings, the
other rows' (and every padding position's) token embeddings (`model.token_embeddings`, the
values the model's own embedding lookup gives: `begin` scales both the same way). On the CPU
a row's values do not depend on the other rows of the forward, so the image row computes what
it computes alone and the text rows what they compute without it (full attention; see
docs/batching.md for the sliding-window rings)."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx

__all__ = ["embedding_kwargs"]


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
