"""Composite functions differentiated by fluxpy and by PyTorch autograd, float64 (skipped without torch)."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy

torch = pytest.importorskip("torch")


def _compare(f_np, f_torch, *arrays):
    grads = fluxpy.gradient(f_np, *arrays)
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    f_torch(*ts).backward()
    for g, t in zip(grads, ts):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(fluxpy.value_of(f_np(*arrays)), f_torch(*ts).detach().numpy(), rtol=1e-10)


COMPOSITES = {
    "broadcast_bias": (lambda x, b, w: (np.tanh(x * w + b) ** 2).mean(),
                       lambda x, b, w: (torch.tanh(x * w + b) ** 2).mean(), [(4, 3), (3,), (1, 3)]),
    "reductions": (lambda x, b, w: (x.max(axis=1) * x.sum(axis=0, keepdims=True).T[:4, 0]).sum()
                   + x.min() * b.mean() + np.sum(np.abs(w)),
                   lambda x, b, w: (x.amax(dim=1) * x.sum(dim=0, keepdim=True).T[:4, 0]).sum()
                   + x.amin() * b.mean() + w.abs().sum(), [(4, 4), (3,), (2, 2)]),
    "indexing": (lambda x, b, w: (x[np.array([0, 0, 2])] * b).sum() + x[1:, ::2].sum() * w[0, 1] + x[x > 0].sum(),
                 lambda x, b, w: (x[[0, 0, 2]] * b).sum() + x[1:, ::2].sum() * w[0, 1] + x[x > 0].sum(),
                 [(3, 3), (3,), (2, 2)]),
    "matmul": (lambda x, b, w: np.exp(np.matmul(x, w) @ b * 0.1).sum() + (x[0].T @ x[1]).sum(),
               lambda x, b, w: torch.exp(torch.matmul(x, w) @ b * 0.1).sum() + (x[0].T @ x[1]).sum(),
               [(5, 3, 4), (2,), (4, 2)]),
    "numpy_functions": (lambda x, b, w: np.sum(np.sqrt(np.maximum(x, 0.0) + 1) * np.log(np.abs(b) + 1))
                        + np.mean(np.where(w > 0, w ** 3, -w)) + np.sum(np.stack([b, b * 2]) ** 2),
                        lambda x, b, w: torch.sum(torch.sqrt(torch.clamp(x, min=0.0) + 1) * torch.log(b.abs() + 1))
                        + torch.mean(torch.where(w > 0, w ** 3, -w)) + torch.sum(torch.stack([b, b * 2]) ** 2),
                        [(2, 3), (3,), (2, 2)]),
    "softmax_like": (lambda x, b, w: -(x - np.log(np.sum(np.exp(x - x.max(axis=1, keepdims=True)), axis=1,
                                                        keepdims=True)) - x.max(axis=1, keepdims=True))[:, 0].mean()
                     + (b / (1 + w[0] ** 2)).sum(),
                     lambda x, b, w: -torch.log_softmax(x, dim=1)[:, 0].mean() + (b / (1 + w[0] ** 2)).sum(),
                     [(4, 5), (2,), (2, 2)]),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
@given(seed=st.integers(0, 2**31 - 1))
def test_composite_matches_torch(name, seed):
    f_np, f_torch, shapes = COMPOSITES[name]
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in shapes]
    _compare(f_np, f_torch, *arrays)


def test_second_derivative_matches_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(5)
    a = rng.standard_normal((5, 5))
    g, = fluxpy.gradient(lambda x: (fluxpy.gradient(lambda y: np.tanh(a @ y).sum() * (y ** 2).sum(), x)[0] ** 2)
                         .sum(), x)
    t = torch.tensor(x, requires_grad=True)
    ta = torch.tensor(a)
    inner, = torch.autograd.grad(torch.tanh(ta @ t).sum() * (t ** 2).sum(), t, create_graph=True)
    (inner ** 2).sum().backward()
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-8)
