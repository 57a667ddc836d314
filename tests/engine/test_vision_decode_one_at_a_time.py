"""vision_prompt decodes and preprocesses a request's images one at a time: the decoded
(full size) image is dropped before the next one is decoded, so 16 images of 40 MP each
never hold 16 x 120 MB at once (found by the hostile probe: 2.7 GB for one request)."""

import gc
import io
import weakref

import numpy as np
from PIL import Image

import engine
from engine.vision import preprocessor_for
from starter.vision import ensure_vision_fixture


def _png(seed) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 24, 3),
                                                         dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_each_decoded_image_is_dropped_before_the_next_is_decoded():
    model, tok = engine.load(ensure_vision_fixture("bfloat16"))
    eng = engine.Engine(model, tok)
    real = preprocessor_for(model)
    alive = []

    class Recording:
        def pixels(self, img):
            gc.collect()
            assert not [r for r in alive if r() is not None], "an earlier image is still held"
            alive.append(weakref.ref(img))
            return real.pixels(img)

    eng.image_preprocess = Recording()
    images = [_png(i) for i in range(4)]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}]
             + [{"type": "image"}] * len(images)}]
    ids, vision = eng.vision_prompt(msgs, images)
    assert vision.count == 4 and vision.pixels.shape[0] == 4
    eng.image_preprocess = real
    ids2, vision2 = eng.vision_prompt(msgs, images)
    assert ids2 == ids and vision2.digest == vision.digest
    assert np.array_equal(np.array(vision2.pixels), np.array(vision.pixels))


def test_a_request_s_images_together_have_a_pixel_budget():
    """Each image under its own limit, but the request's images together over the budget:
    an ImageError naming the budget, raised from the header before the image decodes (a
    100-byte PNG can declare 36 MP)."""
    import pytest

    from engine.vision import ImageError, vision_prompt
    model, tok = engine.load(ensure_vision_fixture("bfloat16"))
    images = [_png(i) for i in range(3)]              # 20 x 24 = 480 pixels each
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x"}] + [{"type": "image"}] * 3}]
    vision_prompt(model, tok, msgs, images, max_request_pixels=1440)      # exactly the budget
    with pytest.raises(ImageError, match="image 3: the request's images together have more than 1,439"):
        vision_prompt(model, tok, msgs, images, max_request_pixels=1439)
    with pytest.raises(ImageError, match="image 2: the request's images together"):
        vision_prompt(model, tok, msgs, images, max_pixels=500, max_request_pixels=700)
