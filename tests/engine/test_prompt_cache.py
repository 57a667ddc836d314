"""The prompt cache's index, byte accounting and over-cap prefixes (no model needed
except where named): lookups agree with a linear scan, cost the same at 10 and 2,000
entries, never copy under the lock; an entry's cost covers what it really holds."""

import copy
import gc
import random

import mlx.core as mx
import pytest

import engine.kv.prompt_cache as pcm
from engine.kv.cache import KVCache, QuantizedKVCache, RotatingKVCache
from engine.kv.prompt_cache import BLOCK, PromptCache, cache_arrays, entry_bytes


def kv(n: int, tag: float = 0.0, layers: int = 1, dim: int = 2):
    """Caches holding n tokens; every value = tag (to tell entries apart)."""
    out = []
    for _ in range(layers):
        c = KVCache()
        c.keys = mx.full((1, 1, n, dim), tag)
        c.values = mx.full((1, 1, n, dim), tag)
        c.offset = n
        out.append(c)
    return out


def ring(n: int, tag: float):
    """A wrapped sliding-window ring (cannot be trimmed) that has seen n tokens."""
    c = RotatingKVCache(max_size=2)
    c.keys = mx.full((1, 1, 2, 2), tag)
    c.values = mx.full((1, 1, 2, 2), tag)
    c.offset, c._idx = n, 2
    assert not c.is_trimmable()
    return [c]


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Linear:
    """The reference: every entry scanned (the cache's rules, no index)."""

    def __init__(self):
        self.entries = []       # (ns, tokens, trimmable, tag)

    def store(self, ns, t, trimmable, tag):
        self.entries = [e for e in self.entries if not (
            e[0] == ns and (trimmable or len(e[1]) == len(t)) and len(e[1]) <= len(t)
            and t[:len(e[1])] == e[1])]
        self.entries.append((ns, t, trimmable, tag))

    def best(self, ns, prompt):
        best = 0
        for e_ns, t, trimmable, _ in self.entries:
            if e_ns != ns:
                continue
            n = min(common(t, prompt), len(prompt) - 1)
            if n < len(t) and not trimmable:
                continue
            best = max(best, n)
        return best

    def clear(self, ns):
        self.entries = [e for e in self.entries if e[0] != ns]


@pytest.mark.parametrize("seed", range(6))
def test_index_finds_what_a_linear_scan_finds(seed):
    rnd = random.Random(seed)
    pc, ref, tags = PromptCache(1 << 40), Linear(), {}
    base = [rnd.randrange(4) for _ in range(40)]

    def seq():   # sequences that share prefixes often and part at any point
        n = rnd.randrange(1, 40)
        cut = rnd.randrange(0, n + 1)
        return tuple(base[:cut] + [rnd.randrange(4) for _ in range(n - cut)])

    for step in range(400):
        ns = rnd.choice(["base", "adapter:a"])
        op = rnd.random()
        if op < 0.45:
            t = seq()
            trimmable = len(t) < 2 or rnd.random() < 0.8
            tag = float(step + 1)
            tags[tag] = t
            pc.store(ns, list(t), kv(len(t), tag) if trimmable else ring(len(t), tag))
            ref.store(ns, t, trimmable, tag)
        elif op < 0.97:
            p = seq()
            want = ref.best(ns, p) if len(p) >= 2 else 0
            hit = pc.fetch(ns, list(p))
            assert (hit.reused if hit else 0) == want, (step, p)
            if hit:
                t = tags[hit.caches[0].keys[0, 0, 0, 0].item()]
                assert t[:want] == p[:want]                 # the entry does share it
                assert hit.caches[0].offset == want or (     # trimmed to it, or a ring
                    len(t) == want and not hit.caches[0].is_trimmable())
        else:
            pc.clear(ns)
            ref.clear(ns)
        assert len(pc) == len(ref.entries)


def test_store_rules_and_stats():
    pc = PromptCache(1 << 30)
    pc.store("base", [1, 2, 3], kv(3, 1.0))
    pc.store("base", [1, 2, 3, 4, 5], kv(5, 2.0))       # the shorter one is redundant now
    assert len(pc) == 1
    pc.store("base", [1, 2, 3, 4, 5, 6, 7], ring(7, 3.0))   # a wrapped ring keeps it
    assert len(pc) == 2
    hit = pc.fetch("base", [1, 2, 3, 4, 9, 9])
    assert hit.reused == 4 and hit.caches[0].keys[0, 0, 0, 0].item() == 2.0
    assert pc.fetch("base", [1, 2, 3, 4, 5, 6, 7, 8]).reused == 7      # whole ring
    assert pc.fetch("adapter:x", [1, 2, 3, 4]) is None                  # namespaces
    assert pc.fetch("base", [1]) is None                                # nothing to recompute
    s = pc.stats()
    assert (s["hits"], s["misses"], s["tokens_reused"]) == (2, 2, 11)
    assert s["bytes"] == sum(entry_bytes(c, n) for c, n in ((kv(5), 5), (ring(7, 0.0), 7)))
    pc.clear("base")
    assert len(pc) == 0 and pc.bytes == 0


def test_copy_on_hit_is_private():
    pc = PromptCache(1 << 30)
    pc.store("base", [1, 2, 3, 4], kv(4, 1.0))
    a = pc.fetch("base", [1, 2, 3, 4, 5]).caches[0]
    a.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    a.keys[..., 0, :] = 7.0
    b = pc.fetch("base", [1, 2, 3, 4, 5]).caches[0]
    assert b.offset == 4 and b.keys[0, 0, 0, 0].item() == 1.0


def test_lru_eviction_by_bytes():
    one = entry_bytes(kv(8), 8)
    pc = PromptCache(int(one * 2.5))
    for i in range(3):
        pc.store("base", [i] * 8, kv(8, float(i)))
    assert len(pc) == 2 and pc.evictions == 1 and pc.bytes <= pc.max_bytes
    assert pc.fetch("base", [0] * 9) is None           # the oldest went
    pc.fetch("base", [1] * 9)                            # 1 is now the most recent
    pc.store("base", [3] * 8, kv(8, 3.0))
    assert pc.fetch("base", [2] * 9) is None and pc.fetch("base", [1] * 9).reused == 8


def _filled(n_entries: int, prefix: int = 512):
    """n entries sharing a prefix, each with its own suffix (distinct first tokens)."""
    pc = PromptCache(1 << 40)
    head = list(range(10_000, 10_000 + prefix))
    small = kv(1)
    for i in range(n_entries):
        pc.store("base", head + [i, 1, 2, 3], small, copy_caches=False)
    return pc, head


@pytest.mark.parametrize("probe", ["new suffix", "branch in a suffix", "whole entry + more"])
def test_lookup_cost_does_not_grow_with_entries(probe):
    """The index walk's step count (a deterministic cost proxy for the lookup) at 2,000
    entries is within 10% of 10 entries'; the 0.2.10 linear scan compared the prompt
    with every entry (2,000x)."""
    costs = []
    for n in (10, 2000):
        pc, head = _filled(n)
        prompt = head + {"new suffix": [99_999, 5],
                         "branch in a suffix": [7, 1, 9, 9],
                         "whole entry + more": [7, 1, 2, 3, 4, 5]}[probe]
        before = pc.ops
        hit = pc.fetch("base", prompt)
        costs.append(pc.ops - before)
        assert hit.reused == {"new suffix": 512, "branch in a suffix": 514,
                              "whole entry + more": 516}[probe]
    assert 0 < costs[1] <= 1.1 * costs[0], costs


def test_caches_are_copied_outside_the_lock(monkeypatch):
    pc = PromptCache(1 << 30)
    held = []
    real = copy.deepcopy
    monkeypatch.setattr(pcm.copy, "deepcopy", lambda x: (held.append(pc.lock.locked()), real(x))[1])
    pc.store("base", [1, 2, 3], kv(3))
    assert pc.fetch("base", [1, 2, 3, 4]).reused == 3
    assert held == [False, False]          # the store's copy and the hit's copy


def test_over_cap_prefix_is_kept_block_by_block():
    layers, n = 2, 3 * BLOCK + 100
    caches = kv(n, 1.0, layers=layers, dim=8)
    full = entry_bytes(caches, n)
    pc = PromptCache(int(full * 0.8))                  # holds 2 of the 3 whole blocks
    tokens = list(range(n))
    pc.store("base", tokens, caches, copy_caches=False)
    assert len(pc) == 1 and pc.bytes <= pc.max_bytes
    hit = pc.fetch("base", tokens + [1])
    assert hit.reused == 2 * BLOCK
    assert all(c.keys.shape[2] == 2 * BLOCK == c.offset for c in hit.caches)  # cut, not hidden
    # the next turn (everything so far + more) hits the kept part and replaces it
    pc.store("base", tokens + [5] * 50, kv(n + 50, 2.0, layers=layers, dim=8))
    assert len(pc) == 1 and pc.fetch("base", tokens + [6]).reused == 2 * BLOCK
    # a wrapped ring cannot be cut: an over-cap one is not kept
    pc2 = PromptCache(entry_bytes(ring(9, 0.0), 9) - 1)
    pc2.store("base", list(range(9)), ring(9, 0.0))
    assert len(pc2) == 0


def test_quantized_entry_counts_scales_and_biases():
    c = KVCache()
    c.keys = mx.random.normal((1, 2, 256, 64))
    c.values = mx.random.normal((1, 2, 256, 64))
    c.offset = 256
    q = c.to_quantized(group_size=64, bits=4)
    arrays = cache_arrays([q])
    assert len(arrays) == 6                             # packed, scales, biases for K and V
    assert entry_bytes([q], 256) > sum(a.nbytes for a in (q.keys[0], q.values[0]))
    assert isinstance(q, QuantizedKVCache)


def test_bytes_match_active_memory():
    """MLX memory an entry holds once its source caches are gone, against what the cap
    counts: the arrays' part must agree (the cut copies are tight, the kept buffers are
    counted at their capacity); the rest of an entry's cost is Python objects."""
    gc.collect()
    mx.synchronize()
    pc = PromptCache(1 << 40)
    before = mx.get_active_memory()
    for i in range(20):
        big = kv(700, float(i), layers=2, dim=64)
        pc.store("base", [i] * 700, big[:1] if i % 2 else big)
        del big
    gc.collect()
    mx.synchronize()
    held = mx.get_active_memory() - before
    arrays = pc.array_bytes
    assert 0.95 <= held / arrays <= 1.05, (held, arrays)
    assert pc.bytes >= held


@pytest.fixture(scope="module")
def qwen():
    import engine
    from parity.fixtures.models import ensure_fixture
    return engine.load(ensure_fixture("qwen3"))


def _run(eng, prompts, max_tokens):
    from engine import SamplingParams
    for i, p in enumerate(prompts):
        eng.submit(p, SamplingParams(max_tokens=max_tokens + i % 7, temperature=0.0))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    return outs


@pytest.mark.parametrize("batch", [1, 4])
def test_engine_entries_hold_what_they_count(qwen, batch):
    """Both lanes' entries, measured by MLX's active memory once the requests are over:
    within 1.25x of the arrays counted (the allocator rounds small buffers up: these
    rows are ~15 KB). A batch row's KV is cut out of the batch's buffers lazily; kept
    unevaluated, each entry pinned whole batch buffers (8x what was counted)."""
    from engine import Engine
    model, tok = qwen
    pc = PromptCache(1 << 34)
    eng = Engine(model, tok, max_batch=batch, prompt_cache=pc)
    prompts = [[5 + i, 7 + i] + list(range(100 + 13 * i, 140 + 30 * i)) for i in range(24)]
    _run(eng, prompts[:2], 4)
    pc.clear()
    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()
    _run(eng, prompts, 20)
    gc.collect()
    mx.synchronize()
    held = mx.get_active_memory() - before
    assert len(pc) == 24 and pc.hits == 0
    assert 0.95 <= held / pc.array_bytes <= 1.25, (held, pc.array_bytes)
    assert held <= pc.bytes * 1.25
    pc.clear()
    gc.collect()
    mx.synchronize()
    assert mx.get_active_memory() - before <= 0


def test_agent_turns_hit_a_prefix_larger_than_the_cap(qwen):
    """Each turn = the previous prompt + its answer + a new message; the prefix's KV is
    larger than the cap, so the kept part is its longest whole-block prefix that fits:
    every turn after the first reuses it (0.2.10 kept nothing: every turn a miss)."""
    from engine import Engine
    model, tok = qwen
    rnd = random.Random(0)
    prompt = [rnd.randrange(10, 1000) for _ in range(3 * BLOCK + 40)]
    probe = PromptCache(1 << 34)
    _run(Engine(model, tok, prompt_cache=probe), [prompt], 8)
    pc = PromptCache(int(probe.bytes * 0.8))
    eng = Engine(model, tok, prompt_cache=pc)
    reused = []
    for turn in range(4):
        (out,) = _run(eng, [prompt], 8).values()
        reused.append(out.cached_tokens)
        prompt = prompt + list(out.token_ids) + [rnd.randrange(10, 1000) for _ in range(20)]
    assert reused[0] == 0 and all(r >= 2 * BLOCK and r % BLOCK == 0 for r in reused[1:]), reused
    assert pc.bytes <= pc.max_bytes and pc.hits == 3


@pytest.mark.parametrize("kind", ["kv", "ring", "kv-q8", "ring-q4"])
def test_head_continues_like_a_trimmed_cache(kind):
    """`head(n)` (what an over-cap entry is cut to) holds exactly n slots and then behaves
    as the same cache trimmed back to n: the same K/V reach attention at every later step,
    through prefill chunks and single-token steps (a ring up to and past its wrap)."""
    from engine.kv.cache import quantize_layer_cache

    def make():
        return RotatingKVCache(max_size=320) if kind.startswith("ring") else KVCache()

    def flat(t):   # K, V, or (packed, scales, biases) of each
        return [t] if isinstance(t, mx.array) else [a for x in t for a in flat(x)]

    def fill(c, n, seed):
        for i, s in enumerate(range(0, n, 100)):
            k = mx.random.normal((1, 2, min(100, n - s), 64), key=mx.random.key(seed + i))
            c.update_and_fetch(k, k * 2)
        return c

    a = fill(make(), 300, 0)
    if "-q" in kind:
        bits = int(kind[-1])
        a = quantize_layer_cache(a, bits, 64)
    b = copy.deepcopy(a)
    b.trim(300 - BLOCK)
    h = a.head(BLOCK)
    arrays = cache_arrays([h])
    assert h.offset == BLOCK and all(x.shape[2] == BLOCK for x in arrays)
    for step, n in enumerate([40, 1, 1, 30, 1] + [1] * 40):
        k = mx.random.normal((1, 2, n, 64), key=mx.random.key(100 + step))
        got, want = flat(h.update_and_fetch(k, -k)), flat(b.update_and_fetch(k, -k))
        assert len(got) == len(want) and h.offset == b.offset
        assert all(mx.array_equal(x, y) for x, y in zip(got, want)), (kind, step)


def test_engine_load_sizes_the_cache_from_the_budget():
    from engine import Engine
    from engine.step.admission import PROMPT_CACHE_FRACTION
    from parity.fixtures.models import ensure_fixture
    path = ensure_fixture("qwen3")
    eng = Engine.load(path, memory_budget_bytes=3_000_000_000, prompt_cache_bytes=None)
    adm = eng.admission
    share = int((adm.budget_bytes - adm.weights) * PROMPT_CACHE_FRACTION)
    assert eng.prompt_cache.max_bytes == share
    assert eng.adapters.prompt_cache is eng.prompt_cache      # unmounts clear its namespaces
    assert Engine.load(path).prompt_cache is None              # the library default: none
    assert Engine.load(path, prompt_cache_bytes=1 << 20).prompt_cache.max_bytes == 1 << 20
