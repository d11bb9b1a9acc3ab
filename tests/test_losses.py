"""Losses: Flux's formulas written out, gradients by finite differences, torch agreement, errors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import losses as L
from gradcheck import check_grad
from strategies import shapes

seeds = st.integers(0, 2**31 - 1)
AGGS = {"mean": None, "sum": sum, "np.sum": np.sum, "none": lambda l: l}


def softmax_rows(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def one_hot(rng, batch, classes):
    return np.eye(classes)[rng.integers(0, classes, batch)]


def call(loss, yhat, y, agg, **kw):
    return loss(yhat, y, **kw) if agg is None else loss(yhat, y, agg=agg, **kw)


def unchecked():
    """Finite differences step just outside [0, 1] at the boundary: no value checks while they run."""
    return fluxpy.options(value_checks=False)


def reduce(values, agg):
    return values.mean() if agg is None else (values if agg is AGGS["none"] else values.sum())


# Flux's definitions with NumPy, for a batch of shape (batch, classes); unreduced.
def flux_reference(name, yhat, y, **kw):
    eps = kw.get("eps", np.finfo(np.float64).eps)
    if name == "mse":
        return (yhat - y) ** 2
    if name == "mae":
        return np.abs(yhat - y)
    if name == "huber_loss":
        d, delta = np.abs(yhat - y), kw.get("delta", 1.0)
        return np.where(d < delta, 0.5 * d ** 2, delta * (d - 0.5 * delta))
    if name == "crossentropy":
        return -np.sum(xlogy(y, yhat + eps), axis=-1)
    if name == "logitcrossentropy":
        z = yhat - yhat.max(-1, keepdims=True)
        return -np.sum(y * (z - np.log(np.exp(z).sum(-1, keepdims=True))), axis=-1)
    if name == "binarycrossentropy":
        return -xlogy(y, yhat + eps) - xlogy(1 - y, 1 - yhat + eps)
    if name == "logitbinarycrossentropy":
        return (1 - y) * yhat - np.log(sigmoid(yhat))
    if name == "kldivergence":
        raise AssertionError("kldivergence is checked separately")


def xlogy(x, y):
    return np.where(x == 0, 0.0, x * np.log(np.where(x == 0, 1.0, y)))


def predictions(name, rng, shape):
    z = rng.standard_normal(shape)
    if name == "crossentropy":
        return softmax_rows(z)
    if name == "binarycrossentropy":
        return sigmoid(z)
    return z


def targets(name, rng, shape):
    if name in ("crossentropy", "logitcrossentropy"):
        return one_hot(rng, shape[0], shape[1]) if len(shape) == 2 else softmax_rows(rng.standard_normal(shape))
    if name in ("binarycrossentropy", "logitbinarycrossentropy"):
        return rng.uniform(0, 1, shape)
    return rng.standard_normal(shape)


NAMES = ["mse", "mae", "huber_loss", "crossentropy", "logitcrossentropy", "binarycrossentropy",
         "logitbinarycrossentropy"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("agg", sorted(AGGS))
@given(shape=shapes(1, 3, 1, 5), seed=seeds)
def test_values_and_gradients(name, agg, shape, seed):
    rng = np.random.default_rng(seed)
    loss, agg = getattr(L, name), AGGS[agg]
    yhat, y = predictions(name, rng, shape), targets(name, rng, shape)
    if name in ("mae", "huber_loss"):  # stay off the kinks |ŷ - y| = 0 and = delta
        d = yhat - y
        d = np.where(np.abs(d) < 0.05, 0.05, d)
        d = np.where(np.abs(np.abs(d) - 1) < 0.05, 1.1 * np.sign(d), d)
        yhat = y + d
    expected = reduce(flux_reference(name, yhat, y), agg)
    np.testing.assert_allclose(call(loss, yhat, y, agg), expected, rtol=1e-10, atol=1e-12)
    with unchecked():
        check_grad(lambda yhat: call(loss, yhat, y, agg), yhat, rng=rng, rtol=1e-5)


@given(shape=shapes(1, 3, 1, 5), seed=seeds)
def test_kldivergence(shape, seed):
    rng = np.random.default_rng(seed)
    yhat, y = softmax_rows(rng.standard_normal(shape)), softmax_rows(rng.standard_normal(shape))
    y[..., 0] = 0.0  # a zero target: 0 log 0 = 0
    eps = np.finfo(np.float64).eps
    expected = np.mean(np.sum(np.where(y > 0, y * np.log(np.where(y > 0, y, 1)), 0), -1)) + \
        np.mean(-np.sum(y * np.log(yhat + eps), -1))
    np.testing.assert_allclose(L.kldivergence(yhat, y), expected, rtol=1e-10, atol=1e-13)
    assert float(L.kldivergence(y, y, eps=0.0)) == pytest.approx(0.0, abs=1e-12)
    g, = fluxpy.gradient(lambda p: L.kldivergence(p, y, eps=0.0), y)  # ŷ = 0 where y = 0: still finite
    assert np.all(np.isfinite(g))
    with unchecked():
        check_grad(lambda yhat: L.kldivergence(yhat, y), yhat, rng=rng, rtol=1e-5)
    g, = fluxpy.gradient(lambda y: L.kldivergence(yhat, y), y)
    assert np.all(np.isfinite(g))


def test_flux_conventions():
    rng = np.random.default_rng(0)
    logits, y = rng.standard_normal((8, 5)), one_hot(rng, 8, 5)
    # Sum over classes, mean over the batch; logitcrossentropy = crossentropy after softmax.
    per_sample = -np.sum(y * np.log(softmax_rows(logits)), -1)
    assert float(L.logitcrossentropy(logits, y)) == pytest.approx(per_sample.mean(), rel=1e-12)
    assert float(L.crossentropy(softmax_rows(logits), y, eps=0.0)) == pytest.approx(per_sample.mean(), rel=1e-12)
    np.testing.assert_allclose(L.logitcrossentropy(logits, y, agg=lambda l: l), per_sample, rtol=1e-12)
    assert float(L.logitbinarycrossentropy(logits, y)) == pytest.approx(
        float(L.binarycrossentropy(sigmoid(logits), y, eps=0.0)), rel=1e-12)
    # eps defaults to the machine epsilon of ŷ's type (Flux's epseltype).
    p = np.array([[0.0, 1.0]], dtype=np.float32)
    assert float(L.crossentropy(p, np.array([[1.0, 0.0]], dtype=np.float32))) == pytest.approx(
        -np.log(np.finfo(np.float32).eps), rel=1e-6)


def test_targets_may_be_integer_one_hot_and_float32_stays_float32():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 3)).astype(np.float32)
    y_int = np.eye(3, dtype=np.int64)[[0, 1, 2, 0]]
    for loss in (L.logitcrossentropy, L.crossentropy, L.mse, L.binarycrossentropy, L.logitbinarycrossentropy,
                 L.kldivergence, L.mae, L.huber_loss):
        yhat = softmax_rows(logits) if loss in (L.crossentropy, L.kldivergence, L.binarycrossentropy) else logits
        value, (g,) = fluxpy.withgradient(lambda z: loss(z, y_int), yhat)
        assert value.dtype == g.dtype == np.float32, loss.__name__
        assert float(value) == pytest.approx(float(loss(yhat.astype(np.float64), y_int.astype(float))), rel=1e-5)
    assert float(L.logitcrossentropy(logits, y_int.astype(bool))) == pytest.approx(
        float(L.logitcrossentropy(logits, y_int)))


def test_stable_for_extreme_logits():
    logits = np.array([[1e4, -1e4], [-1e4, 1e4]])
    y = np.array([[1.0, 0.0], [1.0, 0.0]])
    assert float(L.logitcrossentropy(logits, y)) == pytest.approx(1e4)
    np.testing.assert_allclose(L.logitbinarycrossentropy(logits, y, agg=lambda l: l), [[0, 0], [1e4, 1e4]])
    g, = fluxpy.gradient(lambda z: L.logitbinarycrossentropy(z, y), logits)
    assert np.all(np.isfinite(g))


def test_label_smoothing():
    y = np.eye(4)[[1, 3]]
    np.testing.assert_allclose(L.label_smoothing(y, 0.2), y * 0.8 + 0.05)
    np.testing.assert_allclose(L.label_smoothing(y, 0.2, axis=0), y * 0.8 + 0.1)
    np.testing.assert_allclose(L.label_smoothing(np.array([0.0, 1.0]), 0.1, axis=None), [0.05, 0.95])
    for alpha in (0, 1, -0.5, 2):
        with pytest.raises(ValueError, match="label_smoothing: alpha must lie in"):
            L.label_smoothing(y, alpha)


def test_huber_delta():
    d = np.array([0.5, 1.5, -3.0])
    np.testing.assert_allclose(L.huber_loss(d, np.zeros(3), delta=2.0, agg=lambda l: l), [0.125, 1.125, 4.0])


def test_matches_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(2)
    logits, y = rng.standard_normal((16, 7)), one_hot(rng, 16, 7)
    soft = softmax_rows(rng.standard_normal((16, 7)))
    probs, bin_y = sigmoid(rng.standard_normal((16, 7))), rng.uniform(0, 1, (16, 7))
    t = torch.tensor

    def compare(ours, theirs, *arrays):
        tensors = [t(a, requires_grad=True) for a in arrays]
        out = theirs(*tensors)
        out.backward()
        value, grads = fluxpy.withgradient(ours, *arrays)
        assert float(value) == pytest.approx(out.item(), rel=1e-10)
        for g, tt in zip(grads, tensors):
            np.testing.assert_allclose(g, tt.grad.numpy(), rtol=1e-9, atol=1e-12)

    compare(lambda a, b: L.mse(a, b), F.mse_loss, logits, soft)
    compare(lambda a, b: L.mse(a, b, agg=sum), lambda a, b: F.mse_loss(a, b, reduction="sum"), logits, soft)
    compare(lambda a, b: L.mae(a, b), F.l1_loss, logits, soft)
    compare(lambda a, b: L.huber_loss(a, b, delta=0.7), lambda a, b: F.huber_loss(a, b, delta=0.7), logits, soft)
    compare(lambda a: L.logitcrossentropy(a, y), lambda a: F.cross_entropy(a, t(y)), logits)
    compare(lambda a: L.logitcrossentropy(a, soft), lambda a: F.cross_entropy(a, t(soft)), logits)
    compare(lambda a: L.logitcrossentropy(a, L.label_smoothing(y, 0.1)),
            lambda a: F.cross_entropy(a, t(y.argmax(-1)), label_smoothing=0.1), logits)
    idx = y.argmax(-1)
    compare(lambda a: L.logitcrossentropy(a, idx), lambda a: F.cross_entropy(a, t(idx)), logits)
    compare(lambda a: L.logitcrossentropy(a, idx, agg=sum), lambda a: F.cross_entropy(a, t(idx), reduction="sum"),
            logits)
    compare(lambda a: L.logitcrossentropy(a, idx, label_smoothing=0.1),
            lambda a: F.cross_entropy(a, t(idx), label_smoothing=0.1), logits)
    compare(lambda a: L.logitcrossentropy(a, y, label_smoothing=0.1),
            lambda a: F.cross_entropy(a, t(idx), label_smoothing=0.1), logits)
    compare(lambda a: L.binarycrossentropy(a, bin_y, eps=0.0), lambda a: F.binary_cross_entropy(a, t(bin_y)), probs)
    compare(lambda a: L.logitbinarycrossentropy(a, bin_y),
            lambda a: F.binary_cross_entropy_with_logits(a, t(bin_y)), logits)
    # torch's kl_div takes log-probabilities; "batchmean" is Flux's sum over classes, mean over the batch.
    compare(lambda a: L.kldivergence(a, soft, eps=0.0),
            lambda a: F.kl_div(torch.log(a), t(soft), reduction="batchmean"), softmax_rows(logits))


@pytest.mark.parametrize("name", NAMES + ["kldivergence"])
def test_shape_errors_name_the_loss(name):
    with pytest.raises(ValueError, match=rf"^{name} expects ŷ and y of the same shape, got \(4, 3\) and \(3, 4\)$"):
        getattr(L, name)(np.ones((4, 3)), np.ones((3, 4)))


def test_class_index_targets_get_a_hint():
    for name in ("crossentropy", "kldivergence"):
        with pytest.raises(ValueError, match=rf"{name} expects ŷ and y of the same shape, got \(128, 10\) and "
                                             r"\(128,\); y looks like class indices: one-hot encode it along the last "
                                             r"axis \(fluxpy.onehotbatch\), or pass logits to logitcrossentropy"):
            getattr(L, name)(np.full((128, 10), 0.1), np.zeros(128, dtype=np.int64))
    # logitcrossentropy takes them (PyTorch's cross_entropy(logits, target)).
    assert float(L.logitcrossentropy(np.zeros((128, 10)), np.zeros(128, dtype=np.int64))) == pytest.approx(np.log(10))


@given(n=st.integers(1, 6), c=st.integers(2, 9), masked=st.floats(0.1, 0.9), seed=st.integers(0, 2**31 - 1),
       form=st.sampled_from(["labels", "onehot", "one example", "3-d"]))
def test_masked_logits_give_the_loss_of_the_classes_left(n, c, masked, seed, form):
    """A class whose logit is -inf (masked) and that holds no target mass adds nothing to the loss, as in PyTorch:
    the loss and its gradient are those of the problem without the masked classes (their gradient 0)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, c))
    labels = rng.integers(0, c, n)
    mask = rng.random((n, c)) < masked
    mask[np.arange(n), labels] = False
    x = np.where(mask, -np.inf, logits)
    y = np.eye(c)[labels]
    if form == "labels":
        f = lambda z: L.logitcrossentropy(z, labels)
    elif form == "onehot":
        f = lambda z: L.logitcrossentropy(z, y)
    elif form == "one example":
        x, y = x[0], y[0]
        f = lambda z: L.logitcrossentropy(z, y)
    else:
        x, y = x[None], y[None]
        f = lambda z: L.logitcrossentropy(z, y)
    loss, (g,) = fluxpy.withgradient(f, x)
    rows = x.reshape(-1, c)
    targets = np.eye(c)[labels] if form == "labels" else np.reshape(y, (-1, c))
    expected = np.mean([np.log(np.exp(r[k]).sum()) - r[k][np.argmax(t[k])]
                        for r, k, t in zip(rows, ~np.isneginf(rows), targets)])
    np.testing.assert_allclose(float(loss), expected, rtol=1e-12, atol=1e-15)
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[np.isneginf(x)] == 0)


def test_a_target_on_a_masked_class_is_an_infinite_loss():
    x = np.array([[0.0, -np.inf, 1.0]])
    assert float(L.logitcrossentropy(x, np.array([1]))) == np.inf


def _torch_cross_entropy(logits, labels, weight, ignore_index, alpha):
    """PyTorch's ``cross_entropy(logits, labels, weight, ignore_index=..., label_smoothing=alpha)``, mean reduction,
    transcribed in float64 (its documented formula)."""
    n, c = logits.shape
    w = np.ones(c) if weight is None else weight
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - \
        logits.max(1, keepdims=True)
    total = denominator = 0.0
    for i in range(n):
        if ignore_index is not None and labels[i] == ignore_index:
            continue
        total += -(1 - alpha) * w[labels[i]] * logp[i, labels[i]] - alpha / c * (w * logp[i]).sum()
        denominator += w[labels[i]]
    return total / denominator


@given(n=st.integers(1, 7), c=st.integers(2, 6), weighted=st.booleans(), ignore=st.sampled_from([None, -100, 0]),
       alpha=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**31 - 1))
def test_class_weights_and_ignore_index_follow_pytorch(n, c, weighted, ignore, alpha, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, c))
    labels = rng.integers(0, c, n)
    if ignore is not None:
        labels[rng.random(n) < 0.3] = ignore
        labels[0] = 1   # one kept example at least
    weight = rng.uniform(0.1, 3.0, c) if weighted else None
    got = L.logitcrossentropy(logits, labels, weight=weight, ignore_index=ignore, label_smoothing=alpha)
    np.testing.assert_allclose(float(got), _torch_cross_entropy(logits, labels, weight, ignore, alpha), rtol=1e-12)
    check_grad(lambda z: L.logitcrossentropy(z, labels, weight=weight, ignore_index=ignore, label_smoothing=alpha),
               logits, rng=rng)


def test_class_weights_on_probability_targets_and_other_aggregations():
    rng = np.random.default_rng(0)
    logits, y = rng.standard_normal((4, 3)), rng.dirichlet(np.ones(3), 4)
    w = np.array([0.5, 2.0, 1.0])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    np.testing.assert_allclose(float(L.logitcrossentropy(logits, y, weight=w)), (-(w * y * logp).sum(1)).mean(),
                               rtol=1e-12)
    rows = L.logitcrossentropy(logits, np.array([0, 2, -1, 1]), ignore_index=-1, agg=lambda l: l)
    assert rows.shape == (4,) and rows[2] == 0 and np.all(rows[[0, 1, 3]] > 0)


def test_bad_weight_and_ignore_index_are_named():
    logits = np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"weight, a \(3,\) array of class weights"):
        L.logitcrossentropy(logits, np.array([0, 1]), weight=np.ones(2))
    with pytest.raises(TypeError, match="ignore_index to be an int"):
        L.logitcrossentropy(logits, np.array([0, 1]), ignore_index=1.5)
    with pytest.raises(ValueError, match="ignore_index applies to class-index targets"):
        L.logitcrossentropy(logits, np.eye(3)[[0, 1]], ignore_index=0)


@given(n=st.integers(1, 3), c=st.integers(2, 4), h=st.integers(1, 3), w=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1), form=st.sampled_from(["labels", "probabilities"]))
def test_the_class_axis_of_segmentation_logits(n, c, h, w, seed, form):
    """``axis=1`` on ``(N, C, H, W)`` logits is the loss of the same logits with the classes moved last."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n, c, h, w))
    y = rng.integers(0, c, (n, h, w)) if form == "labels" else rng.dirichlet(np.ones(c), (n, h, w)).transpose(0, 3, 1, 2)
    moved_y = y if form == "labels" else y.transpose(0, 2, 3, 1)
    want = L.logitcrossentropy(logits.transpose(0, 2, 3, 1), moved_y)
    np.testing.assert_allclose(float(L.logitcrossentropy(logits, y, axis=1)), float(want), rtol=1e-12)
    check_grad(lambda z: L.logitcrossentropy(z, y, axis=1), logits, rng=rng)


def test_a_bad_class_axis_is_named():
    with pytest.raises(ValueError, match="axis, the class axis"):
        L.logitcrossentropy(np.zeros((2, 3)), np.array([0, 1]), axis=2)


def _torch_bce_with_logits(logits, y, weight, pos_weight):
    """PyTorch's ``binary_cross_entropy_with_logits(logits, y, weight, pos_weight=...)``, mean reduction,
    transcribed in float64 (its documented formula: ``-w [p y log s(x) + (1 - y) log(1 - s(x))]``)."""
    s = 1 / (1 + np.exp(-logits))
    p = 1.0 if pos_weight is None else pos_weight
    w = 1.0 if weight is None else weight
    return float(np.mean(-w * (p * y * np.log(s) + (1 - y) * np.log(1 - s))))


@given(shape=shapes(1, 3, 1, 5), seed=st.integers(0, 2**31 - 1), weight=st.sampled_from([None, "entries", "rows"]),
       pos=st.sampled_from([None, "classes", "scalar"]))
def test_binary_cross_entropies_take_pytorch_s_weight_and_pos_weight(shape, seed, weight, pos):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(shape) * 2
    y = rng.integers(0, 2, shape).astype(np.float64)
    w = None if weight is None else rng.uniform(0.1, 3.0, shape if weight == "entries" else shape[:-1] + (1,))
    p = None if pos is None else rng.uniform(0.5, 4.0, shape[-1:] if pos == "classes" else ())
    got = L.logitbinarycrossentropy(logits, y, weight=w, pos_weight=p)
    np.testing.assert_allclose(float(got), _torch_bce_with_logits(logits, y, w, p), rtol=1e-12)
    check_grad(lambda z: L.logitbinarycrossentropy(z, y, weight=w, pos_weight=p), logits, rng=rng)
    probs = np.clip(1 / (1 + np.exp(-logits)), 0.05, 0.95)   # away from 0 and 1, for the finite differences
    got = L.binarycrossentropy(probs, y, weight=w, eps=0.0)
    np.testing.assert_allclose(float(got), _torch_bce_with_logits(np.log(probs / (1 - probs)), y, w, None), rtol=1e-9)
    check_grad(lambda q: L.binarycrossentropy(q, y, weight=w, eps=0.0), probs, rng=rng)


def test_weight_and_pos_weight_match_torch_itself():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(3)
    logits, y = rng.standard_normal((5, 4)), rng.integers(0, 2, (5, 4)).astype(np.float64)
    w, p = rng.uniform(0.1, 2.0, (5, 1)), rng.uniform(0.5, 3.0, 4)
    for agg, reduction in ((fluxpy.mean, "mean"), (sum, "sum")):
        z = torch.tensor(logits, requires_grad=True)
        out = F.binary_cross_entropy_with_logits(z, torch.tensor(y), weight=torch.tensor(w), pos_weight=torch.tensor(p),
                                                 reduction=reduction)
        out.backward()
        value, (g,) = fluxpy.withgradient(lambda a: L.logitbinarycrossentropy(a, y, agg=agg, weight=w, pos_weight=p),
                                          logits)
        assert float(value) == pytest.approx(out.item(), rel=1e-12)
        np.testing.assert_allclose(g, z.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_a_weight_that_does_not_fit_is_named():
    with pytest.raises(ValueError, match=r"^logitbinarycrossentropy expects pos_weight, a real array that broadcasts "
                                         r"to ŷ's shape \(4, 3\), got pos_weight of shape \(4,\) float64$"):
        L.logitbinarycrossentropy(np.zeros((4, 3)), np.ones((4, 3)), pos_weight=np.ones(4))
    with pytest.raises(ValueError, match=r"^binarycrossentropy expects weight, a real array that broadcasts to ŷ's "
                                         r"shape \(2,\), got weight of shape \(2, 2\) float64$"):
        L.binarycrossentropy(np.full(2, 0.5), np.ones(2), weight=np.ones((2, 2)))
