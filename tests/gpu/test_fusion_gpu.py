"""Fusion beyond relu on the GPU: ``bias_act``, ``batchnorm`` (the op, and fluxpy's kernels called directly) and
``conv_bias_act`` with every activation that fuses, forward and backward, against the CPU path in float64.

The default run takes every activation in float32 (bias_act, batch norm; a few for the layer and conv) and relu and
gelu in every dtype and layout; ``--full`` every activation in every dtype and layout. Inputs keep the pre-activation away from the activations' kinks,
where a rounding of the GPU's half output could pick the other branch of a derivative.
"""
import functools
import zlib

import numpy as np
import pytest

import fluxpy
from devices import cupy_module
from fluxpy import kernels
from fluxpy.kernels.halfs import BFLOAT16
from fluxpy.ops import activations as A
from fluxpy.ops.batchnorm import batchnorm
from fluxpy.ops.bias_act import bias_act, derivative_from_saved, why_not_fused
from fluxpy.ops.conv import conv_bias_act
from sweeps import FULL

pytestmark = pytest.mark.gpu

ACTS = [a for a in (getattr(A, n) for n in A.__all__) if why_not_fused(a) is None] + \
    [functools.partial(A.leakyrelu, a=0.2)]
DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BFLOAT16)
# relative to the largest magnitude of the reference: float32 and float64 compute in their own type, the halves in
# float32 with each input, output and saved array rounded to 16 bits
TOL = {np.dtype(np.float64): 1e-9, np.dtype(np.float32): 1e-4, np.dtype(np.float16): 2e-2, BFLOAT16: 8e-2}
KINKS = np.array([0.5, 1.0, 1.5, 3.0, 6.0])   # |z| at a kink (besides 0, where no rounding moves the branch)


def _name(act):
    if isinstance(act, functools.partial):
        return f"{_name(act.func)}({', '.join(f'{k}={v}' for k, v in act.keywords.items())})"
    return getattr(act, "__name__", None) or act.name


def _cases(layouts=("nchw",), every_act=True):
    """``(act, dtype, layout)`` cases: in the default run every activation in float32 and the first layout (where
    ``every_act``; else gelu, swish and tanh), relu and gelu in every dtype and layout; all of them with ``--full``."""
    for act in ACTS:
        for dtype in DTYPES:
            for layout in layouts:
                first = dtype == np.float32 and layout == layouts[0]
                everyday = (first and (every_act or act in (A.gelu, A.swish, A.tanh))) or act in (A.relu, A.gelu)
                yield pytest.param(act, dtype, layout, id=f"{_name(act)}-{dtype}-{layout}",
                                   marks=() if everyday else FULL)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def _far_from_kinks(z):
    return np.min(np.abs(np.abs(np.asarray(z, np.float64))[..., None] - KINKS)) > 0.02


def _device(cp, a, layout):
    """``a`` on the GPU, channels-last for ``layout == "nhwc"`` (4-D arrays only)."""
    g = cp.asarray(a)
    if layout == "nhwc" and g.ndim == 4:
        g = cp.ascontiguousarray(g.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return g


def _close(got, want, dtype, what):
    cp = cupy_module()
    assert isinstance(got, cp.ndarray), what
    assert got.dtype == dtype or dtype in (np.float16, BFLOAT16) and what.startswith("d") and got.dtype == np.float32, \
        f"{what}: dtype {got.dtype}"
    got = cp.asnumpy(got).astype(np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype] * scale, err_msg=what)


@pytest.mark.parametrize("act, dtype, layout", list(_cases(("nchw", "nhwc"))))
def test_bias_act_every_activation(act, dtype, layout):
    cp = cupy_module()
    rng = np.random.default_rng(_seed(_name(act), str(dtype), layout))
    for shape, bshape in [((8, 6), (6,)), ((4, 5, 3, 3), (1, 5, 1, 1))]:
        z = rng.uniform(-4, 4, shape)
        z = np.where(np.min(np.abs(np.abs(z)[..., None] - KINKS), axis=-1) > 0.05, z, 0.25)
        b = (rng.standard_normal(bshape) * 0.5).astype(dtype)
        x = (z - b.astype(np.float64)).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        assert _far_from_kinks(x.astype(np.float64) + b.astype(np.float64))   # z's margin outlasts the rounding
        xg, bg, dyg = _device(cp, x, layout), cp.asarray(b), _device(cp, dy, layout)
        derivative, from_output = derivative_from_saved(act)
        if not from_output:
            assert kernels.find("bias_act_preactivation", xg, bg, act) is not None, "one pass writes y and z"
        y, back = fluxpy.pullback(lambda x, b: bias_act(x, b, act), xg, bg)
        dx, db = back(dyg)
        assert kernels.find("bias_act_backward", derivative, y if from_output else xg, dyg, bshape, True, True) \
            is not None, "the fused backward takes the call"
        x64, b64, dy64 = (a.astype(np.float64) for a in (x, b, dy))
        yc, backc = fluxpy.pullback(lambda x, b: bias_act(x, b, act), x64, b64)
        dxc, dbc = backc(dy64)
        _close(y, yc, dtype, f"y {shape}")
        _close(dx, dxc, dtype, f"dx {shape}")
        _close(db, dbc, dtype, f"db {shape}")
        if layout == "nhwc" and len(shape) == 4:
            assert fluxpy.layout.is_channels_last(y) and fluxpy.layout.is_channels_last(dx)


def _bn_case(rng, shape, dtype, act):
    """x, gamma, beta, running statistics and dy whose normalised values keep away from the kinks."""
    c = shape[1]
    pdt = np.float32 if dtype in (np.float16, BFLOAT16) else dtype
    for _ in range(50):
        x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
        g, b = (rng.uniform(0.5, 1.5, c)).astype(pdt), (rng.standard_normal(c) * 0.5).astype(pdt)
        z = batchnorm(x.astype(np.float64), g.astype(np.float64), b.astype(np.float64), eps=1e-3)
        if _far_from_kinks(z):
            break
    rm, rv = rng.standard_normal(c).astype(pdt), (rng.random(c) + 0.5).astype(pdt)
    return x, g, b, rm, rv, rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("act, dtype, layout", list(_cases(("nchw", "nhwc"))))
def test_batchnorm_every_activation(act, dtype, layout):
    """The op (whichever implementation the table keeps) and fluxpy's kernels called directly."""
    from fluxpy.kernels import cuda_bn
    cp = cupy_module()
    rng = np.random.default_rng(_seed(_name(act), str(dtype), layout))
    x, g, b, rm, rv, dy = _bn_case(rng, (6, 4, 3, 3), dtype, act)
    xg, dyg = _device(cp, x, layout), _device(cp, dy, layout)
    gg, bg, rmg, rvg = (cp.asarray(a) for a in (g, b, rm, rv))
    x64, g64, b64, rm64, rv64, dy64 = (a.astype(np.float64) for a in (x, g, b, rm, rv, dy))
    assert kernels.find("batchnorm_forward", xg, gg, bg, rmg, rvg, 0.2, 1e-3, act) is not None

    y, back = fluxpy.pullback(lambda x, g, b: batchnorm(x, g, b, rmg, rvg, momentum=0.2, eps=1e-3, act=act),
                              xg, gg, bg)
    dx, dg, db = back(dyg)
    yc, backc = fluxpy.pullback(lambda x, g, b: batchnorm(x, g, b, rm64, rv64, momentum=0.2, eps=1e-3, act=act),
                                x64, g64, b64)
    dxc, dgc, dbc = backc(dy64)
    _close(y, yc, dtype, "y")
    _close(dx, dxc, dtype, "dx")
    _close(dg, dgc, dtype, "dgamma")
    _close(db, dbc, dtype, "dbeta")
    np.testing.assert_allclose(cp.asnumpy(rmg), rm64, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(rvg), rv64, rtol=1e-4, atol=1e-5)

    # fluxpy's kernels themselves (the op may have kept cuDNN's calls)
    assert cuda_bn.supports(xg, gg, bg, act=act)
    y2, mean, invstd = cuda_bn.forward_training(xg, gg, bg, None, None, 0.2, 1e-3, act)
    dx2, dg2, db2 = cuda_bn.backward(dyg, xg, gg, bg, mean, invstd, 1e-3, act)
    _close(y2, yc, dtype, "y (fluxpy's kernels)")
    _close(dx2, dxc, dtype, "dx (fluxpy's kernels)")
    _close(dg2, dgc, dtype, "dgamma (fluxpy's kernels)")
    _close(db2, dbc, dtype, "dbeta (fluxpy's kernels)")
    if layout == "nhwc":
        assert fluxpy.layout.is_channels_last(y2) and fluxpy.layout.is_channels_last(dx2)


@pytest.mark.parametrize("act", [a if a in (A.gelu, A.swish, A.elu) else pytest.param(a, marks=FULL) for a in ACTS],
                         ids=_name)
def test_the_batchnorm_layer_fuses_in_training_and_inference(act):
    """``BatchNorm(C, act)`` in float32: its running-statistics form (one fused elementwise op) and its training
    form (the batchnorm op with the activation), values and gradients against the same layer on the CPU."""
    cp = cupy_module()
    rng = np.random.default_rng(_seed(_name(act)))
    x, _, _, rm, rv, dy = _bn_case(rng, (6, 4, 3, 3), np.dtype(np.float32), act)
    layer_cpu = fluxpy.BatchNorm(4, act)
    layer_cpu.running_mean[...], layer_cpu.running_var[...] = rm, rv
    layer_gpu = fluxpy.gpu(fluxpy.BatchNorm(4, act))
    layer_gpu.running_mean[...], layer_gpu.running_var[...] = cp.asarray(rm), cp.asarray(rv)
    xg, dyg = cp.asarray(x), cp.asarray(dy)
    for training in (False, True):
        fluxpy.trainmode(layer_gpu, training)
        fluxpy.trainmode(layer_cpu, training)
        (gm, gx) = fluxpy.gradient(lambda m, x: (m(x) * dyg).sum(), layer_gpu, xg)
        (cm, cx) = fluxpy.gradient(lambda m, x: (m(x) * dy).sum(), layer_cpu, x)
        _close(gx, cx, np.dtype(np.float32), f"dx (training={training})")
        _close(gm["gamma"], cm["gamma"], np.dtype(np.float32), f"dgamma (training={training})")
        _close(gm["beta"], cm["beta"], np.dtype(np.float32), f"dbeta (training={training})")
        fluxpy.trainmode(layer_gpu, False)
        fluxpy.trainmode(layer_cpu, False)
        _close(layer_gpu(xg), layer_cpu(x), np.dtype(np.float32), f"y after training={training}")


@pytest.mark.parametrize("act, dtype, layout", list(_cases(("nchw", "nhwc"), every_act=False)))
def test_conv_bias_act_every_activation(act, dtype, layout):
    cp = cupy_module()
    rng = np.random.default_rng(_seed(_name(act), str(dtype), layout))
    for _ in range(50):
        x = rng.standard_normal((2, 3, 6, 6)).astype(dtype)
        w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(dtype)
        b = (rng.standard_normal(4) * 0.3).astype(dtype)
        z = conv_bias_act(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), None, pad=1)
        if _far_from_kinks(z):
            break
    dy = rng.standard_normal(z.shape).astype(dtype)
    xg, wg, bg, dyg = _device(cp, x, layout), _device(cp, w, layout), cp.asarray(b), _device(cp, dy, layout)
    y, back = fluxpy.pullback(lambda x, w, b: conv_bias_act(x, w, b, act, pad=1), xg, wg, bg)
    dx, dw, db = back(dyg)
    args64 = [a.astype(np.float64) for a in (x, w, b)]
    yc, backc = fluxpy.pullback(lambda x, w, b: conv_bias_act(x, w, b, act, pad=1), *args64)
    dxc, dwc, dbc = backc(dy.astype(np.float64))
    for got, want, what in ((y, yc, "y"), (dx, dxc, "dx"), (dw, dwc, "dw"), (db, dbc, "db")):
        _close(got, want, dtype, what)
