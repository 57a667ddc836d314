"""The engine's image path without the oracle: decoding every format and refusing bad
images, the vision checks of `submit`, the prompt cache keyed by the images (and the tower
not run again on a full hit), the PyTorch conv layout, and `engine-convert` keeping the
tower (float, with the processor files) while it quantizes the decoder."""

import base64
import io
import json

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from engine import Engine, PromptCache, PromptError, SamplingParams
from engine.convert import ConvertOptions, convert
from engine.loader import load_model
from engine.models.siglip import VisionTower
from engine.text.tokenizer import load_tokenizer
from engine.vision import ImageError, decode_image, formats, preprocessor_for
from parity.fixtures.models import ensure_fixture
from starter.vision import ensure_vision_fixture

RNG = np.random.default_rng(11)
PIXELS = RNG.integers(0, 256, (20, 30, 3), dtype=np.uint8)
MSG = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]


def _enc(fmt, arr=PIXELS, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP"])
def test_lossless_formats_decode_to_the_pixels(fmt):
    kw = {"lossless": True} if fmt == "WEBP" else {}
    img = decode_image(_enc(fmt, **kw))
    assert img.mode == "RGB" and np.array_equal(np.array(img), PIXELS)


def test_gif_jpeg_and_modes():
    assert decode_image(_enc("GIF")).size == (30, 20)
    assert decode_image(_enc("JPEG")).size == (30, 20)
    la = Image.fromarray(PIXELS[..., 0]).convert("LA")
    buf = io.BytesIO()
    la.save(buf, "PNG")
    assert decode_image(buf.getvalue()).mode == "RGB"
    assert {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"} <= set(formats())


@pytest.mark.parametrize("data,needle", [
    (b"", "no image data"), (b"hello world", "not an image"),
    (_enc("PNG")[:60], "truncated"), (_enc("JPEG")[:200], "truncated"),
    (b"%PDF-1.7\n1 0 obj", "not an image"), (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "not an image")])
def test_bad_images_raise_image_error(data, needle):
    with pytest.raises(ImageError, match=needle):
        decode_image(data)


def test_pixel_limit_is_read_from_the_header():
    buf = io.BytesIO()
    Image.new("1", (12000, 9000)).save(buf, "PNG")      # 108 MP, a few kB
    with pytest.raises(ImageError, match="over the limit"):
        decode_image(buf.getvalue())
    with pytest.raises(ImageError, match="over the limit"):
        decode_image(_enc("PNG"), max_pixels=100)


@pytest.fixture(scope="module")
def vis():
    path = ensure_vision_fixture("float32")
    model, _ = load_model(path)
    return path, model, load_tokenizer(path)


def _engine(vis, **kw):
    path, model, tok = vis
    eng = Engine(model, tok, **kw)
    eng.image_preprocess = preprocessor_for(model, path)
    return eng


def _run(eng, ids, vision, n=4):
    rid = eng.submit(ids, SamplingParams(max_tokens=n, temperature=0.0), vision=vision)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return [t for o in outs for t in o.token_ids], outs[-1]


def test_text_model_and_mismatched_prompts_are_prompt_errors(vis):
    eng = _engine(vis)
    ids, vision = eng.vision_prompt(MSG, [_enc("PNG")])
    with pytest.raises(PromptError, match="image tokens"):
        eng.submit(ids[:5] + ids[25:], SamplingParams(max_tokens=2), vision=vision)
    with pytest.raises(PromptError, match="image marker"):
        eng.vision_prompt(MSG, [_enc("PNG"), _enc("PNG")])
    path = ensure_fixture("gemma3", "float32")          # a tower stub: text-only
    model, _ = load_model(path)
    text = Engine(model, load_tokenizer(path))
    assert model.vision is None
    with pytest.raises(PromptError, match="no vision tower"):
        text.vision_prompt(MSG, [_enc("PNG")])
    with pytest.raises(PromptError, match="no vision tower"):
        text.submit(ids, SamplingParams(max_tokens=2), vision=vision)


def test_prompt_cache_keyed_by_the_image(vis, monkeypatch):
    eng = _engine(vis, prompt_cache=PromptCache(1 << 26))
    calls = []
    real = type(vis[1]).image_features
    monkeypatch.setattr(type(vis[1]), "image_features",
                        lambda self, *a: calls.append(1) or real(self, *a))
    a, b = _enc("PNG"), _enc("PNG", RNG.integers(0, 256, (20, 30, 3), dtype=np.uint8))
    ids_a, va = eng.vision_prompt(MSG, [a])
    ids_b, vb = eng.vision_prompt(MSG, [b])
    assert ids_a == ids_b and va.digest != vb.digest
    first, _ = _run(eng, ids_a, va)
    again, out = _run(eng, ids_a, va)
    assert again == first and out.cached_tokens == len(ids_a) - 1 and len(calls) == 1
    _, out_b = _run(eng, ids_b, vb)
    assert out_b.cached_tokens == 0 and len(calls) == 2
    # the cached run equals a fresh engine's
    fresh, _ = _run(_engine(vis), ids_a, va)
    assert fresh == first


def test_pytorch_conv_layout_is_transposed():
    w = mx.arange(16 * 3 * 4 * 4).reshape(16, 3, 4, 4)
    out = VisionTower.sanitize({"vision_model.embeddings.patch_embedding.weight": w})
    assert mx.array_equal(next(iter(out.values())), w.transpose(0, 2, 3, 1)).item()
    same = mx.zeros((16, 4, 4, 3))
    assert VisionTower.sanitize({"x.patch_embedding.weight": same})["x.patch_embedding.weight"] is same


def test_convert_keeps_the_tower_float(vis, tmp_path):
    path, model, _ = vis
    dst = convert(path, tmp_path / "q4", ConvertOptions(quantize=True, q_bits=4, q_group_size=32),
                  log=lambda *_: None)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["vision_config"]["num_hidden_layers"] == 2
    assert (dst / "preprocessor_config.json").is_file()
    q, _ = load_model(dst)
    assert q.vision is not None
    assert "scales" in dict(q.language_model.model.layers[0].self_attn.q_proj.parameters())
    assert "scales" not in dict(q.vision_tower.vision_model.encoder.layers[0].self_attn.q_proj.parameters())
    px = mx.random.uniform(-1, 1, (1, 3, 32, 32), key=mx.random.key(0))
    assert mx.array_equal(q.vision_tower(px.transpose(0, 2, 3, 1)),
                          model.vision_tower(px.transpose(0, 2, 3, 1))).item()


# a 16x16 HEIC (top half red, bottom half blue), made with pillow-heif 1.9
HEIC = base64.b64decode("AAAAHGZ0eXBoZWljAAAAAG1pZjFoZWljbWlhZgAAAXxtZXRhAAAAAAAAACFoZGxyAAAAAAAAAABwaWN0AAAAAAAAAAAAAAAAAAAAACJpbG9jAAAAAERAAAEAAQAAAAABoAABAAAAAAAAAFcAAAAjaWluZgAAAAAAAQAAABVpbmZlAgAAAAABAABodmMxAAAAAA5waXRtAAAAAAABAAAA/GlwcnAAAADcaXBjbwAAAHVodmNDAQNwAAAAkAAAAAAAHvAA/P34+AAADwNgAAEAGEABDAH//wNwAAADAJAAAAMAAAMAHroCQGEAAQApQgEBA3AAAAMAkAAAAwAAAwAeoCCBBZbqrprm4CGgwIAAAAyAAAADAIRiAAEABkQBwXPBiQAAABNjb2xybmNseAABAA0ABoAAAAAUaXNwZQAAAAAAAABAAAAAQAAAAChjbGFwAAAAEAAAAAEAAAAQAAAAAf///9AAAAAC////0AAAAAIAAAAQcGl4aQAAAAADCAgIAAAAGGlwbWEAAAAAAAAAAQABBYECAwWEAAAAX21kYXQAAABTKAGvBjIbMcaAjO3LxfUmf//cX+y9QVtqXrR3I+fv//6BI47/pi5sSFRyelZP71jzUq4e7O3YhCbf40uegGXY8QCA/vfdYYlxNBMISSM0tQi9UmA=")


def test_heic_with_pillow_heif_else_a_clear_error():
    """HEIC decodes where pillow-heif is installed; elsewhere it is an ImageError naming the
    formats this process takes (never a crash)."""
    import importlib.util
    if importlib.util.find_spec("pillow_heif") is None:
        with pytest.raises(ImageError, match="not an image of a supported format"):
            decode_image(HEIC)
        assert "HEIF" not in formats()
        return
    assert "HEIF" in formats()
    img = np.array(decode_image(HEIC))
    assert img.shape == (16, 16, 3) and img[2, 2, 0] > 150 > img[2, 2, 2]
    assert img[13, 2, 2] > 150 > img[13, 2, 0]


def test_avif_where_pillow_reads_it():
    from PIL import features
    data = _enc("AVIF", quality=100) if features.check("avif") else None
    if data is None:          # a Pillow without libavif and no plugin: a clear error
        assert "AVIF" not in formats()
        return
    img = decode_image(data)
    assert img.size == (30, 20) and img.mode == "RGB" and "AVIF" in formats()


def test_engine_generate_image_flag(vis, tmp_path, capsys):
    """`engine-generate --image`: the completion equals the engine's request; a text-only
    model, a missing file and a file that is not an image are one-line errors (exit 2)."""
    from engine.cli import main

    path = vis[0]
    png = tmp_path / "a.png"
    png.write_bytes(_enc("PNG"))
    assert main(["--model", str(path), "--image", str(png), "--prompt", "What?",
                 "--max-tokens", "4", "--verbose", "false"]) == 0
    got = capsys.readouterr().out.rstrip("\n")
    eng = _engine(vis)
    ids, vision = eng.vision_prompt([{"role": "user", "content": [
        {"type": "text", "text": "What?"}, {"type": "image"}]}], [png.read_bytes()])
    toks, _ = _run(eng, ids, vision)
    assert got == vis[2].decode(toks)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    for argv, needle in [(["--model", str(path), "--image", str(bad)], "not an image"),
                         (["--model", str(path), "--image", str(tmp_path / "no.png")],
                          "No such file"),
                         (["--model", str(ensure_fixture("gemma3", "float32")), "--image",
                           str(png)], "no vision tower")]:
        assert main(argv + ["--max-tokens", "2"]) == 2
        assert needle in capsys.readouterr().err

