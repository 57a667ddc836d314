"""The Engine's side of images in prompts (`engine.vision`): building a prompt from chat
messages with image parts, and a request's input embeddings with the images' features
merged in (computed when it starts: it joins the batch, or starts running alone).

A request with images is a row of the L1 batch runner (`engine.step.batch_vision`: its
prompt's chunks and its last prompt token's step take its merged embeddings, the other rows
of those forwards their tokens' own). On the fast runner, in deterministic mode and where
every request runs alone (max_batch 1, quantized KV, ...) it runs alone
(`solo_reasons["images"]` for the first two), on mlx-vlm's token loop (the prompt's
embeddings through the prefill and the last prompt token's step). Where the images bring
their own token positions (Qwen2.5-VL's M-RoPE: `positional_images`) a row takes them with
it (`BatchRequest.positions`, `image_positions`); a request running alone has them bound to
its caches. Its prompt-cache namespace
carries the digest of the images' bytes, so a prefix is reused only by a request with the
same images (a text-only prefix is not shared with it). On a checkpoint whose decoder
attends to an image's tokens both ways (`whole_image_prompts`) such a request runs alone,
its prompt one forward, without the prompt cache (docs/vision-gemma4.md)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from engine.step.request import RequestState


class VisionPrompts:
    """Mixed into `engine.step.core.Engine` (its model, tokenizer, image_preprocess)."""

    image_preprocess = None       # engine.vision's preprocessing (None: the family default)

    def vision_prompt(self, messages: list, images: list, tools=None,
                      template_kwargs: Optional[dict] = None, max_pixels: Optional[int] = None):
        """(token ids, `engine.vision.VisionInput`) of chat messages whose `{"type": "image"}`
        parts stand for `images` (encoded bytes); pass both to `submit(ids, vision=...)`.
        PromptError / ImageError for a model without a vision tower or a bad image."""
        from engine.vision import DEFAULT_MAX_PIXELS, vision_prompt

        return vision_prompt(self.model, self.tokenizer, messages, images, tools=tools,
                             template_kwargs=template_kwargs, preprocess=self.image_preprocess,
                             max_pixels=max_pixels or DEFAULT_MAX_PIXELS)

    def check_vision(self, vision, prompt_ids: list) -> None:
        from engine.step.request import PromptError
        from engine.vision import has_vision

        if not has_vision(self.model):
            raise PromptError("this model has no vision tower: image inputs are not supported")
        n = sum(1 for t in prompt_ids if t == self.model.vision.image_token_id)
        if vision.tokens is not None:      # (a size-dependent count: Qwen2.5-VL)
            if n != vision.tokens:
                raise PromptError(f"the prompt has {n} image tokens for {vision.count} "
                                  f"image(s) of {vision.tokens} tokens in all")
        elif n != vision.count * self.model.vision.tokens_per_image:
            raise PromptError(f"the prompt has {n} image tokens for {vision.count} image(s) of "
                              f"{self.model.vision.tokens_per_image} tokens each")
        if self.positional_images() and self.policy.active:
            raise PromptError("quantized KV is not supported for this model's image prompts "
                              "(its multimodal positions)")

    def positional_images(self) -> bool:
        """Whether the model's images carry their own token positions (M-RoPE: Qwen2.5-VL):
        a batch row takes them along (`image_positions`), a request running alone has them
        bound to its caches."""
        return hasattr(self.model, "bind_positions")

    def image_positions(self, req: RequestState):
        """The token positions of a request's whole prompt (a reused prefix included) where
        its images bring their own (the model's `Positions`), else None."""
        if req.vision is None or req.vision.grids is None or not self.positional_images():
            return None
        return self.model.image_positions(req.ids, req.vision.grids)

    def prompt_embeddings(self, req: RequestState) -> Optional[mx.array]:
        """The uncached prompt's input embeddings [1, L - reused, D] with the images merged
        in; None without images or when every image token is in the reused prefix."""
        if req.vision is None:
            return None
        grids = req.vision.grids
        if grids is not None and self.positional_images() and req.caches is not None:
            self.model.bind_positions(req.caches, req.ids, grids)   # alone (a reused prefix too)
        image = self.model.vision.image_token_id
        if all(t != image for t in req.ids[req.reused:]):
            return None
        extra = () if grids is None else (grids,)
        embeds = self.model.embed_prompt(req.ids, req.vision.pixels, *extra)
        mx.eval(embeds)
        return embeds[:, req.reused:]
