"""The one-kernel decode step (engine.fast.mega): what can be checked without a GPU.

The kernel itself runs on NVIDIA GPUs only (checked there by experiments/mega_check.py and
the L3 gate); here: when it is used and why not, its inputs and workspace layout, how a
batch is split into calls, the phase timer's arithmetic, and the buffers it writes in
place being made contiguous arrays of their own first.
"""

from dataclasses import replace

import mlx.core as mx
import pytest

from engine.fast import kernels as K
from engine.fast import mega as MG
from engine.fast import mega_cuda as C
from engine.fast.config import FastConfig
from engine.fast.decode import FastDecoder, FastStep, own_contiguous
from engine.fast.merge import merge_projections
from engine.levers import resolve
from engine.loader import load_model
from parity.fixtures.models import ensure_fixture


def test_shared_memory_holds_the_phase_inputs():
    """The kernel's dynamic shared memory is the phase inputs of its rows (the largest of them)."""
    one = C.input_bytes(4096, 32, 128, 14336, 2)
    assert one == 28672
    assert C.shared_bytes(4096, 32, 128, 14336, 2) == one
    assert C.shared_bytes(4096, 32, 128, 14336, 2, rows=2) == 2 * one
    assert C.rows_per_call(4096, 32, 128, 14336, 2) == 7


def test_rows_per_call_fits_shared_memory():
    # 1b (hidden 2048, MLP 8192, 32 x 64 heads): 16 KB a row (the bf16 MLP input) -> 8
    assert C.rows_per_call(2048, 32, 64, 8192, 2) == 8
    # 8b (4096, 14336, 32 x 128): 28 KB a row -> 7 in 200 KB
    assert C.rows_per_call(4096, 32, 128, 14336, 2) == 7
    assert C.rows_per_call(64, 4, 16, 128, 4) == C.MAX_ROWS
    assert C.rows_per_call(65536, 32, 128, 200000, 4) == 0


def test_inputs_tables_and_workspace_layout():
    names = C.input_names(3)
    assert names[:9] == ["tok", "rpos", "col", "start_col", "crow", "emb", "inv_freq", "fnorm", "headw"]
    assert names[-1] == "after" and names[-7:-1] == ["k_0", "k_1", "k_2", "v_0", "v_1", "v_2"]
    assert len(names) == 9 + 6 * 3 + 6 + 1
    p3 = C.MegaParams(H=64, NQ=4, NKV=2, D=16, I=128, L=3, V=100, EPS_NUM=10**7, SCALE_NUM=25 * 10**7)
    src = C.config_header(p3)
    assert "const void* WQKV[3] = {wqkv_0, wqkv_1, wqkv_2};" in src and "const T* WQKV_S[3] = {};" in src
    assert "T* KC[3] = {const_cast<T*>(k_0), const_cast<T*>(k_1), const_cast<T*>(k_2)};" in src
    # the workspace grows with the rows of a call, and ends with the phase stamps
    one = C.workspace_floats(2048, 32, 64, 8192, 16, 1)
    eight = C.workspace_floats(2048, 32, 64, 8192, 16, 8)
    per_row = 2048 + 2 * 32 * 64 + 8192 + 16 * 32 + 32 * C.MAXCH * 68 + 32 * 64
    assert eight - one == 7 * per_row
    assert C.n_stamps(16) == 2 + 5 * 16
    # q/k norms: per layer their two weights after the projections, before the caches
    qk = C.input_names(3, qk_norm=True)
    assert qk[9 + 6 * 3: 9 + 6 * 3 + 6] == ["qn_0", "kn_0", "qn_1", "kn_1", "qn_2", "kn_2"]
    assert qk[-7:] == names[-7:] and len(qk) == len(names) + 6
    assert "const T* QN[3] = {qn_0, qn_1, qn_2};" in C.config_header(replace(p3, QKN=1))
    assert "const T* QN[3] = {};" in src
    # the generated header: the model's constants, and a kernel name of its own
    assert "constexpr int H = 64;" in src and "constexpr int L = 3;" in src and "#define MEGA_TABLES" in src
    assert C.build_name(p3, 1, 0) != C.build_name(replace(p3, H=128), 1, 0)
    assert C.build_name(p3, 1, 0) != C.build_name(replace(p3, PROF=1), 1, 0)


def test_qwen3_q_k_norms_in_the_kernel_by_default(monkeypatch):
    """qwen3's per-head q/k norms run inside the kernel unless MLXP_MEGA_QKNORM=0 (FastConfig's
    qk_norm off); its norm weights then follow the layers' inputs."""
    q3 = load_model(str(ensure_fixture("qwen3", "bfloat16")))[0]
    merge_projections(q3)
    monkeypatch.setattr(K, "cuda_available", lambda: True)
    monkeypatch.setattr(MG, "sm_count", lambda: 132)
    levers = resolve("l3", env={})
    assert "MLXP_MEGA_QKNORM=0" in MG.why_not(q3, resolve("l3", env={"MLXP_MEGA_QKNORM": "0"}))
    # past the q/k norm check: the tiny fixture's widths are what stops it now
    assert "vector loads" in MG.why_not(q3, levers)
    a0 = q3.layers[0].self_attn
    step = MG.MegaStep(q3, mx.ones((a0.head_dim // 2,)))
    assert step.qkn and len(step.layers) == 8 * step.L
    assert step.layers[6 * step.L] is a0.q_norm.weight and step.layers[6 * step.L + 1] is a0.k_norm.weight
    names = C.input_names(step.L, qk_norm=True)
    assert len(names) - 1 == 5 + len(step.shared) + len(step.layers) + 2 * step.L


@pytest.fixture(scope="module")
def llama():
    return load_model(str(ensure_fixture("llama", "bfloat16")))[0]


def test_why_not_on_this_machine(llama):
    merge_projections(llama)
    assert "off" in MG.why_not(llama, resolve("l1", env={}))
    if mx.default_device() != mx.gpu:
        assert MG.why_not(llama, resolve("l3", env={})) == "no CUDA device"


def test_groups_and_profile_arithmetic(llama):
    merge_projections(llama)
    a0 = llama.layers[0].self_attn
    step = MG.MegaStep(llama, mx.ones((a0.head_dim // 2,)))
    step.max_rows = 3
    assert step.groups(8) == [(0, 3), (3, 3), (6, 2)]
    assert step.groups(2) == [(0, 2)]
    # stamps 0, 10, 20, ... ns (as the kernel writes them: low word, high word)
    n = C.n_stamps(step.L)
    lo = [i * 1000 for i in range(n)]
    ws = mx.zeros((100 + 2 * n,), mx.float32)
    raw = mx.view(ws, mx.uint32)
    stamps = mx.array([w for t in lo for w in (t, 0)], dtype=mx.uint32)
    ws = mx.view(mx.concatenate([raw[:100], stamps]), mx.float32)
    prof = step.profile(ws)
    assert prof["total"] == (n - 1) * 1.0                # µs
    assert prof["qkv_rope"] == step.L * 1.0 and prof["head"] == 1.0
    assert "arrive" not in prof
    # with the blocks' arrival stamps after them: block b reaches stamp i at t[i-1] + 100 * (b + 1) ns
    step.blocks = 3
    arr = [w for i in range(n) for b in range(3) for w in ((lo[i - 1] if i else 0) + 100 * (b + 1), 0)]
    ws = mx.view(mx.concatenate([raw[:100], stamps, mx.array(arr, dtype=mx.uint32)]), mx.float32)
    prof = step.profile(ws)
    assert prof["total"] == (n - 1) * 1.0 and prof["head"] == 1.0
    assert prof["arrive"]["head"] == {"min": 0.1, "median": 0.2, "max": 0.3}
    assert prof["arrive"]["down"] == {"min": round(0.1 * step.L, 2), "median": round(0.2 * step.L, 2),
                                      "max": round(0.3 * step.L, 2)}
    per = step.block_arrivals(ws)
    assert set(per) == {"qkv_rope", "attention", "o_proj", "gate_up", "down", "head"}
    assert len(per["down"]) == step.L and len(per["head"]) == 1
    assert all(row == [0.1, 0.2, 0.3] for rows in per.values() for row in rows)
    assert C.workspace_floats(64, 4, 16, 128, step.L, 1, 3) - C.workspace_floats(64, 4, 16, 128, step.L) == 6 * n


def test_own_contiguous_replaces_foreign_buffers_only():
    """A flat list of buffers (every layer's keys, then values): each one not identical to
    the one at its place in `own` becomes an array of its own, the others are kept."""
    big = mx.arange(2 * 3 * 8 * 4, dtype=mx.float32).reshape(2, 3, 8, 4)
    arrays = [big[..., 2:, :], mx.zeros((2, 3, 6, 4)), big[..., 2:, :] + 1, mx.ones((2, 3, 6, 4))]
    own = own_contiguous(arrays, [])
    assert len(own) == len(arrays)
    assert all(a is not b for a, b in zip(own, arrays))          # nothing was its own yet
    assert all(mx.array_equal(a, b) for a, b in zip(own, arrays))  # same values
    # unchanged buffers keep their arrays; a replaced one is taken in again
    again = own_contiguous(list(own), own)
    assert all(a is b for a, b in zip(again, own))
    changed = list(again)
    changed[3] = mx.full((2, 3, 6, 4), 2.0)
    third = own_contiguous(changed, again)
    assert third[3] is not changed[3] and third[3] is not again[3]
    assert mx.array_equal(third[3], changed[3])
    assert all(third[j] is again[j] for j in (0, 1, 2))
    # a longer list than `own` (more layers or a first step): the extra ones are taken in
    more = own_contiguous(list(again) + [big], again)
    assert all(more[j] is again[j] for j in range(4)) and more[4] is not big
    assert mx.array_equal(more[4], big)


def test_decoder_reports_why_the_kernel_is_not_used(llama):
    dec = FastDecoder(FastStep(llama, resolve("l3", env={})))
    caches = llama.make_cache()
    mx.eval(llama(mx.array([[1, 2, 3]]), cache=caches))
    dec(mx.array([3]), caches)
    assert dec.stats is dec.step.stats and dec.stats.steps == 1
    assert dec.stats.mega is False and dec.stats.mega_reason
    assert dec.mega_profile() == {}


def test_quantized_weights_4bit_and_8bit(monkeypatch):
    """Affine 4-bit and 8-bit weights take the kernel's quantized dot product (8-bit by default
    since it passed the trained gate, faster than the separate kernels on an H100; which 4-bit
    rows take it is engine.fast.decode.one_kernel_rows'). Their inputs carry each matrix's
    group scales and biases."""
    q4 = load_model(str(ensure_fixture("llama", "q4")))[0]
    merge_projections(q4)
    q8 = load_model(str(ensure_fixture("llama", "q8")))[0]
    merge_projections(q8)
    assert MG.quantization(q8)[0] == 8
    assert MG.MegaStep(q8, mx.ones((q8.layers[0].self_attn.head_dim // 2,))).params.QB == 8
    bits, gs = MG.quantization(q4)
    assert bits == 4 and gs == q4.layers[0].mlp.down_proj.group_size
    a0 = q4.layers[0].self_attn
    step = MG.MegaStep(q4, mx.ones((a0.head_dim // 2,)))
    names = C.input_names(step.L, quantized=True)
    assert len(names) - 1 == 5 + len(step.shared) + len(step.layers) + 2 * step.L
    assert step.dtype == q4.layers[0].mlp.down_proj.scales.dtype
    hdr = C.config_header(step.params)
    assert step.params.QB == 4 and "const T* WQKV_S[" in hdr and f"_S[{step.L}] = {{}}" not in hdr
    # a float model is never taken as quantized
    assert MG.quantization(load_model(str(ensure_fixture("llama", "bfloat16")))[0]) is None


def test_no_run_time_switches_in_the_kernel():
    """The one-kernel step takes no switch input: its choices are compiled in (the sources name
    no MEGA_OPT bit), FLOW a template argument of the build; FastConfig has no `opt`."""
    assert "opt" not in C.input_names(2) and "opt" not in C.input_names(2, quantized=True, qk_norm=True)
    src = C.header() + C.body()
    assert "MEGA_OPT" not in src and "opt[0]" not in src
    assert "constexpr bool flow = FLOW != 0 && QKN == 0;" in src
    assert "opt" not in FastConfig().as_dict() and not hasattr(FastConfig(), "mask")


def test_in_place_flag_belongs_to_each_trace(llama, monkeypatch):
    """The fast step keeps one trace per (rows, capacity); whether a trace writes the
    buffers in place (the one-kernel step) is its own, not the last-built trace's: a shape
    that returns after another was built must still get its buffers made contiguous first.
    One step serves the batch rows and a request decoding alone (one row)."""
    monkeypatch.setattr(MG, "why_not", lambda model, levers: None)
    monkeypatch.setattr(MG, "rows_per_call", lambda model: 2)
    step = FastStep(llama, resolve("l3", env={}))
    step._mega_freq = mx.ones((llama.layers[0].self_attn.head_dim // 2,))   # (as on a GPU)
    assert step._fn(2, 512)[1] is True and step.stats.mega is True
    assert step._fn(4, 512)[1] is False and step.stats.mega is False
    assert "more rows than one kernel call takes (2)" in step.stats.mega_reason
    assert step._fn(2, 512)[1] is True                   # (reused: still the in-place step)
    assert step._fn(1, 512)[1] is True and step._fn(1, 1024)[1] is True
    assert step._fn(4, 1024)[1] is False and step._fn(1, 512)[1] is True
    # (least recently used first: a reused shape moves to the end)
    assert [k[:2] for k in step.trace_keys] == [(4, 512), (2, 512), (1, 1024), (4, 1024), (1, 512)]
    assert step.stats.traces_kept == 5


def test_settings_checked_where_the_levers_are_resolved():
    """A bad MLXP_MEGA_* value is a clear error when a CLI resolves its levers (perf_kernel
    on), not an exception at the first decode step; with perf_kernel off it is not read."""
    import argparse

    from engine.levers import LeverError, levers_from_args
    ok = {"MLXP_MEGA_QKNORM": "0", "MLXP_MEGA_PROF": "1", "MLXP_DISABLE_KERNELS": "gemv,mega"}
    assert levers_from_args(argparse.Namespace(tier="l3"), env=ok).fast == FastConfig(
        qk_norm=False, prof=True, disabled=frozenset({"gemv", "mega"}))
    bad = {"MLXP_MEGA_QKNORM": "2", "MLXP_MEGA_PROF": "on",
           "MLXP_DISABLE_KERNELS": "qgemv"}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            FastConfig.from_env({name: value})
        with pytest.raises(LeverError, match=name):
            levers_from_args(argparse.Namespace(tier="l3"), env={name: value})
        assert not levers_from_args(argparse.Namespace(tier="l1"), env={name: value}).perf_kernel


def test_flow_on_the_solo_step_only(llama, monkeypatch):
    """FLOW (attention started per head on flags) is compiled into the one-row step's kernel
    only: every call of a step of several rows, a last group of one row included, is built with
    FLOW 0; each call passes the kernel exactly its declared inputs."""
    merge_projections(llama)
    a0 = llama.layers[0].self_attn
    step = MG.MegaStep(llama, mx.ones((a0.head_dim // 2,)), resolve("l3", env={}).fast)
    step.max_rows = 4                    # (so that 5 rows are two calls, the second of one row)
    n_inputs = len(C.input_names(step.L, bool(step.quant), step.qkn))
    seen = []

    def kernel(rows):
        def call(inputs, template, **kw):
            t = dict(template)
            seen.append((t["RB"], t["ROW0"], t["FLOW"], len(inputs)))
            return mx.zeros((rows, step.V)), mx.zeros((1,))
        return call
    monkeypatch.setattr(step, "_kernel", kernel)
    kv = [mx.zeros((1,))] * step.L
    for B in (1, 2, 5):
        z = mx.zeros((B,), dtype=mx.int32)
        step(z, z, z, z, z, kv, kv)
    assert [s[:3] for s in seen] == [(1, 0, 1), (2, 0, 0), (4, 0, 0), (1, 4, 0)]
    assert all(s[3] == n_inputs for s in seen)
    assert (MG.flow(1), MG.flow(2), MG.flow(8)) == (1, 0, 0)


def test_token_ids_reach_the_step_as_int32_without_a_copy():
    """The sampler's uint32 ids are reinterpreted (mx.view), int32 ids passed as they are,
    other integer dtypes converted; the values never change."""
    from engine.fast.decode import as_int32
    u = mx.array([0, 7, 2**31 - 1], dtype=mx.uint32)
    for a in (u, u.astype(mx.int32), u.astype(mx.int64)):
        b = as_int32(a)
        assert b.dtype == mx.int32 and b.tolist() == [0, 7, 2**31 - 1]
    i = mx.array([4], dtype=mx.int32)
    assert as_int32(i) is i
