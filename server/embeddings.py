"""OpenAI embeddings: `POST /v1/embeddings`.

The input is tokenized and checked on a thread of its own (a 400 naming `input[i]` for an
empty string, a token id outside the vocabulary, an input over the context; 300,000 tokens
at most together) and grouped (`engine.EmbedJob`: at most `prefill_step_size` padded tokens a
group, a longer input alone); each group runs on the worker thread between two engine steps
(`Gateway.between_steps`: generations keep running, a large request never holds them for
more than one forward, and it does not wait for them to finish), with no adapter active; a
client that leaves stops it between groups. Pooling is the server's (`--embeddings-pooling`, else the
checkpoint's `1_Pooling/config.json`, else last-token); vectors are L2-normalised.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from .models_lease import state_for
from .errors import APIError, bad_request
from .schemas.embeddings import EmbeddingRequest


def _refused(e: ValueError) -> APIError:
    return bad_request(str(e), param=getattr(e, "param", "input"))


def encode_vector(v: np.ndarray, fmt: str):
    """A float list, or base64 of the little-endian float32 bytes (OpenAI's encoding)."""
    if fmt == "base64":
        le = v.astype("<f4", copy=False)
        return base64.b64encode(le.tobytes()).decode("ascii")
    return v.tolist()


async def embeddings(request: Request, validated: EmbeddingRequest):
    from engine import EmbedJob, EmbeddingInputError

    state = await state_for(request, validated.model)
    if state.config.tensor_parallel:
        raise bad_request("embeddings are not served with --tensor-parallel")
    hidden = getattr(getattr(state.model, "args", None), "hidden_size", None)
    dims = validated.dimensions
    if dims is not None and hidden and dims > hidden:
        raise bad_request(f"dimensions must be at most {hidden} (this model's hidden size), "
                          f"got {dims}", param="dimensions")

    limit = min((n for n in (state.ceiling, state.max_position) if n), default=None)

    def plan():       # tokenized and grouped away from the event loop and the model's thread
        return EmbedJob(state.model, state.tokenizer, validated.input,
                        pooling=state.embeddings_pooling, dimensions=dims, max_tokens=limit,
                        batch_tokens=state.engine.prefill_step_size)
    try:
        job = await asyncio.to_thread(plan)
    except EmbeddingInputError as e:
        raise _refused(e) from None

    def run(i):      # one group's forward between two decode steps (the last: the result)
        with state.adapters.base_model():
            job.run(i)
            return job.result() if i == len(job.groups) - 1 else None
    for i in range(len(job.groups)):
        if i and await request.is_disconnected():
            raise bad_request("the client left")
        out = await state.gateway.between_steps(run, i)
    fmt = validated.encoding_format or "float"
    vectors = np.array(out.vectors, copy=False)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)}
            for i, v in enumerate(vectors)]
    n = out.prompt_tokens
    return JSONResponse({"object": "list", "data": data, "model": state.model_id,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
