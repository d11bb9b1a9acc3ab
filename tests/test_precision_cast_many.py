"""MixedPrecision's batched casts (``fluxpy.precision._to_halves``, taken apart by ``_pick``) on NumPy, where no
``astype_many`` kernel is registered: the weights' half copies, their layouts and the float32 gradients that come back
(divided by a static or dynamic loss scale) equal the per-array casts' (``_to_half`` after ``_unscaled_backward``,
what a MixedPrecision on the GPU runs without the kernel) bit for bit, for drawn sets of weights of every rank (4-d
ones in C order and channels-last), both half types and both memory formats, with weights used twice and weights
unused (no gradient). The same checks with the kernel run on the CPU (the gradients then in their weights' layouts):
tests/test_cast_many_cpu_run.py (the helpers here)."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import precision
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.layers import Conv, Dense
from fluxpy.layout import is_channels_last, to_channels_last
from fluxpy.ops.shape import astype

HALF_DTYPES = [np.dtype(np.float16), BFLOAT16]
SHAPES = [(), (1,), (7,), (3, 5), (1, 9), (4, 3, 3, 3), (2, 1, 3, 3), (3, 2, 1, 1), (2, 3, 4), (5, 2, 1, 3),
          (1, 4, 2, 2), (0, 3)]


def draw(rng, shape):
    """float32 values at many scales with NaN, infinities, signed zeros, values past float16's range and subnormals
    of float16 and float32 among them."""
    n = int(np.prod(shape))
    v = rng.standard_normal(n) * 10.0 ** rng.integers(-9, 7, n)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 7e4, -1e5, 65519.0, 6e-8, -3e-8, 3e-39, 1e-45])
    where = rng.integers(0, max(n, 1), min(n, 6))
    v[where] = special[rng.integers(0, len(special), where.size)]
    with np.errstate(over="ignore"):
        return v.astype(np.float32).reshape(shape)


def weights_of(seed, spec):
    """float32 weights of the drawn ``spec`` (``(shape, channels-last)`` pairs; the flag counts for 3 or more axes)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, last in spec:
        w = draw(rng, shape)
        out.append(to_channels_last(w) if last and len(shape) >= 3 else w)
    return out


def specs():
    return st.lists(st.tuples(st.sampled_from(SHAPES), st.booleans()), min_size=1, max_size=6)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


def assert_same(got, want, what, layout=True):
    """The same dtype, shape and (with ``layout``) layout, NaN at the same places and the same bits elsewhere."""
    assert got is not None and want is not None, what
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert not layout or is_channels_last(got) == is_channels_last(want), f"{what}: layouts differ"
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{what}: NaNs differ"
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan]), f"{what}: bits differ"


def _batched(ws, dtype, memory, scale):
    halves = precision._to_halves(*ws, dtype=dtype, memory=memory, scale=scale)
    return lambda i: precision._pick(halves, i)


def _per_array(ws, dtype, memory, scale):
    halves = [precision._to_half(w if scale is None else precision._unscaled_backward(w, scale), dtype, memory)
              for w in ws]
    return halves.__getitem__


def run(path, ws, dtype, memory, scale, uses, coefs):
    """The half copies (plain) and the gradients of ``sum(half(ws[i]) * coefs[i])`` over the indices ``uses``."""
    def loss(*tracked):
        half = path(tracked, dtype, memory, scale)
        return sum((astype(half(i), np.float32) * coefs[i]).sum() for i in uses)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # values past float16's range and NaN in the cotangents are what is drawn
        halves = path(ws, dtype, memory, scale)
        return [halves(i) for i in range(len(ws))], fluxpy.gradient(loss, *ws)


def check(seed, spec, dtype, memory, scale_kind, kernel=False):
    """Both paths on the drawn weights, every one but (where there are two or more) the first used, the last twice;
    with ``kernel`` (the batched casts ran the kernel) each gradient in its weight's layout."""
    ws = weights_of(seed, spec)
    rng = np.random.default_rng(seed + 1)
    coefs = [draw(rng, w.shape) * np.float32(rng.choice([1.0, 3e4])) for w in ws]
    coefs = [to_channels_last(c) if c.ndim >= 3 and (seed + i) % 2 else c for i, c in enumerate(coefs)]   # cotangents
    uses = list(range(1 if len(ws) > 1 else 0, len(ws))) + [len(ws) - 1]
    scale = {"none": None, "static": 1024.0, "dynamic": np.asarray(np.float32(2.0 ** 13))}[scale_kind]
    got_h, got_g = run(_batched, ws, dtype, memory, scale, uses, coefs)
    want_h, want_g = run(_per_array, ws, dtype, memory, scale, uses, coefs)
    for i, (g, w) in enumerate(zip(got_h, want_h)):
        assert_same(g, w, f"half copy {i} of {spec[i]}")
    for i, (g, w) in enumerate(zip(got_g, want_g)):
        if i in uses:   # the per-array casts give a gradient in its cotangent's layout (a 4-d one's: its weight's)
            assert_same(g, w, f"gradient {i} of {spec[i]}", layout=False)
            assert not kernel or is_channels_last(g) == is_channels_last(ws[i]), f"gradient {i}: not in its layout"
        else:
            assert g is None and w is None, f"gradient {i}: no cotangent reached it, yet got {type(g).__name__}"


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spec=specs(), dtype=st.sampled_from(HALF_DTYPES),
       memory=st.sampled_from(["channels_last", "contiguous"]), scale=st.sampled_from(["none", "static", "dynamic"]))
def test_batched_casts_equal_the_per_array_casts_on_numpy(seed, spec, dtype, memory, scale):
    check(seed, spec, dtype, memory, scale)


def check_unscaled(seed, spec, scale_kind, kernel=False):
    """The float32 layers' weights under a loss scale: the gradients of ``sum(w_i * coef_i)`` over the drawn uses
    through :func:`precision._unscaled_many` (one pullback for all) equal those through one
    ``_unscaled_backward`` each, bit for bit (with ``kernel``: each in its weight's layout); an unused weight gets
    None; the forward gives the weights themselves."""
    ws = weights_of(seed, spec)
    rng = np.random.default_rng(seed + 2)
    coefs = [draw(rng, w.shape) for w in ws]
    coefs = [to_channels_last(c) if c.ndim >= 3 and (seed + i) % 2 else c for i, c in enumerate(coefs)]
    uses = list(range(1 if len(ws) > 1 else 0, len(ws))) + [len(ws) - 1]
    scale = {"static": 1024.0, "dynamic": np.asarray(np.float32(2.0 ** 13))}[scale_kind]

    def batched(*tracked):
        kept = precision._unscaled_many(*tracked, scale=scale)
        return sum((precision._pick(kept, i) * coefs[i]).sum() for i in uses)

    def per_array(*tracked):   # each weight unscaled once (as MixedPrecision's per-weight path does), used as drawn
        unscaled = [precision._unscaled_backward(t, scale) for t in tracked]
        return sum((unscaled[i] * coefs[i]).sum() for i in uses)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = precision._unscaled_many(*ws, scale=scale)
        got, want = fluxpy.gradient(batched, *ws), fluxpy.gradient(per_array, *ws)
    assert all(p is w for p, w in zip(plain, ws)), "the forward is not the weights themselves"
    for i, (g, w) in enumerate(zip(got, want)):
        if i in uses:
            assert g.dtype == np.float32
            assert_same(g, w, f"gradient {i} of {spec[i]}", layout=False)
            assert not kernel or is_channels_last(g) == is_channels_last(ws[i]), f"gradient {i}: not in its layout"
        else:
            assert g is None and w is None, f"gradient {i}: no cotangent reached it, yet got {type(g).__name__}"


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spec=specs(), scale=st.sampled_from(["static", "dynamic"]))
def test_the_float32_layers_batched_unscaling_equals_one_division_each_on_numpy(seed, spec, scale):
    check_unscaled(seed, spec, scale)


def test_the_cotangent_of_the_halves_adds_the_pieces_of_each_index():
    a, b = precision._Pieces({0: np.ones(2)}), precision._Pieces({1: np.full(2, 3.0), 0: np.ones(2)})
    total = a + b
    assert sorted(total.parts) == [0, 1]
    np.testing.assert_array_equal(total.parts[0], np.full(2, 2.0))
    np.testing.assert_array_equal(total.parts[1], np.full(2, 3.0))


def test_only_the_weights_that_need_a_gradient_get_one():
    rng = np.random.default_rng(5)
    frozen, trained = draw(rng, (3, 4)), draw(rng, (2, 2, 3, 3))

    def loss(w):
        halves = precision._to_halves(frozen, w, dtype=BFLOAT16, memory="channels_last", scale=None)
        return sum(astype(precision._pick(halves, i), np.float32).sum() for i in (0, 1))
    with np.errstate(all="ignore"):
        g, = fluxpy.gradient(loss, trained)
    assert g.dtype == np.float32 and g.shape == trained.shape and not is_channels_last(g)
    np.testing.assert_array_equal(g, np.ones_like(trained))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
def test_mixed_precision_on_the_cpu_casts_per_array_and_says_why(dtype):
    rng = np.random.default_rng(2)
    model = precision.mixed_precision(fluxpy.Chain(Conv((3, 3), 2, 4, rng=rng), fluxpy.flatten,
                                                   Dense(4 * 4 * 4, 3, rng=rng)), dtype)
    x = rng.standard_normal((2, 2, 6, 6)).astype(np.float32)
    assert [len(leaves) for leaves in precision._split_leaves(model.model)] == [4, 0]
    y = model(x)
    assert precision.cast_reason().startswith("on the CPU")
    want = model.model[2](fluxpy.flatten(model.model[0](x)))   # float32 throughout: close, not equal
    assert y.dtype == np.float32 and y.shape == want.shape
    np.testing.assert_allclose(y, want, rtol=0.1, atol=0.1)
