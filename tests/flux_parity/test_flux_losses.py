"""Flux.jl's ``test/losses.jl`` known-answer cases (FluxML/Flux.jl at 3f2f828), in fluxpy.

Flux's classification losses sum over ``dims=1`` of a ``(classes, batch)`` matrix; fluxpy's over the last axis of
``(batch, classes)``: the same bytes, so a Julia matrix enters transposed (``J(...)``). Elementwise losses (mse, mae,
huber, msle, hinge, poisson, binary focal, siamese) and the whole-array ones (dice, tversky) do not care about the
layout. ``onehotbatch([1, 1, 0, 0], 0:1)`` is ``(classes=2, batch=4)`` in Flux, ``(4, 2)`` here.

Where fluxpy differs on purpose: its probability losses check their inputs' values (``ŷ`` and ``y`` in [0, 1], see
``fluxpy.losses``); Flux's ``kldivergence([4 5 6], [1 2 3])`` is such a case, reproduced with the checks off.
Not translated: complex inputs (``mse(0 + 0im, 1 + 1im)``), ``@inferred``.
"""
import math

import numpy as np
import pytest

import fluxpy
from fluxpy import losses as L
from fluxpy import sigmoid, softmax


def J(rows, dtype=np.float64):
    """A Julia matrix literal, as fluxpy lays out the same bytes: transposed."""
    return np.array(rows, dtype).T


def onehot(labels, classes):
    """Flux's ``onehotbatch(labels, classes)`` in fluxpy's layout, ``(batch, classes)``."""
    return (np.asarray(labels)[:, None] == np.asarray(classes)[None, :]).astype(np.float64)


def test_xlogx_xlogy():
    # Flux losses.jl:2-16
    assert float(L.xlogx(np.array(0.0))) == 0.0
    assert math.isnan(float(L.xlogx(np.array(np.nan))))
    assert float(L.xlogx(np.array(2.0))) == pytest.approx(2 * math.log(2))
    assert float(L.xlogy(np.array(0.0), np.array(1.0))) == 0.0
    with np.errstate(invalid="ignore"):
        for a, b in ((np.nan, 1.0), (1.0, np.nan), (np.nan, np.nan)):
            assert math.isnan(float(L.xlogy(np.array(a), np.array(b)))), f"xlogy({a}, {b}) should be NaN"
    assert float(L.xlogy(np.array(2.0), np.array(3.0))) == pytest.approx(2 * math.log(3))


# Flux losses.jl:19-20: regression-style targets
Y_REG, YHAT_REG = np.array([1.0, 1, 0, 0]), np.array([0.9, 0.1, 0.1, 0.9])


def test_regression_losses():
    # Flux losses.jl:22-41
    assert float(L.mse(YHAT_REG, Y_REG)) == pytest.approx((0.1 ** 2 + 0.9 ** 2) / 2)
    assert float(L.mae(YHAT_REG, Y_REG)) == pytest.approx(0.5)
    assert float(L.huber_loss(YHAT_REG, Y_REG)) == pytest.approx(0.20500000000000002)
    assert float(L.msle(np.array([345.0, 332.0, 789.0]), np.array([123.0, 456.0, 789.0]))) == \
        pytest.approx(0.38813985859136585)


# Flux losses.jl:44-55
Y = onehot([1, 1, 0, 0], [0, 1])
YHAT = J([[0.1, 0.9], [0.9, 0.1], [0.9, 0.1], [0.1, 0.9]]).T   # Flux's `[...]'`: (classes, batch) is its adjoint
V = math.log(0.1 / 0.9)
LOGYHAT = J([[V, 0.0], [0.0, V], [0.0, V], [V, 0.0]]).T
LOSSVALUE, LOSSVALUE_SMOOTHED = 1.203972804325936, 1.2039728043259348
YL = onehot([1], [0, 1])
SF = 0.1
YLS = np.array([[SF, 1 - SF]])
YLP = np.array([[0.9, 0.1]])
LOGYLP = np.array([[0.0, V]])
# Flux losses.jl:60-65: similar and dissimilar predictions
YA = onehot([1, 1, 1, 0, 0], [0, 1])
Y_SAME = YA.copy()
Y_SIM = Y_SAME * (1 - 2 * SF) + SF
Y_DIS = Y_SIM[:, ::-1].copy()


def test_crossentropy():
    # Flux losses.jl:67-77
    assert float(L.crossentropy(np.array([0.1, 0.0, 0.9]), np.array([0.1, 0.0, 0.9]))) == \
        pytest.approx(float(L.crossentropy(np.array([0.1, 0.9]), np.array([0.1, 0.9]))))
    assert float(L.crossentropy(YHAT, Y)) == pytest.approx(LOSSVALUE)
    assert float(L.crossentropy(YHAT, L.label_smoothing(Y, 0.1))) == pytest.approx(LOSSVALUE_SMOOTHED)
    assert float(L.crossentropy(YLP, L.label_smoothing(YL, 2 * SF))) == pytest.approx(-(YLS * np.log(YLP)).sum())
    assert float(L.crossentropy(YLP, YL)) == pytest.approx(-(YL * np.log(YLP)).sum())
    assert float(L.crossentropy(Y_SAME, YA, eps=0)) == 0
    assert float(L.crossentropy(YA, YA, eps=0)) == 0
    ya_smoothed = L.label_smoothing(YA, 2 * SF)
    assert float(L.crossentropy(Y_SIM, YA)) < float(L.crossentropy(Y_SIM, ya_smoothed))
    assert float(L.crossentropy(Y_DIS, YA)) > float(L.crossentropy(Y_DIS, ya_smoothed))


def test_logitcrossentropy():
    # Flux losses.jl:79-83
    assert float(L.logitcrossentropy(LOGYHAT, Y)) == pytest.approx(LOSSVALUE)
    lsm = LOGYLP - np.log(np.exp(LOGYLP).sum(axis=-1, keepdims=True))
    assert float(L.logitcrossentropy(LOGYLP, YL)) == pytest.approx(-(YL * lsm).sum())
    assert float(L.logitcrossentropy(LOGYLP, L.label_smoothing(YL, 2 * SF))) == pytest.approx(-(YLS * lsm).sum())
    # fluxpy's label_smoothing keyword is the same smoothing
    assert float(L.logitcrossentropy(LOGYLP, YL, label_smoothing=2 * SF)) == pytest.approx(-(YLS * lsm).sum())


def test_binarycrossentropy():
    # Flux losses.jl:85-93
    rng = np.random.default_rng(0)
    logyhat, y = rng.standard_normal(3), rng.random(3)
    yls = y * (1 - 2 * SF) + SF
    p = sigmoid(logyhat)
    expected = -yls * np.log(p) - (1 - yls) * np.log(1 - p)
    got = L.binarycrossentropy(p, L.label_smoothing(y, 2 * SF, axis=None), eps=0, agg=lambda v: v)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert float(L.binarycrossentropy(p, y, eps=0)) == pytest.approx(np.mean(-y * np.log(p) - (1 - y) * np.log(1 - p)))
    e = np.finfo(np.float64).eps
    assert float(L.binarycrossentropy(p, y)) == \
        pytest.approx(np.mean(-y * np.log(p + e) - (1 - y) * np.log(1 - p + e)))
    # a constant label (Flux accepts a number for y; so does fluxpy)
    assert float(L.binarycrossentropy(np.array([0.1, 0.2, 0.9]), 1)) == pytest.approx(-np.mean(np.log([0.1, 0.2, 0.9])))


def test_logitbinarycrossentropy():
    # Flux losses.jl:95-98
    rng = np.random.default_rng(0)
    logyhat, y = rng.standard_normal(3), rng.random(3)
    ys = L.label_smoothing(y, 0.2, axis=None)
    np.testing.assert_allclose(L.logitbinarycrossentropy(logyhat, ys, agg=lambda v: v),
                               L.binarycrossentropy(sigmoid(logyhat), ys, eps=0, agg=lambda v: v), rtol=1e-12)
    assert float(L.logitbinarycrossentropy(logyhat, y)) == \
        pytest.approx(float(L.binarycrossentropy(sigmoid(logyhat), y, eps=0)))


def test_label_smoothing():
    # Flux losses.jl:100-107 (dims=0 is fluxpy's axis=None; α outside (0, 1) is an error)
    np.testing.assert_allclose(L.label_smoothing(onehot([1], [0, 1]), 0.2), [[0.1, 0.9]])
    for bad in (1.2, 0.0):
        with pytest.raises(ValueError, match="label_smoothing: alpha must lie in"):
            L.label_smoothing(np.array([0.0, 0.0, 1.0, 0.0]), bad)


def test_kldivergence():
    # Flux losses.jl:109-116. Flux's y = [1 2 3] is (classes=1, batch=3): fluxpy's (3, 1)
    assert float(L.kldivergence(np.array([0.1, 0.0, 0.9]), np.array([0.1, 0.0, 0.9]))) == \
        pytest.approx(float(L.kldivergence(np.array([0.1, 0.9]), np.array([0.1, 0.9]))))
    y, yhat = np.array([[1.0, 2.0, 3.0]]).T, np.array([[4.0, 5.0, 6.0]]).T
    # fluxpy's deliberate difference: values outside [0, 1] are not probabilities, and the loss says so
    with pytest.raises(ValueError, match=r"kldivergence expects ŷ in \[0, 1\] \(probabilities\)"):
        L.kldivergence(yhat, y)
    with fluxpy.options(value_checks=False):
        assert float(L.kldivergence(yhat, y)) == pytest.approx(-1.7661057888493457)
        assert float(L.kldivergence(y, y)) == pytest.approx(0.0, abs=1e-12)


def test_hinge_losses():
    # Flux losses.jl:118-129
    y, yhat = np.array([1.0, 2, 3, 4]), np.array([5.0, 6, 7, 8])
    assert float(L.hinge_loss(yhat, y)) == pytest.approx(0)
    assert float(L.hinge_loss(y, 0.5 * y)) == pytest.approx(0.125)
    assert float(L.squared_hinge_loss(yhat, y)) == pytest.approx(0)
    assert float(L.squared_hinge_loss(y, 0.5 * y)) == pytest.approx(0.0625)


def test_poisson_loss():
    # Flux losses.jl:131-137
    y, yhat = np.array([0.1, 0.2, 0.3]), np.array([0.4, 0.5, 0.6])
    assert float(L.poisson_loss(yhat, y)) == pytest.approx(0.6278353988097339)
    assert float(L.poisson_loss(y, y)) == pytest.approx(0.5044459776946685)


def test_dice_and_tversky():
    # Flux losses.jl:139-151
    y, yhat = np.array([1.0, 0.5, 0.3, 2.4]), np.array([0.0, 1.4, 0.5, 1.2])
    assert float(L.dice_coeff_loss(yhat, y)) == pytest.approx(0.2799999999999999)
    assert float(L.dice_coeff_loss(y, y)) == pytest.approx(0.0, abs=1e-15)
    assert float(L.tversky_loss(yhat, y)) == pytest.approx(-0.06772009029345383)
    assert float(L.tversky_loss(yhat, y, beta=0.8)) == pytest.approx(-0.09490740740740744)
    assert float(L.tversky_loss(y, y)) == pytest.approx(-0.5576923076923075)


ALL_LOSSES = [L.mse, L.mae, L.huber_loss, L.msle, L.crossentropy, L.logitcrossentropy, L.binarycrossentropy,
              L.logitbinarycrossentropy, L.kldivergence, L.poisson_loss, L.hinge_loss, L.squared_hinge_loss,
              L.dice_coeff_loss, L.tversky_loss, L.binary_focal_loss, L.focal_loss, L.siamese_contrastive_loss]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("f", ALL_LOSSES, ids=lambda f: f.__name__)
def test_no_spurious_promotions(f, dtype):
    # Flux losses.jl:153-163: a loss of float32 arrays is float32, and so is its gradient
    rng = np.random.default_rng(1)
    yhat, y = rng.random(2).astype(dtype), rng.random(2).astype(dtype)
    loss, back = fluxpy.pullback(lambda a: f(a, y), yhat)
    g = back(np.ones((), dtype))[0]
    assert np.asarray(loss).dtype == dtype and g.dtype == dtype, \
        f"{f.__name__}: expected {np.dtype(dtype)} loss and gradient, got {np.asarray(loss).dtype} and {g.dtype}"


def test_binary_focal_loss():
    # Flux losses.jl:165-178 (elementwise, so the Julia layout does not matter)
    y = np.array([[0, 1, 0], [1, 0, 1]], np.float64)
    yhat = np.array([[0.268941, 0.5, 0.268941], [0.731059, 0.5, 0.731059]])
    y1, yhat1 = np.array([[1, 0], [0, 1]], np.float64), np.array([[0.6, 0.3], [0.4, 0.7]])
    assert float(L.binary_focal_loss(yhat, y)) == pytest.approx(0.0728675615927385)
    assert float(L.binary_focal_loss(yhat1, y1)) == pytest.approx(0.05691642237852222)
    assert float(L.binary_focal_loss(yhat, y, gamma=0.0)) == pytest.approx(float(L.binarycrossentropy(yhat, y)))


def test_focal_loss():
    # Flux losses.jl:180-194: ŷ = softmax(reshape(-7:7, 3, 5)) over the 3 classes, fluxpy's (5, 3)
    y = J([[1, 0, 0, 0, 1], [0, 1, 0, 1, 0], [0, 0, 1, 0, 0]])
    yhat = softmax(np.arange(-7, 8, dtype=np.float32).reshape(5, 3))
    y1 = J([[1, 0], [0, 0], [0, 1]])
    yhat1 = J([[0.4, 0.2], [0.5, 0.5], [0.1, 0.3]])
    # the literal was computed in Float32 arithmetic (Int * Float32 in Julia); fluxpy promotes to float64 here
    assert float(L.focal_loss(yhat, y)) == pytest.approx(1.1277571935622628, rel=1e-5)
    assert float(L.focal_loss(yhat1, y1)) == pytest.approx(0.45990566879720157)
    assert float(L.focal_loss(yhat, y, gamma=0)) == pytest.approx(float(L.crossentropy(yhat, y)), rel=1e-6)


def test_siamese_contrastive_loss():
    # Flux losses.jl:196-231 (elementwise)
    y = J([[1, 0], [0, 0], [0, 1]])
    yhat = J([[0.4, 0.2], [0.5, 0.5], [0.1, 0.3]])
    y1 = J([[1, 0, 0, 0, 1], [0, 1, 0, 1, 0], [0, 0, 1, 0, 0]])
    yhat1 = softmax(np.arange(-7, 8, dtype=np.float32).reshape(5, 3))
    y2, yhat2 = np.array([1.0, 0, 0, 1, 1]), np.array([0.6, 0.4, 0.1, 0.2, 0.7])
    f = L.siamese_contrastive_loss
    assert float(f(yhat, y)) == pytest.approx(0.2333333333333333)
    assert float(f(yhat, y, margin=0.5)) == pytest.approx(0.10000000000000002)
    assert float(f(yhat, y, margin=1.5)) == pytest.approx(0.5333333333333333)
    assert float(f(yhat1, y1)) == pytest.approx(0.32554644, rel=1e-6)
    assert float(f(yhat1, y1, margin=0.5)) == pytest.approx(0.16271012, rel=1e-6)
    assert float(f(yhat1, y1, margin=1.5)) == pytest.approx(0.6532292, rel=1e-6)
    assert float(f(yhat, y, margin=1)) == pytest.approx(float(f(yhat, y)))
    assert float(f(y, y)) == 0.0 and float(f(y1, y1)) == 0.0
    assert float(f(yhat, y, margin=0)) == pytest.approx(0.09166666666666667)
    assert float(f(yhat1, y1, margin=0)) == pytest.approx(0.13161165, rel=1e-6)
    assert float(f(yhat2, y2)) == pytest.approx(0.21200000000000005)
    assert float(f(yhat2, yhat2)) == pytest.approx(0.18800000000000003)
    for bad in (-0.5, -1):
        with pytest.raises(ValueError, match="siamese_contrastive_loss expects margin >= 0"):
            f(yhat1, y1, margin=bad)


def test_against_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    t = torch.tensor
    assert float(L.huber_loss(YHAT_REG, Y_REG)) == pytest.approx(float(F.huber_loss(t(YHAT_REG), t(Y_REG))))
    assert float(L.logitcrossentropy(LOGYHAT, Y)) == pytest.approx(float(F.cross_entropy(t(LOGYHAT), t(Y))))
    assert float(L.logitcrossentropy(LOGYHAT, Y, label_smoothing=0.2)) == \
        pytest.approx(float(F.cross_entropy(t(LOGYHAT), t(Y), label_smoothing=0.2)))
    y, yhat = np.array([0.1, 0.2, 0.3]), np.array([0.4, 0.5, 0.6])
    assert float(L.poisson_loss(yhat, y)) == pytest.approx(float(F.poisson_nll_loss(t(yhat), t(y), log_input=False,
                                                                                     eps=0.0)), rel=1e-12)
    y, yhat = np.array([1.0, -1.0, 1.0]), np.array([0.3, 0.2, 2.0])
    assert float(L.hinge_loss(yhat, y)) == pytest.approx(float(torch.clamp(1 - t(yhat) * t(y), min=0).mean()))
    # PyTorch's kl_div(input=log ŷ, target=y) is fluxpy's kldivergence(ŷ, y) with eps=0, summed per row
    p, q = np.array([[0.2, 0.8], [0.5, 0.5]]), np.array([[0.3, 0.7], [0.9, 0.1]])
    assert float(L.kldivergence(q, p, eps=0.0)) == pytest.approx(float(F.kl_div(t(np.log(q)), t(p),
                                                                                reduction="batchmean")))
