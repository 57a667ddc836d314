"""The Engine's prefix reuse: a request's starting caches from the prompt cache in RAM
(`engine.kv.prompt_cache`) or, when longer, on disk (`engine.kv.disk_cache`), and a
finished request's caches stored in both.

A request whose images the decoder attends to both ways (`req.whole`) takes a hit only when
every image token of its prompt is inside the reused prefix: the cached KV came from a whole
forward of a prompt with the same images (the namespace holds their digest) and the rest of
the prompt is text, prefilled on the cache as any suffix is (the request then no longer runs
whole). A hit that leaves image tokens to prefill is dropped: those tokens must attend to
their whole image, which only a forward from empty caches does (mlx-vlm's)."""

from __future__ import annotations

import time

from engine.kv.prompt_cache import Hit
from engine.step.request import RequestState


class PrefixReuse:
    """Mixed into `engine.step.core.Engine` (its prompt_cache, disk_cache, adapters)."""

    def _fetch(self, req: RequestState):
        """The request's starting caches (None: it starts empty); times the lookup
        (`req.lookup_at`: RequestOutput.timings)."""
        t0 = time.perf_counter()
        try:
            return self._lookup(req)
        finally:
            req.lookup_at = (t0, time.perf_counter())

    def _lookup(self, req: RequestState):
        if req.prefix is not None:
            return req.prefix
        hit = self.prompt_cache.fetch(req.ns, req.ids) if self.prompt_cache is not None else None
        if self.disk_cache is not None:   # a longer prefix on disk (after a restart) wins
            got = self.disk_cache.restore(self._disk_ns(req), req.ids, hit.reused if hit else 0)
            if got is not None:
                hit = Hit(*got)
        if hit is None:
            return None
        if req.whole:
            blocks = set(self.model.language_model.image_blocks)
            if any(t in blocks for t in req.ids[hit.reused:]):
                return None
            req.whole = False
        req.reused = hit.reused
        return hit.caches

    def _disk_ns(self, req: RequestState) -> str:
        """The adapter set's name on disk: the adapters' files, not this process's mounts
        (and the images' digest, as in `req.ns`, for a request with images)."""
        if not req.adapters:
            return req.ns
        key = self.adapters.disk_key(req.adapters)
        return key if req.vision is None else f"{key}:images:{req.vision.digest}"

    def _keep(self, req: RequestState, tokens: list, caches, copy_caches: bool = True) -> None:
        """Store `caches` (holding exactly `tokens`) on disk, then in RAM."""
        if self.disk_cache is not None:
            self.disk_cache.store(self._disk_ns(req), tokens, caches)
        if self.prompt_cache is not None:
            self.prompt_cache.store(req.ns, tokens, caches, copy_caches=copy_caches)

    def _store(self, req: RequestState, caches) -> None:
        if caches and req.prefix is None:
            tokens = req.ids + req.fed
            # the request is over: the caches are handed to the store, not copied
            self._keep(req, tokens[:caches[0].offset], caches, copy_caches=False)
