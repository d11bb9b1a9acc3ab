"""The losses of fluxpy.losses_more against PyTorch's formulas written out in NumPy (torch is not needed), float64,
hypothesis over shapes and options, finite-difference gradients; ctc_loss against a brute-force sum over every
alignment and NNlib's known answers; the errors."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import losses as L
from gradcheck import check_grad
from strategies import shapes

seeds = st.integers(0, 2**31 - 1)
AGGS = {"mean": None, "sum": sum, "none": lambda l: l}


def call(loss, *args, agg=None, **kw):
    return loss(*args, **kw) if agg is None else loss(*args, agg=agg, **kw)


def reduce(values, agg):
    return values.mean() if agg is None else (values if agg is AGGS["none"] else values.sum())


def log_softmax(z, axis=-1):
    z = z - z.max(axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis, keepdims=True))


def test_every_loss_is_exported_from_losses_and_fluxpy():
    for name in ("ctc_loss", "smooth_l1_loss", "nll_loss", "margin_ranking_loss", "triplet_margin_loss",
                 "cosine_embedding_loss", "gaussian_nll_loss"):
        assert getattr(L, name) is getattr(fluxpy, name) and name in L.__all__ and name in fluxpy.__all__
        assert getattr(L, name).__doc__


# -- smooth L1 --------------------------------------------------------------------------------------------------

def smooth_l1_torch(x, y, beta):
    z = np.abs(x - y)
    return z if beta == 0 else np.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta)


@pytest.mark.parametrize("agg", sorted(AGGS))
@given(shape=shapes(0, 3, 1, 5), seed=seeds, beta=st.sampled_from([0.0, 0.3, 1.0, 2.5]))
def test_smooth_l1_loss(agg, shape, seed, beta):
    rng = np.random.default_rng(seed)
    agg = AGGS[agg]
    y = rng.standard_normal(shape)
    d = rng.standard_normal(shape) * 2
    d = np.where(np.abs(d) < 0.05, 0.05, d)                                     # off the kinks |d| = 0 and = beta
    d = np.where(np.abs(np.abs(d) - beta) < 0.05, (beta + 0.1) * np.sign(d), d)
    x = y + d
    np.testing.assert_allclose(call(L.smooth_l1_loss, x, y, agg=agg, beta=beta),
                               reduce(smooth_l1_torch(x, y, beta), agg), rtol=1e-12, atol=1e-14)
    check_grad(lambda x: call(L.smooth_l1_loss, x, y, agg=agg, beta=beta), x, rng=rng, rtol=1e-5)
    if beta > 0:   # the Huber loss with delta = beta, scaled to slope 1
        np.testing.assert_allclose(L.smooth_l1_loss(x, y, beta=beta), L.huber_loss(x, y, delta=beta) / beta,
                                   rtol=1e-12)
    else:
        np.testing.assert_allclose(L.smooth_l1_loss(x, y, beta=0.0), L.mae(x, y), rtol=1e-12)


# -- Gaussian NLL -----------------------------------------------------------------------------------------------

def gaussian_nll_torch(x, y, var, full, eps):
    if np.ndim(var) and np.shape(var) != x.shape and np.shape(var) == x.shape[:-1]:
        var = var[..., None]
    var = np.maximum(var, eps)
    loss = 0.5 * (np.log(var) + (x - y) ** 2 / var)
    return loss + 0.5 * np.log(2 * np.pi) if full else loss


@pytest.mark.parametrize("agg", sorted(AGGS))
@given(shape=shapes(1, 3, 1, 5), seed=seeds, form=st.sampled_from(["full", "rows", "rows1", "number"]),
       full=st.booleans(), eps=st.sampled_from([1e-6, 0.3]))
def test_gaussian_nll_loss(agg, shape, seed, form, full, eps):
    rng = np.random.default_rng(seed)
    agg = AGGS[agg]
    x, y = rng.standard_normal(shape), rng.standard_normal(shape)
    var_shape = {"full": shape, "rows": shape[:-1], "rows1": shape[:-1] + (1,), "number": ()}[form]
    var = rng.uniform(0.05, 2.0, var_shape)
    var = np.where(np.abs(var - eps) < 0.02, eps + 0.05, var)   # off the clamp's kink
    if form == "number":
        var = float(var)
    want = np.broadcast_to(gaussian_nll_torch(x, y, var, full, eps), shape)
    got = call(L.gaussian_nll_loss, x, y, var, agg=agg, full=full, eps=eps)
    np.testing.assert_allclose(got, reduce(want, agg), rtol=1e-12, atol=1e-14)
    check_grad(lambda x, y: call(L.gaussian_nll_loss, x, y, var, agg=agg, full=full, eps=eps), x, y, rng=rng,
               rtol=1e-5)
    if form != "number":   # away from the clamp: there finite differences see a constant, PyTorch's gradient not
        var = np.where(var < eps, eps + 0.1, var)
        check_grad(lambda v: call(L.gaussian_nll_loss, x, y, v, agg=agg, full=full, eps=eps), var, rng=rng,
                   rtol=1e-5)


def test_gaussian_nll_clamps_the_variance_and_passes_its_gradient_through():
    x, y, var = np.array([1.0, 2.0]), np.array([0.0, 0.0]), np.array([0.0, 4.0])
    value, (g,) = fluxpy.withgradient(lambda v: L.gaussian_nll_loss(x, y, v, eps=0.5, agg=sum), var)
    assert float(value) == pytest.approx(0.5 * (np.log(0.5) + 1 / 0.5) + 0.5 * (np.log(4.0) + 4 / 4.0))
    # as PyTorch: the clamped entry's gradient is that of the clamped value, as if the clamp were not there
    np.testing.assert_allclose(g, 0.5 * (1 / np.array([0.5, 4.0]) - np.array([1.0, 4.0]) / np.array([0.5, 4.0]) ** 2))


# -- NLL --------------------------------------------------------------------------------------------------------

def nll_torch(logp, labels, weight, ignore_index, reduction):
    """PyTorch's nll_loss with the class axis last."""
    c = logp.shape[-1]
    w = np.ones(c) if weight is None else weight
    keep = np.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    safe = np.where(keep, labels, 0)
    picked = np.take_along_axis(logp, safe[..., None], -1)[..., 0]
    losses = -w[safe] * picked * keep
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    with np.errstate(invalid="ignore"):   # every example ignored: NaN, as PyTorch
        return losses.sum() / (w[safe] * keep).sum()


@given(shape=shapes(1, 3, 1, 4), classes=st.integers(1, 5), seed=seeds, weighted=st.booleans(),
       ignore=st.sampled_from([None, -100, 0]), reduction=st.sampled_from(["mean", "sum", "none"]),
       axis=st.sampled_from([-1, 1]))
def test_nll_loss(shape, classes, seed, weighted, ignore, reduction, axis):
    rng = np.random.default_rng(seed)
    logp = log_softmax(rng.standard_normal(shape + (classes,)))
    labels = rng.integers(0, classes, shape)
    if ignore == -100:
        labels[rng.random(shape) < 0.3] = -100
    weight = rng.uniform(0.1, 2.0, classes) if weighted else None
    want = nll_torch(logp, labels, weight, ignore, reduction)
    x = logp if axis == -1 or len(shape) == 0 else np.moveaxis(logp, -1, 1)   # PyTorch's (N, C, d1, ...)
    axis = -1 if x is logp else 1
    agg = {"mean": fluxpy.mean, "sum": sum, "none": lambda l: l}[reduction]
    np.testing.assert_allclose(L.nll_loss(x, labels, weight=weight, ignore_index=ignore, agg=agg, axis=axis), want,
                               rtol=1e-12, atol=1e-14)
    if np.isfinite(want).all():
        check_grad(lambda x: L.nll_loss(x, labels, weight=weight, ignore_index=ignore, agg=agg, axis=axis), x,
                   rng=rng)


def test_nll_of_logsoftmax_is_logitcrossentropy():
    rng = np.random.default_rng(0)
    z, labels, w = rng.standard_normal((6, 4)), rng.integers(0, 4, 6), rng.uniform(0.5, 1.5, 4)
    for kw in ({}, {"weight": w}):
        a, (ga,) = fluxpy.withgradient(lambda z: L.nll_loss(fluxpy.logsoftmax(z), labels, **kw), z)
        b, (gb,) = fluxpy.withgradient(lambda z: L.logitcrossentropy(z, labels, **kw), z)
        np.testing.assert_allclose(a, b, rtol=1e-12)
        np.testing.assert_allclose(ga, gb, rtol=1e-10, atol=1e-14)


def test_nll_unchecked_bad_index_gives_nan_rows():
    logp = log_softmax(np.zeros((3, 2)))
    with fluxpy.options(value_checks=False):
        rows = L.nll_loss(logp, np.array([0, 5, -1]), agg=lambda l: l)
    assert np.isfinite(rows[0]) and np.isnan(rows[1:]).all()


# -- margin ranking, triplet, cosine embedding ------------------------------------------------------------------

@pytest.mark.parametrize("agg", sorted(AGGS))
@given(shape=shapes(0, 3, 1, 5), seed=seeds, margin=st.sampled_from([0.0, 0.5, -0.2]))
def test_margin_ranking_loss(agg, shape, seed, margin):
    rng = np.random.default_rng(seed)
    agg = AGGS[agg]
    x1, x2 = rng.standard_normal(shape), rng.standard_normal(shape)
    y = rng.choice([-1, 1], shape)
    z = -y * (x1 - x2) + margin
    x1 = np.where(np.abs(z) < 0.05, x1 - 0.1 * y, x1)   # off the kink
    want = np.maximum(0, -y * (x1 - x2) + margin)
    np.testing.assert_allclose(call(L.margin_ranking_loss, x1, x2, y, agg=agg, margin=margin), reduce(want, agg),
                               rtol=1e-12, atol=1e-14)
    check_grad(lambda a, b: call(L.margin_ranking_loss, a, b, y, agg=agg, margin=margin), x1, x2, rng=rng)


def pairwise_distance_torch(a, b, p, eps):
    d = np.abs(a - b + eps)
    return d.max(-1) if p == math.inf else (d ** p).sum(-1) ** (1 / p)


@pytest.mark.parametrize("agg", sorted(AGGS))
@given(rows=st.sampled_from([(), (1,), (4,)]), dim=st.integers(1, 5), seed=seeds,
       p=st.sampled_from([1, 2, 3, 1.5, math.inf]), swap=st.booleans(), margin=st.sampled_from([1.0, 0.2]),
       eps=st.sampled_from([1e-6, 0.0]))
def test_triplet_margin_loss(agg, rows, dim, seed, p, swap, margin, eps):
    rng = np.random.default_rng(seed)
    agg = AGGS[agg]
    a, pos, neg = (rng.standard_normal(rows + (dim,)) for _ in range(3))
    d_pos, d_neg = pairwise_distance_torch(a, pos, p, eps), pairwise_distance_torch(a, neg, p, eps)
    if swap:
        d_neg = np.minimum(d_neg, pairwise_distance_torch(pos, neg, p, eps))
    want = np.maximum(margin + d_pos - d_neg, 0)
    got = call(L.triplet_margin_loss, a, pos, neg, agg=agg, p=p, swap=swap, margin=margin, eps=eps)
    np.testing.assert_allclose(got, reduce(want, agg), rtol=1e-12, atol=1e-14)
    raw = margin + d_pos - d_neg
    smooth = np.all(np.abs(raw) > 1e-3) and p != math.inf and not (swap and np.any(np.abs(
        pairwise_distance_torch(a, neg, p, eps) - pairwise_distance_torch(pos, neg, p, eps)) < 1e-3))
    if smooth:
        check_grad(lambda a, b, c: call(L.triplet_margin_loss, a, b, c, agg=agg, p=p, swap=swap, margin=margin,
                                        eps=eps), a, pos, neg, rng=rng, rtol=1e-5)


def cosine_embedding_torch(x1, x2, y, margin):
    prod = (x1 * x2).sum(-1)
    denom = np.sqrt(((x1 * x1).sum(-1) + 1e-12) * ((x2 * x2).sum(-1) + 1e-12))
    cos = prod / denom
    return np.where(y == 1, 1 - cos, 0) + np.where(y == -1, np.maximum(cos - margin, 0), 0)


@pytest.mark.parametrize("agg", sorted(AGGS))
@given(rows=st.sampled_from([(), (1,), (5,)]), dim=st.integers(1, 6), seed=seeds,
       margin=st.sampled_from([0.0, 0.3, -0.4]))
def test_cosine_embedding_loss(agg, rows, dim, seed, margin):
    rng = np.random.default_rng(seed)
    agg = AGGS[agg]
    x1, x2, y = rng.standard_normal(rows + (dim,)), rng.standard_normal(rows + (dim,)), rng.choice([-1, 1], rows)
    want = cosine_embedding_torch(x1, x2, y, margin)
    np.testing.assert_allclose(call(L.cosine_embedding_loss, x1, x2, y, agg=agg, margin=margin), reduce(want, agg),
                               rtol=1e-12, atol=1e-14)
    cos = (x1 * x2).sum(-1) / np.sqrt((x1 * x1).sum(-1) * (x2 * x2).sum(-1))
    if np.all(np.abs(cos - margin) > 1e-3) and dim > 1:
        check_grad(lambda a, b: call(L.cosine_embedding_loss, a, b, y, agg=agg, margin=margin), x1, x2, rng=rng,
                   rtol=1e-5)


def test_unchecked_labels_other_than_plus_minus_one_add_zero_as_in_pytorch():
    x1, x2 = np.ones((2, 3)), np.ones((2, 3))
    with fluxpy.options(value_checks=False):
        assert L.cosine_embedding_loss(x1, x2, np.array([0, 0]), agg=lambda l: l).tolist() == [0.0, 0.0]


# -- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call_, message", [
    (lambda: L.smooth_l1_loss(np.ones(3), np.ones(2)), r"^smooth_l1_loss expects ŷ, y of one shape, got ŷ \(3,\), "
                                                       r"y \(2,\)$"),
    (lambda: L.smooth_l1_loss(np.ones(3), np.ones(3), beta=-1), r"^smooth_l1_loss expects beta to be a number >= 0, "
                                                                r"got -1$"),
    (lambda: L.gaussian_nll_loss(np.ones((2, 3)), np.ones((2, 3)), np.ones(3)),
     r"^gaussian_nll_loss expects var of ŷ's shape \(2, 3\), of \(2,\) or \(2, 1\) \(one variance per row\), or a "
     r"number, got var of shape \(3,\) float64$"),
    (lambda: L.gaussian_nll_loss(np.ones(2), np.ones(2), np.array([1.0, -0.5])),
     r"^gaussian_nll_loss expects var >= 0 \(variances\), got values from -0.5 to 1.0 in var of shape \(2,\) "
     r"float64$"),
    (lambda: L.nll_loss(np.zeros((2, 3)), np.array([0, 3])),
     r"^nll_loss expects class indices in \[0, 3\) \(ŷ has 3 classes on axis -1\), got values from 0 to 3 in y of "
     r"shape \(2,\) int64$"),
    (lambda: L.nll_loss(np.zeros((2, 3)), np.zeros((2, 3))),
     r"^nll_loss expects y, integer class indices of shape \(2,\) \(ŷ's shape without its class axis 1\), got y of "
     r"shape \(2, 3\) float64$"),
    (lambda: L.nll_loss(np.zeros((2, 3)), np.array([0, 1]), weight=np.ones(2)),
     r"^nll_loss expects weight, a \(3,\) array of class weights, got weight of shape \(2,\) float64$"),
    (lambda: L.margin_ranking_loss(np.ones(2), np.ones(2), np.array([1, 0])),
     r"^margin_ranking_loss expects y of 1 \(similar\) or -1 \(dissimilar\), got values from 0 to 1 in y of shape "
     r"\(2,\) int64; 0/1 labels give y = 2 \* labels - 1$"),
    (lambda: L.triplet_margin_loss(np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 4))),
     r"^triplet_margin_loss expects anchor, positive, negative of one shape, got anchor \(2, 3\), positive \(2, 3\), "
     r"negative \(2, 4\)$"),
    (lambda: L.triplet_margin_loss(np.ones((2, 2, 3)), np.ones((2, 2, 3)), np.ones((2, 2, 3))),
     r"^triplet_margin_loss expects anchor, positive, negative of shape \(N, D\) or \(D,\), got \(2, 2, 3\)$"),
    (lambda: L.triplet_margin_loss(np.ones(3), np.ones(3), np.ones(3), p=0),
     r"^triplet_margin_loss expects p to be a number > 0 \(math.inf: the largest entry\), got 0$"),
    (lambda: L.cosine_embedding_loss(np.ones((2, 3)), np.ones((2, 3)), np.ones(3)),
     r"^cosine_embedding_loss expects y of shape \(2,\) \(one label per row of x1 and x2\), got y of shape \(3,\) "
     r"float64$"),
])
def test_errors_name_the_loss_and_say_expected_and_got(call_, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call_()


# -- CTC --------------------------------------------------------------------------------------------------------

def collapse(path, blank):
    out, prev = [], None
    for c in path:
        if c != prev and c != blank:
            out.append(c)
        prev = c
    return out


def brute_force_ctc(lp, target, blank):
    """``(-log p(target), d/d lp)`` for one sequence ``lp`` of shape ``(T, C)``, from every path of T frames."""
    frames, classes = lp.shape
    total, occupancy = -np.inf, np.zeros_like(lp)
    paths = [p for p in itertools.product(range(classes), repeat=frames) if collapse(p, blank) == list(target)]
    logs = [sum(lp[t, p[t]] for t in range(frames)) for p in paths]
    if not paths:
        return np.inf, None
    total = np.logaddexp.reduce(logs)
    for p, lg in zip(paths, logs):
        for t in range(frames):
            occupancy[t, p[t]] += np.exp(lg - total)
    return -total, -occupancy


@st.composite
def ctc_problems(draw):
    frames, batch, classes = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(2, 4))
    width = draw(st.integers(0, 3))
    blank = draw(st.integers(0, classes - 1))
    seed = draw(seeds)
    rng = np.random.default_rng(seed)
    lp = log_softmax(rng.standard_normal((frames, batch, classes)) * 2)
    others = [c for c in range(classes) if c != blank]
    targets = rng.choice(others, (batch, width)) if width else np.zeros((batch, 0), np.int64)
    if width > 1 and rng.random() < 0.5:
        targets[:, 1] = targets[:, 0]   # a repeated label: the alignment needs a blank between them
    inputs = rng.integers(0, frames + 1, batch)
    lengths = rng.integers(0, width + 1, batch)
    return lp, targets, inputs, lengths, blank, rng


@settings(deadline=None, max_examples=60)
@given(problem=ctc_problems())
def test_ctc_loss_is_the_sum_over_every_alignment_with_its_gradient(problem):
    lp, targets, inputs, lengths, blank, rng = problem
    want, grads = [], np.zeros_like(lp)
    for n in range(lp.shape[1]):
        value, g = brute_force_ctc(lp[:inputs[n], n], targets[n, :lengths[n]], blank)
        want.append(value)
        if g is not None:
            grads[:inputs[n], n] = g
    got = L.ctc_loss(lp, targets, inputs, lengths, blank=blank, agg=lambda l: l)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    possible = np.isfinite(want)
    value, (g,) = fluxpy.withgradient(lambda x: L.ctc_loss(x, targets, inputs, lengths, blank=blank, agg=sum,
                                                           zero_infinity=True), lp)
    assert float(value) == pytest.approx(np.sum(np.where(possible, want, 0)), rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(g, grads, rtol=1e-10, atol=1e-12)   # impossible sequences: a zero gradient
    check_grad(lambda x: L.ctc_loss(x, targets, inputs, lengths, blank=blank, agg=lambda l: l, zero_infinity=True),
               lp, rng=rng, rtol=1e-5)


def test_ctc_loss_matches_nnlibs_known_answers():
    """NNlib's test/ctc.jl: logits of 3 classes by 3 or 4 frames, the blank last, labels [1, 2] (0-based here)."""
    cases = [([[1., 2., 3.], [2., 1., 1.], [3., 3., 2.]], 3.6990738275138035,
              [[-0.317671, -0.427729, 0.665241], [0.244728, -0.0196172, -0.829811], [0.0729422, 0.447346, 0.16457]]),
             ([[-3., 12., 8., 15.], [4., 20., -2., 20.], [8., -33., 6., 5.]], 8.02519869363453,
              [[-2.29294774655333e-06, -0.999662657278862, 1.75500863563993e-06, 0.00669284889063],
               [0.017985914969696, 0.999662657278861, -1.9907078755387e-06, -0.006693150917307],
               [-0.01798362202195, -2.52019580677916e-20, 2.35699239251042e-07, 3.02026677058789e-07]])]
    for x, value, grad in cases:
        logits = np.array(x).T.copy()   # Julia's classes-by-time is (T, C) here
        got, (g,) = fluxpy.withgradient(lambda z: L.ctc_loss(fluxpy.logsoftmax(z), np.array([0, 1]), blank=2), logits)
        assert float(got) == pytest.approx(value, rel=1e-12)
        np.testing.assert_allclose(g.T, grad, rtol=1e-5, atol=1e-5)


def test_ctc_gradient_and_pytorchs_agree_through_a_logsoftmax():
    """PyTorch's gradient with respect to the log-probabilities is fluxpy's plus ``exp(lp)`` (within each input's
    frames); through a log-softmax both give the logits the same gradient."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((6, 2, 4))
    targets, inputs, lengths = np.array([[1, 2], [3, 3]]), np.array([6, 5]), np.array([2, 2])
    lp = log_softmax(z)
    g_lp, = fluxpy.gradient(lambda x: L.ctc_loss(x, targets, inputs, lengths, agg=sum), lp)
    g_z, = fluxpy.gradient(lambda z: L.ctc_loss(fluxpy.logsoftmax(z), targets, inputs, lengths, agg=sum), z)
    inside = (np.arange(6)[:, None] < inputs)[..., None]
    torch_like = np.where(inside, g_lp + np.exp(lp), 0)
    np.testing.assert_allclose(g_z, torch_like, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_lp.sum(-1), np.where(inside[..., 0], -1.0, 0.0), atol=1e-12)   # one class a frame


def test_ctc_forms_reductions_and_options():
    rng = np.random.default_rng(4)
    lp = log_softmax(rng.standard_normal((7, 3, 5)))
    targets, inputs, lengths = np.array([[1, 2, 2], [4, 0, 0], [3, 1, 0]]), np.array([7, 4, 6]), np.array([3, 1, 2])
    rows = L.ctc_loss(lp, targets, inputs, lengths, agg=lambda l: l)
    assert rows.shape == (3,)
    # the targets concatenated, as PyTorch also takes them
    flat = np.concatenate([targets[n, :lengths[n]] for n in range(3)])
    np.testing.assert_array_equal(L.ctc_loss(lp, flat, inputs, lengths, agg=lambda l: l), rows)
    # one sequence, unbatched (T, C) with (S,) targets
    single = L.ctc_loss(lp[:inputs[1], 1], targets[1, :lengths[1]])
    assert np.shape(single) == () and float(single) == pytest.approx(rows[1], rel=1e-13)
    # the reductions: mean by default; PyTorch's "mean" divides by the target lengths first
    assert float(L.ctc_loss(lp, targets, inputs, lengths)) == pytest.approx(rows.mean(), rel=1e-13)
    assert float(L.ctc_loss(lp, targets, inputs, lengths, agg=sum)) == pytest.approx(rows.sum(), rel=1e-13)
    torch_mean = L.ctc_loss(lp, targets, inputs, lengths, agg=lambda l: fluxpy.mean(l / np.maximum(lengths, 1)))
    assert float(torch_mean) == pytest.approx((rows / lengths).mean(), rel=1e-13)
    # default lengths: every frame, every label
    np.testing.assert_array_equal(L.ctc_loss(lp, targets[:, :1], agg=lambda l: l),
                                  L.ctc_loss(lp, targets[:, :1], [7, 7, 7], [1, 1, 1], agg=lambda l: l))
    # no alignment: inf, or 0 with zero_infinity; an empty input has the empty target with probability 1
    impossible = L.ctc_loss(lp, np.array([[1, 1, 1]]).repeat(3, 0), [4, 4, 0], [3, 3, 0], agg=lambda l: l)
    assert impossible[0] == impossible[1] == np.inf and impossible[2] == 0.0
    assert L.ctc_loss(lp, np.array([[1, 1, 1]]).repeat(3, 0), [4, 4, 0], [3, 3, 0], agg=lambda l: l,
                      zero_infinity=True).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ctc_in_lower_precision(dtype):
    rng = np.random.default_rng(5)
    lp = log_softmax(rng.standard_normal((8, 2, 4)))
    targets = np.array([[1, 2, 3], [2, 2, 1]])
    want, (g64,) = fluxpy.withgradient(lambda x: L.ctc_loss(x, targets, agg=sum), lp)
    got, (g,) = fluxpy.withgradient(lambda x: L.ctc_loss(x, targets, agg=sum), lp.astype(dtype))
    assert got.dtype == g.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert float(got) == pytest.approx(float(want), rel=tol)
    np.testing.assert_allclose(g.astype(np.float64), g64, atol=tol)


def test_ctc_has_no_second_derivative():
    lp = log_softmax(np.zeros((3, 1, 3)))
    with pytest.raises(NotImplementedError, match="ctc_loss has no second derivative"):
        fluxpy.gradient(lambda x: fluxpy.gradient(lambda z: L.ctc_loss(z, np.array([[1]])), x)[0].sum(), lp)


@pytest.mark.parametrize("call_, message", [
    (lambda lp: L.ctc_loss(lp[0], np.array([[1]])), r"^ctc_loss expects y, integer class indices of shape \(N, S\) or "
                                                   r"\(S,\) \(or the targets concatenated\), got y of shape \(1, 1\)"),
    (lambda lp: L.ctc_loss(lp, np.array([[1.0], [2.0]])), r"^ctc_loss expects y, integer class indices"),
    (lambda lp: L.ctc_loss(lp[..., None], np.array([[1], [1]])), r"^ctc_loss expects ŷ of shape \(T, N, C\) \(time, "
                                                                 r"batch, classes\) or \(T, C\), got ŷ of shape "
                                                                 r"\(4, 2, 3, 1\) float64$"),
    (lambda lp: L.ctc_loss(lp, np.array([[1], [1]]), blank=3), r"^ctc_loss expects blank, a class index, in \[0, 3\) "
                                                               r"\(ŷ has 3 classes\), got 3$"),
    (lambda lp: L.ctc_loss(lp, np.array([[1], [0]])), r"^ctc_loss expects target labels in \[0, 3\) other than the "
                                                      r"blank 0, got 0 in y of shape \(2, 1\) int64$"),
    (lambda lp: L.ctc_loss(lp, np.array([[1], [3]])), r"^ctc_loss expects target labels in \[0, 3\) other than the "
                                                      r"blank 0, got 3"),
    (lambda lp: L.ctc_loss(lp, np.array([[1], [2]]), [4, 5]), r"^ctc_loss expects input_lengths in \[0, 4\] "
                                                              r"\(T = 4\), got values from 4 to 5$"),
    (lambda lp: L.ctc_loss(lp, np.array([[1], [2]]), [4]), r"^ctc_loss expects input_lengths, 2 integers \(one per "
                                                           r"sequence\), got \[4\]$"),
    (lambda lp: L.ctc_loss(lp, np.array([[1], [2]]), None, [1, 2]), r"^ctc_loss expects target_lengths in \[0, 1\] "
                                                                    r"\(S = 1\), got values from 1 to 2$"),
    (lambda lp: L.ctc_loss(lp, np.array([1, 2, 1])), r"^ctc_loss expects target_lengths with concatenated targets"),
    (lambda lp: L.ctc_loss(lp, np.array([1, 2, 1]), None, [1, 1]), r"^ctc_loss expects target_lengths summing to "
                                                                   r"the 3 concatenated labels, got \[1, 1\]$"),
    (lambda lp: L.ctc_loss(lp, np.array([[1]])), r"^ctc_loss expects y with 2 rows \(one target per sequence of ŷ\), "
                                                 r"got y of shape \(1, 1\)$"),
])
def test_ctc_errors(call_, message):
    lp = log_softmax(np.zeros((4, 2, 3)))
    with pytest.raises((ValueError, TypeError), match=message):
        call_(lp)


def test_matches_torch():
    """Where PyTorch is installed (the GPU machine): values and gradients against torch.nn.functional, float64."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(7)
    t = torch.tensor

    def compare(ours, theirs, *arrays, rtol=1e-10):
        tensors = [t(a, requires_grad=True) for a in arrays]
        out = theirs(*tensors)
        out.backward()
        value, grads = fluxpy.withgradient(ours, *arrays)
        assert float(value) == pytest.approx(out.item(), rel=rtol, abs=1e-12)
        for g, tt in zip(grads, tensors):
            np.testing.assert_allclose(g, tt.grad.numpy(), rtol=rtol, atol=1e-12)

    x1, x2, x3 = (rng.standard_normal((8, 5)) for _ in range(3))
    labels, pm = rng.integers(0, 5, 8), rng.choice([-1, 1], 8)
    var, w = rng.uniform(0.1, 2.0, 8), rng.uniform(0.5, 1.5, 5)
    labels[1] = -100
    compare(lambda a, b: L.smooth_l1_loss(a, b, beta=0.7), lambda a, b: F.smooth_l1_loss(a, b, beta=0.7), x1, x2)
    compare(lambda a, b, v: L.gaussian_nll_loss(a, b, v, full=True, agg=sum),
            lambda a, b, v: F.gaussian_nll_loss(a, b, v, full=True, reduction="sum"), x1, x2, var)
    compare(lambda a: L.nll_loss(a, labels, weight=w, ignore_index=-100),
            lambda a: F.nll_loss(a, t(labels), weight=t(w)), log_softmax(x1))
    compare(lambda a: L.nll_loss(a, labels[None].repeat(3, 0), ignore_index=-100, axis=1),
            lambda a: F.nll_loss(a, t(labels[None].repeat(3, 0))), np.moveaxis(log_softmax(x1[None].repeat(3, 0)),
                                                                                -1, 1).copy())
    compare(lambda a, b: L.margin_ranking_loss(a, b, pm, margin=0.3),
            lambda a, b: F.margin_ranking_loss(a, b, t(pm.astype(float)), margin=0.3), x1[:, 0].copy(),
            x2[:, 0].copy())
    for p, swap in ((2, False), (1, True), (3.0, True)):
        compare(lambda a, b, c: L.triplet_margin_loss(a, b, c, p=p, swap=swap, margin=0.5),
                lambda a, b, c: F.triplet_margin_loss(a, b, c, p=p, swap=swap, margin=0.5), x1, x2, x3)
    compare(lambda a, b: L.cosine_embedding_loss(a, b, pm, margin=0.2),
            lambda a, b: F.cosine_embedding_loss(a, b, t(pm.astype(float)), margin=0.2), x1, x2)
    # CTC: PyTorch's gradient with respect to log-probabilities assumes a log-softmax before it, so compare the
    # logits' gradients; its "mean" divides by the target lengths
    z = rng.standard_normal((12, 3, 6))
    targets, inputs, lengths = np.array([[1, 2, 2, 5], [3, 4, 0, 0], [5, 0, 0, 0]]), [12, 9, 4], [4, 2, 1]
    compare(lambda z: L.ctc_loss(fluxpy.logsoftmax(z), targets, inputs, lengths,
                                 agg=lambda l: fluxpy.mean(l / np.maximum(lengths, 1))),
            lambda z: F.ctc_loss(F.log_softmax(z, 2), t(targets), t(inputs), t(lengths)), z)
    targets = np.where(targets == 5, 0, targets)   # 5 is the blank now
    compare(lambda z: L.ctc_loss(fluxpy.logsoftmax(z), targets, inputs, lengths, blank=5, agg=sum),
            lambda z: F.ctc_loss(F.log_softmax(z, 2), t(targets), t(inputs), t(lengths), blank=5, reduction="sum"), z)


# ---------------------------------------------------------------------------------------------
# soft_margin_loss, hinge_embedding_loss, multilabel_soft_margin_loss, multi_margin_loss: PyTorch's formulas


def _sp(z):
    return np.logaddexp(0, z)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), c=st.integers(2, 5), margin=st.sampled_from([0.5, 1.0, 2.0]), weighted=st.booleans(),
       p=st.sampled_from([1, 2]), seed=seeds)
def test_pytorch_s_margin_losses_follow_their_documented_formulas(n, c, margin, weighted, p, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c)) * 2
    pm = rng.choice([-1, 1], (n, c))
    soft = rng.random((n, c))
    labels = rng.integers(0, c, n)
    w = rng.uniform(0.2, 2.0, c) if weighted else None
    wv = np.ones(c) if w is None else w
    np.testing.assert_allclose(float(L.soft_margin_loss(x, pm)), np.mean(_sp(-pm * x)), rtol=1e-12)
    np.testing.assert_allclose(float(L.hinge_embedding_loss(x, pm, margin=margin)),
                               np.mean(np.where(pm == 1, x, np.maximum(0, margin - x))), rtol=1e-12)
    np.testing.assert_allclose(float(L.multilabel_soft_margin_loss(x, soft, weight=w)),
                               np.mean((wv * (soft * _sp(-x) + (1 - soft) * _sp(x))).sum(1) / c), rtol=1e-12)
    rows = [sum(wv[labels[i]] * max(0.0, margin - x[i, labels[i]] + x[i, j]) ** p for j in range(c) if j != labels[i])
            / c for i in range(n)]
    np.testing.assert_allclose(float(L.multi_margin_loss(x, labels, p=p, margin=margin, weight=w)), np.mean(rows),
                               rtol=1e-12, atol=1e-15)
    x = x + 0.01 * (np.abs(x) < 0.01)   # away from the hinges' kinks, for the finite differences
    check_grad(lambda x: L.soft_margin_loss(x, pm), x, rng=rng)
    check_grad(lambda x: L.multilabel_soft_margin_loss(x, soft, weight=w), x, rng=rng)
    kinks = np.abs(margin - x[np.arange(n), labels][:, None] + x)
    if kinks.min() > 1e-3 and np.abs(margin - x).min() > 1e-3:
        check_grad(lambda x: L.hinge_embedding_loss(x, pm, margin=margin), x, rng=rng)
        check_grad(lambda x: L.multi_margin_loss(x, labels, p=p, margin=margin, weight=w), x, rng=rng)


def test_the_margin_losses_refuse_bad_labels_naming_themselves():
    with pytest.raises(ValueError, match=r"^soft_margin_loss expects y of 1 \(similar\) or -1"):
        L.soft_margin_loss(np.zeros(3), np.array([1, 0, -1]))
    with pytest.raises(ValueError, match=r"^multi_margin_loss expects x of shape \(N, C\) and y, integer class"):
        L.multi_margin_loss(np.zeros((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"^multi_margin_loss expects class indices in \[0, 3\)"):
        L.multi_margin_loss(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match=r"^multi_margin_loss expects p to be 1 or 2, got 3"):
        L.multi_margin_loss(np.zeros((2, 3)), np.array([0, 1]), p=3)
    with pytest.raises(ValueError, match=r"^multilabel_soft_margin_loss expects weight, a \(3,\) array"):
        L.multilabel_soft_margin_loss(np.zeros((2, 3)), np.zeros((2, 3)), weight=np.ones(2))


def test_the_margin_losses_match_pytorch_itself():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(5)
    x, pm = rng.standard_normal((6, 4)), rng.choice([-1.0, 1.0], (6, 4))
    soft, labels, w = rng.random((6, 4)), rng.integers(0, 4, 6), rng.uniform(0.5, 2.0, 4)
    t = torch.from_numpy
    pairs = [(L.soft_margin_loss(x, pm), F.soft_margin_loss(t(x), t(pm))),
             (L.hinge_embedding_loss(x, pm, margin=0.6), F.hinge_embedding_loss(t(x), t(pm), margin=0.6)),
             (L.multilabel_soft_margin_loss(x, soft, weight=w), F.multilabel_soft_margin_loss(t(x), t(soft), t(w))),
             (L.multi_margin_loss(x, labels, p=2, margin=0.9, weight=w),
              F.multi_margin_loss(t(x), t(labels), p=2, margin=0.9, weight=t(w)))]
    for ours, theirs in pairs:
        assert float(ours) == pytest.approx(theirs.item(), rel=1e-12)
