"""fluxpy's float32 flash attention (``fluxpy.kernels.cuda_flash``), which ``dot_product_attention(...,
need_scores=False)`` runs on float32 CuPy arrays: the output and the gradients of q, k and v against the composite in
float64 on the same inputs, over sizes that are not multiples of the 64-row tiles, Lq != Lk, head sizes from 1 to 128
(dv != dqk), causal, boolean masks (a query with no key gives NaN where the composite does), an additive bias
broadcasting; inputs read in place from a packed projection; any layout of the output's cotangent; deterministic;
captured in a CUDA graph equal to eager; declined problems run the composite and say why.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy.kernels import cuda_flash
from fluxpy.ops.attention import dot_product_attention, fused_reason

pytestmark = pytest.mark.gpu

# max |flash - float64 composite| / max |float64 composite|, for the output and each gradient: float32 rounding
# (its epsilon 1.2e-7) grown by sums over up to a few hundred keys and 128 features.
TOLERANCE = 3e-5
NAMES = ("y", "dq", "dk", "dv")


def _cp():
    import cupy
    return cupy


def _draw(rng, n, lq, lk, heads, dqk, dv, scale=1.0):
    """q, k, v and the output's cotangent w, float32 CuPy arrays."""
    cp = _cp()
    shapes = [(n, lq, heads * dqk), (n, lk, heads * dqk), (n, lk, heads * dv), (n, lq, heads * dv)]
    return [cp.asarray((scale * rng.standard_normal(s)).astype(np.float32)) for s in shapes]


def _run(q, k, v, w, heads, need_scores, **kw):
    """``([y, dq, dk, dv] as float64 NumPy arrays, fused_reason() after the forward)`` for the loss ``sum(y * w)``;
    ``need_scores=True`` runs the composite."""
    def attend(q, k, v):
        return dot_product_attention(q, k, v, nheads=heads, need_scores=need_scores, **kw)[0]

    y, back = fluxpy.pullback(attend, q, k, v)
    reason = fused_reason()
    grads = back(w)
    return [_cp().asnumpy(a).astype(np.float64) for a in (y, *grads)], reason


def _reference(q, k, v, w, heads, **kw):
    """The composite in float64 on the same numbers (a bias widened too; a mask as it is)."""
    wide = {key: (val.astype(np.float64) if key == "bias" else val) for key, val in kw.items()}
    return _run(*(a.astype(np.float64) for a in (q, k, v, w)), heads, True, **wide)[0]


def _flash(q, k, v, w, heads, **kw):
    """The flash path's results, checked to have run the kernels forward and backward."""
    before = cuda_flash.stats()
    got, reason = _run(q, k, v, w, heads, False, **kw)
    after = cuda_flash.stats()
    assert reason == "", f"the float32 flash kernels did not run: {reason}"
    assert after["forward"] == before["forward"] + 1 and after["backward"] == before["backward"] + 1, (before, after)
    return got


def _compare(got, want, what):
    """NaN exactly where the composite has NaN, elsewhere within TOLERANCE of the composite's largest magnitude."""
    for name, g, r in zip(NAMES, got, want):
        assert g.shape == r.shape, f"{what}: {name} of shape {g.shape}, the composite's {r.shape}"
        nan_g, nan_r = np.isnan(g), np.isnan(r)
        differ = np.argwhere(nan_g != nan_r)
        assert not len(differ), (f"{what}: {name} is NaN at {nan_g.sum()} places, the composite's at {nan_r.sum()}; "
                                 f"they differ first at {differ[:4].tolist()}")
        ok = ~nan_r
        if not ok.any():
            continue
        error = np.abs(g - r)
        error[~ok] = 0
        scale = max(float(np.abs(r[ok]).max()), 1e-30)
        worst = np.unravel_index(np.argmax(error), error.shape)
        assert error.max() / scale < TOLERANCE, (
            f"{what}: {name} relative error {error.max() / scale:.2e} > {TOLERANCE:.0e}, largest at {worst} "
            f"(flash {g[worst]!r}, composite {r[worst]!r}, largest composite magnitude {scale:.3g})")


CASES = [   # n, lq, lk, heads, dqk, dv, keywords
    (2, 64, 64, 3, 64, 64, {}),
    (2, 33, 47, 2, 32, 32, {}),
    (1, 130, 70, 2, 16, 48, {"causal": True}),    # more queries than keys
    (3, 70, 130, 1, 48, 80, {"causal": True}),    # more keys than queries: the last keys are seen by none
    (2, 100, 100, 4, 128, 128, {"causal": True}),
    (1, 65, 129, 2, 80, 16, {}),
    (2, 17, 200, 2, 128, 64, {}),
    (1, 1, 1, 1, 1, 1, {}),
    (2, 40, 50, 3, 7, 5, {}),                     # head sizes not multiples of 4: scalar loads
    (1, 257, 257, 1, 64, 64, {"causal": True}),
    (2, 96, 160, 2, 32, 128, {}),
]


def _case_id(c):
    return "n{}-lq{}-lk{}-h{}-d{}-dv{}".format(*c[:6]) + ("-causal" if c[6] else "")


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_flash_attention_equals_the_float64_composite(case):
    n, lq, lk, heads, dqk, dv, kw = CASES[case]
    q, k, v, w = _draw(np.random.default_rng(case), n, lq, lk, heads, dqk, dv)
    _compare(_flash(q, k, v, w, heads, **kw), _reference(q, k, v, w, heads, **kw), f"case {CASES[case]}")


def test_large_logits_keep_the_softmax_stable():
    q, k, v, w = _draw(np.random.default_rng(11), 2, 90, 150, 2, 64, 64, scale=4.0)
    _compare(_flash(q, k, v, w, 2), _reference(q, k, v, w, 2), "logits of standard deviation 16")


def _mask(rng, kind, n, heads, lq, lk):
    shape = {"shared": (lq, lk), "per_batch": (n, 1, lq, lk), "per_head": (1, heads, lq, lk),
             "key_padding": (n, 1, 1, lk), "no_key": (lq, lk)}[kind]
    mask = rng.random(shape) < 0.6
    mask[..., 0] = True   # every query sees key 0 (which causal allows too)
    if kind == "key_padding":
        mask = np.arange(lk) < rng.integers(1, lk + 1, n)[:, None, None, None]
    if kind == "no_key":
        mask[7] = False   # query 7 sees no key: NaN on both paths
    return _cp().asarray(mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["shared", "per_batch", "per_head", "key_padding", "no_key"])
def test_flash_attention_with_boolean_masks(kind, causal):
    if kind == "no_key" and causal:
        pytest.skip("a query with no key under causal: the composite's NaN reaches every key's dv, the kernels' "
                    "only the keys up to the diagonal (documented in cuda/flash_attention.cu)")
    rng = np.random.default_rng(3)
    n, lq, lk, heads, d = 2, 70, 90, 3, 32
    q, k, v, w = _draw(rng, n, lq, lk, heads, d, d)
    kw = {"mask": _mask(rng, kind, n, heads, lq, lk), "causal": causal}
    got = _flash(q, k, v, w, heads, **kw)
    if kind == "no_key":
        assert np.isnan(got[0][:, 7]).all() and not np.isnan(got[0][:, 8]).any(), "query 7 alone is NaN"
    _compare(got, _reference(q, k, v, w, heads, **kw), f"{kind} mask, causal={causal}")


@pytest.mark.parametrize("shape", [(70, 90), (1, 3, 70, 90), (2, 1, 1, 90), (2, 3, 70, 90), (70, 1)])
def test_flash_attention_with_a_broadcast_bias(shape):
    rng = np.random.default_rng(5)
    n, lq, lk, heads, d = 2, 70, 90, 3, 64
    q, k, v, w = _draw(rng, n, lq, lk, heads, d, d)
    bias = _cp().asarray(rng.standard_normal(shape).astype(np.float32))
    _compare(_flash(q, k, v, w, heads, bias=bias), _reference(q, k, v, w, heads, bias=bias), f"bias {shape}")


def test_flash_attention_with_a_bias_a_mask_and_causal():
    rng = np.random.default_rng(6)
    n, lq, lk, heads, d = 2, 80, 80, 2, 48
    q, k, v, w = _draw(rng, n, lq, lk, heads, d, d)
    kw = {"bias": _cp().asarray(rng.standard_normal((1, heads, lq, lk)).astype(np.float32)),
          "mask": _mask(rng, "per_batch", n, heads, lq, lk), "causal": True}
    _compare(_flash(q, k, v, w, heads, **kw), _reference(q, k, v, w, heads, **kw), "bias, mask and causal")


@pytest.mark.parametrize("d", [64, 7])
def test_inputs_sliced_from_a_packed_projection_are_read_in_place(d):
    """q, k, v as views of one (N, L, 3 * features) array (as a fused QKV projection gives): rows 3x apart; with
    d = 7 the views start off 16-byte alignment (scalar loads)."""
    cp = _cp()
    rng = np.random.default_rng(7)
    n, length, heads = 2, 75, 2
    f = heads * d
    qkv = cp.asarray(rng.standard_normal((n, length, 3 * f)).astype(np.float32))
    q, k, v = qkv[..., :f], qkv[..., f:2 * f], qkv[..., 2 * f:]
    w = cp.asarray(rng.standard_normal((n, length, f)).astype(np.float32))
    _compare(_flash(q, k, v, w, heads, causal=True), _reference(q, k, v, w, heads, causal=True), f"packed, d={d}")


@pytest.mark.parametrize("layout", ["broadcast_row", "broadcast_all", "fortran"])
def test_any_layout_of_the_output_cotangent(layout):
    cp = _cp()
    rng = np.random.default_rng(8)
    n, lq, lk, heads, d = 2, 40, 60, 2, 32
    q, k, v, w = _draw(rng, n, lq, lk, heads, d, d)
    if layout == "broadcast_row":
        w = cp.broadcast_to(w[0, 0], w.shape)
    elif layout == "broadcast_all":
        w = cp.broadcast_to(cp.asarray(0.5, dtype=cp.float32), w.shape)
    else:
        w = cp.asfortranarray(w)
    _compare(_flash(q, k, v, w, heads), _reference(q, k, v, w, heads), f"cotangent {layout}")


def test_flash_attention_is_deterministic():
    q, k, v, w = _draw(np.random.default_rng(9), 2, 200, 300, 2, 64, 64)
    first, second = (_flash(q, k, v, w, 2, causal=True) for _ in range(2))
    for name, a, b in zip(NAMES, first, second):
        assert np.array_equal(a, b, equal_nan=True), f"{name} differs between two runs"


ONE_KEY_BLOCK = [   # n, lq, lk, heads, dqk, dv, keywords: at most 64 keys, the backward in one launch
    (2, 64, 64, 3, 64, 64, {}),
    (3, 130, 40, 2, 32, 64, {}),                 # three query blocks, one key block
    (2, 70, 64, 2, 128, 128, {"causal": True}),  # the last queries see every key
    (1, 5, 33, 1, 7, 5, {}),                     # head sizes not multiples of 4: scalar loads
    (2, 100, 50, 2, 48, 80, {"mask": "per_head"}),
    (2, 66, 60, 3, 16, 32, {"mask": "no_key", "bias": (1, 3, 66, 60)}),
]


@pytest.mark.parametrize("case", range(len(ONE_KEY_BLOCK)), ids=[_case_id(c) for c in ONE_KEY_BLOCK])
def test_the_one_launch_backward_equals_the_three_launches_bit_for_bit(case):
    """A problem with one key block runs its backward in one launch (D, dq, dk, dv): the same sums in the same order
    as flash_row_dot, flash_backward_kv and flash_backward_q, so the same bits, NaN where those give NaN."""
    cp = _cp()
    n, lq, lk, heads, dqk, dv, kw = ONE_KEY_BLOCK[case]
    rng = np.random.default_rng(40 + case)
    q, k, v, w = _draw(rng, n, lq, lk, heads, dqk, dv)
    bias = None
    if "bias" in kw:
        bias = cp.broadcast_to(cp.asarray(rng.standard_normal(kw["bias"]).astype(np.float32)), (n, heads, lq, lk))
    if "mask" in kw:
        mask = _mask(rng, kw["mask"], n, heads, lq, lk)
        additive = cp.where(mask, np.float32(0), np.float32(-np.inf)).astype(np.float32)
        bias = cp.broadcast_to(additive if bias is None else bias + additive, (n, heads, lq, lk))
    problem = cuda_flash.problem_of(q, k, v, heads, kw.get("causal", False), bias)
    y, lse = cuda_flash.forward(problem, q, k, v, bias)
    before = cuda_flash.stats()["one_launch"]
    one = cuda_flash.backward(problem, q, k, v, bias, y, lse, w)
    assert cuda_flash.stats()["one_launch"] == before + 1, "the one-launch backward did not run"
    three = cuda_flash.backward(problem, q, k, v, bias, y, lse, w, one_launch=False)
    assert cuda_flash.stats()["one_launch"] == before + 1, "one_launch=False ran the one-launch backward"
    for name, a, b in zip(NAMES[1:], one, three):
        a, b = cp.asnumpy(a), cp.asnumpy(b)
        assert np.array_equal(a, b, equal_nan=True), (
            f"{name}: one launch and three differ at {np.argwhere(~((a == b) | (np.isnan(a) & np.isnan(b))))[:4]}")
    if kw.get("mask") == "no_key":
        assert np.isnan(cp.asnumpy(y)[:, 7]).all(), "query 7 sees no key: y is NaN there"


def test_a_problem_of_more_than_64_keys_or_one_gradient_runs_three_launches():
    q, k, v, w = _draw(np.random.default_rng(12), 2, 30, 65, 2, 32, 32)
    problem = cuda_flash.problem_of(q, k, v, 2, False, None)
    y, lse = cuda_flash.forward(problem, q, k, v, None)
    before = cuda_flash.stats()["one_launch"]
    cuda_flash.backward(problem, q, k, v, None, y, lse, w)
    q, k, v, w = _draw(np.random.default_rng(13), 2, 30, 64, 2, 32, 32)
    problem = cuda_flash.problem_of(q, k, v, 2, False, None)
    y, lse = cuda_flash.forward(problem, q, k, v, None)
    dq, dk, dv = cuda_flash.backward(problem, q, k, v, None, y, lse, w, need_q=False)
    assert dq is None and dk is not None and dv is not None
    assert cuda_flash.stats()["one_launch"] == before, "the one-launch backward ran where it should not"


def test_a_captured_call_equals_the_eager_call():
    from fluxpy.backend import capture_graph
    cp = _cp()
    heads = 3
    q, k, v, w = _draw(np.random.default_rng(10), 2, 100, 100, heads, 64, 64)
    mask = _mask(np.random.default_rng(10), "key_padding", 2, heads, 100, 100)

    def call():
        def attend(q, k, v):
            return dot_product_attention(q, k, v, mask, nheads=heads, causal=True, need_scores=False)[0]
        y, back = fluxpy.pullback(attend, q, k, v)
        return (y, *back(w))

    eager = [a.copy() for a in call()]
    assert fused_reason() == "", fused_reason()
    graph, captured = capture_graph(call)
    for a in captured:
        a.fill(np.nan)   # nothing ran yet: the replay must write every element
    graph.launch()
    cp.cuda.get_current_stream().synchronize()
    for name, e, c in zip(NAMES, eager, captured):
        assert cp.array_equal(e, c, equal_nan=True), f"{name}: the captured call differs from the eager call"


def test_a_float32_transformer_step_is_captured_through_the_flash_kernels_and_equals_eager():
    cp = _cp()
    from fluxpy import Adam, Chain, Dense, TrainStep, TransformerEncoderLayer, setup

    def model():
        return Chain(TransformerEncoderLayer(64, 2, 128, rng=1), TransformerEncoderLayer(64, 2, 128, rng=2),
                     lambda h: fluxpy.mean(h, axis=1), Dense(64, 10, rng=3))

    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal((8, 32, 64)).astype(np.float32))
    y = cp.asarray(rng.integers(0, 10, 8))
    results = []
    for capture in (False, True):
        m = fluxpy.gpu(model())
        step = TrainStep(lambda m, x, y: fluxpy.logitcrossentropy(m(x), y), m, setup(Adam(1e-3), m),
                         capture=capture, warmup=1)
        before = cuda_flash.stats()["backward"]
        losses = [float(step(x, y)) for _ in range(4)]
        assert cuda_flash.stats()["backward"] > before, "the transformer layers did not run the flash kernels"
        if capture:
            assert set(step.captured().values()) == {"captured"}, step.captured()
        results.append(np.array(losses))
    eager, captured = results
    assert np.isfinite(captured).all()
    np.testing.assert_allclose(captured, eager, rtol=1e-4)


def _declined(q, heads=1, **kw):
    """Runs the attention of q with itself (need_scores=False), asserts that the composite ran, returns why."""
    before = cuda_flash.stats()["forward"]
    y, _ = dot_product_attention(q, q, q, nheads=heads, need_scores=False, **kw)
    assert cuda_flash.stats()["forward"] == before, "the flash kernels ran on a problem they should decline"
    assert y.shape[:2] == q.shape[:2]
    return fused_reason()


def test_problems_the_kernels_cannot_take_run_the_composite_and_say_why():
    cp = _cp()
    rng = np.random.default_rng(12)
    q = cp.asarray(rng.standard_normal((2, 10, 16)).astype(np.float32))
    assert "dropout" in _declined(q, dropout=0.2)
    assert "float32 bias" in _declined(q, bias=cp.zeros((10, 10)))
    assert "head sizes from 1 to 128" in _declined(cp.asarray(rng.standard_normal((1, 4, 260)), np.float32), 2)
    strided = cp.asarray(rng.standard_normal((2, 10, 32)).astype(np.float32))[..., ::2]
    assert "contiguous features" in _declined(strided)

    bias = cp.zeros((10, 10), np.float32)
    g = fluxpy.gradient(lambda b: dot_product_attention(q, q, q, need_scores=False, bias=b)[0].sum(), bias)[0]
    assert "no gradient of bias" in fused_reason()
    assert g.shape == bias.shape


def test_second_derivatives_run_the_composite():
    cp = _cp()
    q = cp.asarray(np.random.default_rng(13).standard_normal((1, 8, 16)).astype(np.float32))

    def inner(x):
        return fluxpy.gradient(lambda z: (dot_product_attention(z, z, z, need_scores=False)[0] ** 2).sum(), x)[0]

    g2 = fluxpy.gradient(lambda x: inner(x).sum(), q)[0]
    assert "derivative of a derivative" in fused_reason()
    assert np.isfinite(g2.get()).all()
