"""Issue 41's new ops and layers against PyTorch itself, float64, values and gradients (skipped without torch; the
other tests check them against the formulas written out in NumPy)."""
import numpy as np
import pytest

import fluxpy
from fluxpy.ops.linalg import norm

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _close(got, want, tol=1e-10):
    want = want.detach().numpy()
    assert np.shape(got) == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _grad_pair(f_fluxpy, f_torch, x):
    """fluxpy's and PyTorch's gradient of the sum of squares of ``f(x)``."""
    g = fluxpy.gradient(lambda t: fluxpy.sum(f_fluxpy(t) ** 2), x)[0]
    t = torch.tensor(x, requires_grad=True)
    (f_torch(t) ** 2).sum().backward()
    return g, t.grad


def test_einsum():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5))
    _close(fluxpy.ops.einsum("ijk,kl->ijl", a, b), torch.einsum("ijk,kl->ijl", torch.tensor(a), torch.tensor(b)))
    g, want = _grad_pair(lambda x: fluxpy.ops.einsum("ijk,kl->ij", x, b),
                         lambda t: torch.einsum("ijk,kl->ij", t, torch.tensor(b)), a)
    _close(g, want)


@pytest.mark.parametrize("ord_", [None, 1, 3, np.inf, -np.inf])
def test_vector_norms_and_their_gradients_with_a_zero_entry(ord_):
    x = np.random.default_rng(1).standard_normal(6)
    x[2] = 0.0
    torch_ord = 2 if ord_ is None else ord_
    _close(norm(x, ord_), torch.linalg.vector_norm(torch.tensor(x), ord=torch_ord))
    g = fluxpy.gradient(lambda v: norm(v, ord_), x)[0]
    t = torch.tensor(x, requires_grad=True)
    torch.linalg.vector_norm(t, ord=torch_ord).backward()
    _close(g, t.grad)


@pytest.mark.parametrize("ord_", ["fro", "nuc", 2, -2, 1, np.inf])
def test_matrix_norms_and_their_gradients(ord_):
    m = np.random.default_rng(2).standard_normal((4, 3))
    _close(norm(m, ord_), torch.linalg.matrix_norm(torch.tensor(m), ord=ord_))
    g = fluxpy.gradient(lambda v: norm(v, ord_), m)[0]
    t = torch.tensor(m, requires_grad=True)
    torch.linalg.matrix_norm(t, ord=ord_).backward()
    _close(g, t.grad, 1e-8)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_convolution_padding_modes(mode):
    x = np.random.default_rng(3).standard_normal((2, 3, 6, 7))
    conv = fluxpy.f64(fluxpy.CrossCor((3, 3), 3, 4, pad=(1, 2), padding_mode=mode))
    twin = torch.nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode=mode).double()
    fluxpy.load_torch_state(conv, twin.state_dict())
    _close(conv(x), twin(torch.tensor(x)))
    g, want = _grad_pair(conv, twin, x)
    _close(g, want)


@pytest.mark.parametrize("mode,align", [("bilinear", False), ("bilinear", True), ("nearest", None)])
@pytest.mark.parametrize("scale", [1.5, 2.3, 0.7, (1.5, 2.0)])
def test_upsample_at_non_integer_scales(mode, align, scale):
    x = np.random.default_rng(4).standard_normal((2, 3, 6, 7))
    kw = {} if align is None else {"align_corners": align}
    up = fluxpy.Upsample(scale, mode=mode, **kw)
    _close(up(x), F.interpolate(torch.tensor(x), scale_factor=scale, mode=mode, **kw))
    g, want = _grad_pair(up, lambda t: F.interpolate(t, scale_factor=scale, mode=mode, **kw), x)
    _close(g, want)


@pytest.mark.parametrize("align", [False, True])
def test_upsample_linear_in_one_dimension(align):
    x = np.random.default_rng(5).standard_normal((2, 3, 7))
    _close(fluxpy.Upsample(1.7, mode="linear", align_corners=align)(x),
           F.interpolate(torch.tensor(x), scale_factor=1.7, mode="linear", align_corners=align))


def test_mean_pool_without_the_padding():
    x = np.random.default_rng(6).standard_normal((2, 3, 7, 6))
    pool = fluxpy.MeanPool((3, 3), stride=2, pad=1, count_include_pad=False)
    _close(pool(x), F.avg_pool2d(torch.tensor(x), 3, 2, 1, count_include_pad=False))


def test_weight_norm_with_no_epsilon_is_pytorchs():
    rng = np.random.default_rng(7)
    twin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(5, 4).double())
    with torch.no_grad():
        twin.parametrizations.weight.original0.copy_(torch.tensor(rng.standard_normal((4, 1))))
    layer = fluxpy.f64(fluxpy.WeightNorm(fluxpy.Dense(5, 4), eps=0.0))
    layer.g[...] = twin.parametrizations.weight.original0.detach().numpy().reshape(layer.g.shape)
    layer.layer.weight[...] = twin.parametrizations.weight.original1.detach().numpy()
    layer.layer.bias[...] = twin.bias.detach().numpy()
    x = rng.standard_normal((3, 5))
    _close(layer(x), twin(torch.tensor(x)))
