"""NNlib.jl's ``test/activations.jl`` known-answer cases (FluxML/NNlib.jl at f71b71c), in fluxpy.

Scalars become 1-element float64 arrays; NNlib's ``σ`` is :func:`fluxpy.sigmoid`, ``hardσ`` :func:`hardsigmoid`,
``logσ`` :func:`logsigmoid`. Each case names its upstream line. ``rrelu`` (random slope) is checked by its bounds, as
upstream, and left out of the deterministic lists (as NNlib leaves it out of its gradient tests). Not translated:
``tanh_fast``/``sigmoid_fast`` (fluxpy has one of each), integer and complex inputs, type inference.
"""
import math

import numpy as np
import pytest

import fluxpy
from fluxpy.ops import activations as A

SELU_L, SELU_A = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717


def at(f, v, *args):
    return float(f(np.array([v], np.float64), *args)[0])


def grad_at(f, v):
    return float(fluxpy.gradient(lambda x: f(x).sum(), np.array([v], np.float64))[0][0])


# activations.jl lines 7-36 (at 0), 38-67 (at 1), 69-98 (at -1): (name, f, f(0), f(1), f(-1))
KNOWN = [
    ("sigmoid", A.sigmoid, 0.5, 1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))),
    ("hardsigmoid", A.hardsigmoid, 0.5, 4 / 6, 2 / 6),
    ("hardtanh", A.hardtanh, 0.0, 1.0, -1.0),
    ("relu", A.relu, 0.0, 1.0, 0.0),
    ("leakyrelu", A.leakyrelu, 0.0, 1.0, -0.01),
    ("relu6", A.relu6, 0.0, 1.0, 0.0),
    ("elu", A.elu, 0.0, 1.0, math.exp(-1) - 1),
    ("gelu", A.gelu, 0.0, 0.8411919906082768, -0.15880800939172324),
    ("gelu_tanh", A.gelu_tanh, 0.0, 0.8411919906082768, -0.15880800939172324),
    ("gelu_sigmoid", A.gelu_sigmoid, 0.0, 0.8411919906082768, -0.15880800939172324),
    ("gelu_erf", A.gelu_erf, 0.0, 0.8413447460685429, -0.15865525393145707),
    ("swish", A.swish, 0.0, 1 / (1 + math.exp(-1)), -math.exp(-1) / (1 + math.exp(-1))),
    ("hardswish", A.hardswish, 0.0, 4 / 6, -2 / 6),
    ("lisht", A.lisht, 0.0, math.tanh(1.0), math.tanh(1.0)),
    ("softplus", A.softplus, math.log(2.0), math.log(math.e + 1), math.log(math.exp(-1) + 1)),
    ("softsign", A.softsign, 0.0, 0.5, -0.5),
    ("selu", A.selu, 0.0, SELU_L, SELU_L * SELU_A * (math.exp(-1) - 1)),
    ("celu", A.celu, 0.0, 1.0, math.exp(-1) - 1),
    ("trelu", A.trelu, 0.0, 0.0, 0.0),
    ("logcosh", A.logcosh, 0.0, math.log(math.cosh(1.0)), math.log(math.cosh(-1.0))),
    ("mish", A.mish, 0.0, math.tanh(math.log(1 + math.e)), -math.tanh(math.log(1 + math.exp(-1)))),
    ("tanhshrink", A.tanhshrink, 0.0, 0.23840584404423515, -0.23840584404423515),
    ("softshrink", A.softshrink, 0.0, 0.5, -0.5),
]
ALL = [(name, f) for name, f, *_ in KNOWN] + [("logsigmoid", A.logsigmoid), ("tanh", A.tanh)]


@pytest.mark.parametrize("name, f, y0, y1, ym1", KNOWN, ids=[k[0] for k in KNOWN])
def test_values_at_0_1_and_minus_1(name, f, y0, y1, ym1):
    # NNlib test/activations.jl:7-36, 38-67, 69-98
    got = (at(f, 0.0), at(f, 1.0), at(f, -1.0))
    assert got == pytest.approx((y0, y1, ym1), rel=1e-12, abs=1e-15), f"{name}(0, 1, -1): expected " \
        f"{(y0, y1, ym1)}, got {got}"


def test_softplus_large_arguments_and_smooth_origin():
    # NNlib test/activations.jl:24-30 (NNlib issue #671: softplus is smooth at 0, f' = 1/2, f'' = 1/4)
    assert at(A.softplus, 1e8) == pytest.approx(1e8)
    assert at(A.softplus, -1e8) == pytest.approx(0.0, abs=1e-300)
    assert grad_at(A.softplus, 0.0) == pytest.approx(0.5)
    h = fluxpy.hessian(lambda x: A.softplus(x).sum(), np.zeros(1))
    assert float(np.asarray(h).ravel()[0]) == pytest.approx(0.25), f"softplus''(0): expected 0.25, got {h}"


@pytest.mark.parametrize("name, f", ALL, ids=[n for n, _ in ALL])
def test_nan_propagation_and_infinities(name, f):
    # NNlib test/activations.jl:131-144: NaN in, NaN out; +Inf never NaN; -Inf never NaN
    # except for gelu*, swish, hardswish, logcosh, mish
    with np.errstate(invalid="ignore", over="ignore"):
        assert math.isnan(at(f, np.nan)), f"{name}(NaN) should be NaN"
        if name == "softsign":   # NNlib skips softsign for both infinities (Inf / Inf)
            return
        assert not math.isnan(at(f, np.inf)), f"{name}(Inf) is NaN"
        if name not in ("gelu", "gelu_tanh", "gelu_sigmoid", "gelu_erf", "swish", "hardswish", "logcosh", "mish"):
            assert not math.isnan(at(f, -np.inf)), f"{name}(-Inf) is NaN"


def test_float32_in_float32_out():
    # NNlib test/activations.jl:100-115 ("Float inference", Float32 part): the output keeps the input's float type
    x = np.array([-10, -1, 0, 1, 10], np.float32)
    for name, f in ALL:
        assert f(x).dtype == np.float32, f"{name}: expected float32 output, got {f(x).dtype}"


def test_named_cases():
    # NNlib test/activations.jl:169-174 (elu), 176-181 (mish), 183-188 (leakyrelu, relu6), 190-195 (celu),
    # 197-201 (softshrink), 211 (logcosh), 220 (hardtanh), 222 (lisht), 224-229 (trelu)
    assert at(A.elu, 42.0) == 42.0
    assert at(A.elu, -4.0) == pytest.approx(math.exp(-4) - 1)
    assert at(A.mish, -5.0) == pytest.approx(-0.033576237730161704)
    assert at(A.mish, 9.0) == pytest.approx(9 * math.tanh(math.log(1 + math.exp(9))))
    xs = np.array([[1, 2, 3], [1000, 2000, 3000]], np.float32)
    assert A.mish(xs).dtype == np.float32 and np.all(np.isfinite(A.mish(xs)))
    assert float(A.leakyrelu(np.array([0.4]), a=0.3)[0]) == pytest.approx(0.4)
    assert float(A.leakyrelu(np.array([-0.4]), a=0.3)[0]) == pytest.approx(-0.12)
    assert at(A.relu6, 10.0) == 6.0
    assert at(A.celu, 42.0) == 42.0
    assert float(A.celu(np.array([-4.0]), a=0.5)[0]) == pytest.approx(0.5 * (math.exp(-4.0 / 0.5) - 1))
    assert A.softshrink(np.array([15.0, 4.0, -15.0]), lam=5.0).tolist() == [10.0, 0.0, -10.0]
    assert at(A.logcosh, 1000.0) + math.log(2) == 1000.0
    assert at(A.hardtanh, 10.0) == 1.0
    assert at(A.lisht, 2.5) == 2.5 * math.tanh(2.5)
    assert [at(A.trelu, v) for v in (0.5, 1.0, 1.1)] == [0.0, 0.0, 1.1]
    assert float(A.trelu(np.array([0.9]), theta=0.5)[0]) == 0.9


def test_rrelu_bounds():
    # NNlib test/activations.jl:12, 43, 68 (rrelu(0) == 0, rrelu(1) == 1, -1/3 <= rrelu(-1) <= -1/8), 181
    assert at(A.rrelu, 0.0) == 0.0 and at(A.rrelu, 1.0) == 1.0
    ys = A.rrelu(-np.ones(10_000))
    assert ys.min() >= -1 / 3 and ys.max() <= -1 / 8 and len(np.unique(ys)) > 9_000   # a slope per element
    ys = A.rrelu(np.full(1000, -0.4), 0.25, 0.5)
    assert ys.min() >= -0.2 and ys.max() <= -0.1
    assert math.isnan(at(A.rrelu, np.nan)) and at(A.rrelu, np.inf) == np.inf and at(A.rrelu, -np.inf) == -np.inf
    assert A.rrelu(np.ones(3, np.float32)).dtype == np.float32


def test_gelu_erf_exact_values():
    # NNlib test/activations.jl:17, 48, 73 compare gelu_erf with ==; fluxpy's erf is within an ulp of those
    assert at(A.gelu_erf, 0.0) == 0.0
    assert at(A.gelu_erf, 1.0) == pytest.approx(0.8413447460685429, rel=2e-16)
    assert at(A.gelu_erf, -1.0) == pytest.approx(-0.15865525393145707, rel=2e-16)


def test_logsigmoid_and_hardsigmoid_saturate():
    # NNlib test/activations.jl:203-209 (logsigmoid), 213-218 (hardsigmoid), Float32 and Float64
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((10, 10))
    np.testing.assert_allclose(A.logsigmoid(xs), np.log(A.sigmoid(xs)), rtol=1e-12)
    for dt in (np.float32, np.float64):
        big = np.array([-100_000, 100_000], dt)
        np.testing.assert_allclose(A.logsigmoid(big), np.array([-100_000, 0], dt))
        np.testing.assert_allclose(A.hardsigmoid(big), np.array([0, 1], dt))
    assert at(A.hardsigmoid, 0.3) == max(0, min(1, 3.3 / 6))
    assert at(A.hardsigmoid, -0.3) == max(0, min(1, 2.7 / 6))


def test_zygote_issue_758_gradients_at_large_arguments():
    # NNlib test/activations.jl:411-417 (Zygote issue 758): no NaN from exp of large arguments
    g = fluxpy.gradient(lambda x: A.selu(x).sum(), np.array([1_000.0, 10_000.0]))[0]
    np.testing.assert_allclose(g, [1.0507009873554805] * 2, rtol=1e-8)
    g = fluxpy.gradient(lambda x: A.elu(x, a=2.0).sum(), np.array([1_000.0, 10_000.0]))[0]
    assert g.tolist() == [1.0, 1.0]
    assert float(fluxpy.gradient(lambda x: A.elu(x, a=2.0).sum(), np.array([-1.0]))[0][0]) == \
        pytest.approx(2 * math.exp(-1))


def test_elu_derivative_at_zero_is_one_as_nnlib():
    # NNlib src/activations.jl deriv_elu: ifelse(Ω ≥ 0, 1, Ω + α), so elu'(0) = 1 for any α (test/activations.jl:413
    # checks the x >= 0 branch). PyTorch gives α at 0; fluxpy follows NNlib (the kink's value, see elu's docstring).
    assert grad_at(lambda x: A.elu(x, a=2.0), 0.0) == 1.0
    assert grad_at(lambda x: A.celu(x, a=2.0), 0.0) == 1.0


@pytest.mark.parametrize("f", [A.hardsigmoid, A.hardtanh, A.relu6, A.hardswish],
                         ids=["hardsigmoid", "hardtanh", "relu6", "hardswish"])
def test_saturated_gradients(f):
    # NNlib test/activations.jl:420-430: the derivative in the clamped regions (0, or 1 for hardswish at +large)
    for v in (-50.0, 50.0, -7.0, 7.0):
        expected = 1.0 if (f is A.hardswish and v > 0) else 0.0
        assert grad_at(f, v) == pytest.approx(expected, abs=1e-12), f"{f.__name__}'({v}): expected {expected}"


@pytest.mark.parametrize("name, f", ALL, ids=[n for n, _ in ALL])
def test_gradient_away_from_kinks(name, f):
    # NNlib test/activations.jl:370-387 (gradtest at ±(2 + rand)): finite differences in float64
    from tests.gradcheck import check_grad
    rng = np.random.default_rng(17)
    check_grad(f, 2 + rng.random((2, 2)), rng=rng)
    check_grad(f, -2 - rng.random((2, 2)), rng=rng)


@pytest.mark.parametrize("name, f", [a for a in ALL if a[0] not in ("trelu",)], ids=lambda a: a if isinstance(a, str) else "")
def test_second_derivatives_via_both_modes(name, f):
    # NNlib test/activations.jl:434-445 (hessian forward-over-reverse vs reverse): here reverse-over-reverse vs the
    # tape's finite-difference check, at the same points x .+ 0.1, x = [-0.9, -0.2, 0.1, 0.3, 1.2]
    from tests.gradcheck import check_second_order
    x = np.array([-0.9, -0.2, 0.1, 0.3, 1.2]) + 0.1
    check_second_order(lambda z: f(z) ** 2, x, rng=np.random.default_rng(0))


def test_against_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x = np.array([-1e3, -10.0, -3.0, -1.0, -0.3, 0.0, 0.3, 1.0, 3.0, 10.0, 1e3])
    t = torch.tensor(x)
    pairs = [(A.selu, F.selu), (A.celu, F.celu), (A.hardsigmoid, F.hardsigmoid), (A.hardswish, F.hardswish),
             (A.softsign, F.softsign), (A.mish, F.mish), (A.tanhshrink, F.tanhshrink), (A.softshrink, F.softshrink),
             (A.logsigmoid, F.logsigmoid), (A.elu, F.elu), (A.relu6, F.relu6),
             (A.gelu_sigmoid, lambda z: F.gelu(z, approximate="tanh"))]
    for ours, theirs in pairs:
        np.testing.assert_allclose(ours(x), theirs(t).numpy(), rtol=1e-12, atol=1e-12, err_msg=str(theirs))
