"""Losses refuse bad input with errors naming the loss (domains, empty batches, options), under the value-check
policy (the value_checks option); and logitcrossentropy from integer class indices."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fluxpy
from fluxpy import losses as L
from fluxpy.options import Options, options
from gradcheck import check_grad, check_second_order

seeds = st.integers(0, 2**31 - 1)
ALL = [L.mse, L.mae, L.huber_loss, L.crossentropy, L.logitcrossentropy, L.binarycrossentropy,
       L.logitbinarycrossentropy, L.kldivergence]
PROBABILITY_LOSSES = [L.crossentropy, L.binarycrossentropy, L.kldivergence]
TARGET_CHECKED = PROBABILITY_LOSSES + [L.logitcrossentropy, L.logitbinarycrossentropy]
HINTS = {"crossentropy": "; for logits use logitcrossentropy(ŷ, y), or apply softmax first",
         "binarycrossentropy": "; for logits use logitbinarycrossentropy(ŷ, y), or apply sigmoid first",
         "kldivergence": "; apply softmax to logits first"}


def policy(mode):
    """A block with the value_checks option set to ``mode``."""
    return options(value_checks=mode)


def softmax_rows(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# Domains: probabilities and targets in [0, 1]


@pytest.mark.parametrize("loss", PROBABILITY_LOSSES, ids=lambda f: f.__name__)
def test_logits_given_as_probabilities_are_refused_with_a_hint(loss):
    logits = np.array([[2.5, -1.0, 0.5]], np.float32)
    y = np.array([[1.0, 0.0, 0.0]], np.float32)
    with pytest.raises(ValueError) as err:
        loss(logits, y)
    assert str(err.value) == (f"{loss.__name__} expects ŷ in [0, 1] (probabilities), got values from -1 to 2.5 in ŷ "
                              f"of shape (1, 3) float32{HINTS[loss.__name__]}")


@pytest.mark.parametrize("loss", TARGET_CHECKED, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [-0.5, 1.5, 2])
def test_targets_outside_the_unit_interval_are_refused(loss, bad):
    yhat = np.array([[0.2, 0.8], [0.5, 0.5]])
    y = np.array([[0.0, 1.0], [bad, 0.0]])
    with pytest.raises(ValueError, match=rf"^{loss.__name__} expects y in \[0, 1\] \(.*\), got values from "):
        loss(yhat, y)
    with pytest.raises(ValueError, match=rf"^{loss.__name__} expects y in \[0, 1\]"):   # an integer target too
        loss(yhat, y.astype(np.int64) if bad == 2 else np.array([[0, 1], [-1, 0]]))


@pytest.mark.parametrize("loss", PROBABILITY_LOSSES, ids=lambda f: f.__name__)
@given(values=hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 4)),
                         elements=st.floats(-3, 3, allow_nan=False)))
def test_any_value_outside_is_caught_and_any_inside_passes(loss, values):
    y = np.zeros_like(values)
    y[..., 0] = 1
    inside = bool(((values >= 0) & (values <= 1)).all())
    if inside:
        assert np.isfinite(float(loss(values, y)))
    else:
        with pytest.raises(ValueError, match=rf"^{loss.__name__} expects ŷ in \[0, 1\]"):
            loss(values, y)


def test_nan_is_not_a_domain_error():
    p = np.array([[np.nan, 0.5]])
    assert np.isnan(float(L.crossentropy(p, np.array([[1.0, 0.0]]))))
    with pytest.raises(ValueError, match=r"got values from -2 to 0.5"):   # NaN ignored in the report
        L.crossentropy(np.array([[np.nan, 0.5, -2.0]]), np.array([[0.0, 1.0, 0.0]]))


def test_tracked_values_are_checked_and_the_check_is_not_differentiated():
    y = np.array([[0.0, 1.0]])
    p = np.array([[0.3, 0.7]])
    g, = fluxpy.gradient(lambda p: L.crossentropy(p, y, eps=0.0), p)
    np.testing.assert_allclose(g, [[0.0, -1 / 0.7]])
    with pytest.raises(ValueError, match="crossentropy expects ŷ in"):
        fluxpy.gradient(lambda z: L.crossentropy(z * 3, y), p)
    with pytest.raises(ValueError, match="kldivergence expects y in"):   # a tracked target
        fluxpy.gradient(lambda t: L.kldivergence(p, t * 2), y)


# ---------------------------------------------------------------------------------------------
# The policy


def test_check_values_policy():
    bad = np.array([[2.0, -1.0]])
    y = np.array([[1.0, 0.0]])
    with policy("auto"):
        with pytest.raises(ValueError):   # NumPy arrays: checked
            L.crossentropy(bad, y)
    with policy(False):
        assert float(L.crossentropy(bad, y)) == pytest.approx(-np.log(2))   # no error: nothing read
        L.binarycrossentropy(np.array([0.5]), np.array([3.0]))
    with policy(True):
        with pytest.raises(ValueError):
            L.crossentropy(bad, y)
    for mode in ("yes", 1, 0.5):
        with pytest.raises(ValueError, match="value_checks expects 'auto', True or False"):
            options.set(value_checks=mode)
    assert options.value_checks == "auto"


def test_shape_checks_stay_on_with_value_checks_off():
    with policy(False):
        with pytest.raises(ValueError, match="same shape"):
            L.crossentropy(np.ones((2, 3)), np.ones((3, 2)))
        with pytest.raises(ValueError, match="non-empty batch"):
            L.mse(np.ones((0, 3)), np.ones((0, 3)))


@pytest.mark.parametrize("text, mode", [("1", True), ("0", False), ("", "auto"), ("auto", "auto"), ("on", True),
                                        ("False", False)])
def test_policy_from_the_environment(text, mode):
    assert Options({"FLUXPY_CHECKS": text}).value_checks == mode


def test_environment_variable_sets_the_policy_at_import():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import fluxpy; print(fluxpy.options.value_checks)"
    for value, expected in (("1", "True"), ("0", "False")):
        run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                             env={**os.environ, "FLUXPY_CHECKS": value})
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == expected
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**os.environ, "FLUXPY_CHECKS": "2"})
    assert run.returncode != 0 and "FLUXPY_CHECKS (the option value_checks) expects 1, 0 or auto, got '2'" in run.stderr


# ---------------------------------------------------------------------------------------------
# Shapes and options: always checked


@pytest.mark.parametrize("loss", ALL, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (0,)])
def test_empty_batch_is_refused(loss, shape):
    a = np.zeros(shape)
    with pytest.raises(ValueError, match=rf"^{loss.__name__} expects a non-empty batch, got ŷ of shape "):
        loss(a, a)


def test_empty_batch_of_class_indices_is_refused():
    with pytest.raises(ValueError, match=r"^logitcrossentropy expects a non-empty batch, got ŷ of shape \(0, 3\)"):
        L.logitcrossentropy(np.zeros((0, 3)), np.zeros(0, np.int64))


@pytest.mark.parametrize("loss", [L.crossentropy, L.logitcrossentropy, L.kldivergence], ids=lambda f: f.__name__)
def test_classification_losses_need_a_class_axis(loss):
    with pytest.raises(ValueError, match=rf"^{loss.__name__} expects ŷ with the classes on its last axis, got a 0-d"):
        loss(np.array(0.5), np.array(1.0))


@pytest.mark.parametrize("loss", ALL, ids=lambda f: f.__name__)
def test_agg_must_be_a_function(loss):
    p = np.array([[0.5, 0.5]])
    with pytest.raises(TypeError, match=rf"^{loss.__name__} expects agg to be a function such as fluxpy.mean, sum"):
        loss(p, p, agg="sum")


@pytest.mark.parametrize("loss", [L.crossentropy, L.binarycrossentropy, L.kldivergence], ids=lambda f: f.__name__)
@pytest.mark.parametrize("eps", [-1e-3, "1e-7", True])
def test_eps_must_be_a_non_negative_number(loss, eps):
    p = np.array([[0.5, 0.5]])
    with pytest.raises(ValueError, match=rf"^{loss.__name__} expects eps to be None or a number >= 0"):
        loss(p, p, eps=eps)


@pytest.mark.parametrize("delta", [0, -1.0, "1"])
def test_huber_delta_must_be_positive(delta):
    with pytest.raises(ValueError, match="huber_loss expects delta to be a number > 0"):
        L.huber_loss(np.ones(2), np.zeros(2), delta=delta)


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5, True])
def test_label_smoothing_keyword_range(alpha):
    with pytest.raises(ValueError, match=r"^logitcrossentropy expects label_smoothing in \[0, 1\)"):
        L.logitcrossentropy(np.zeros((2, 3)), np.array([0, 1]), label_smoothing=alpha)


def test_label_smoothing_function_checks_its_axis():
    with pytest.raises(ValueError, match="label_smoothing: axis must be None or an axis of y, got 2"):
        L.label_smoothing(np.eye(3), 0.1, axis=2)


# ---------------------------------------------------------------------------------------------
# logitcrossentropy from class indices


@st.composite
def index_problems(draw):
    lead = draw(st.sampled_from([(), (1,), (5,), (3, 2)]))
    classes = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([np.int64, np.int32, np.uint8, np.int16]))
    return lead, classes, dtype, draw(seeds)


AGGS = {"mean": fluxpy.mean, "sum": sum, "none": lambda l: l}


@given(problem=index_problems(), agg=st.sampled_from(sorted(AGGS)), alpha=st.sampled_from([0.0, 0.1, 0.5]))
def test_class_indices_equal_the_one_hot_form(problem, agg, alpha):
    lead, classes, dtype, seed = problem
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(lead + (classes,)) * 3
    labels = rng.integers(0, classes, lead).astype(dtype)
    onehot = np.eye(classes)[labels]
    agg = AGGS[agg]
    smoothed = onehot if alpha == 0 else L.label_smoothing(onehot, alpha)
    ours = L.logitcrossentropy(logits, labels, agg=agg, label_smoothing=alpha)
    np.testing.assert_allclose(ours, L.logitcrossentropy(logits, smoothed, agg=agg), rtol=1e-12, atol=1e-14)
    cot = rng.standard_normal(np.shape(ours))
    g, = fluxpy.gradient(lambda z: (L.logitcrossentropy(z, labels, agg=agg, label_smoothing=alpha) * cot).sum(),
                         logits)
    expected, = fluxpy.gradient(lambda z: (L.logitcrossentropy(z, smoothed, agg=agg) * cot).sum(), logits)
    np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-14)
    check_grad(lambda z: L.logitcrossentropy(z, labels, agg=agg, label_smoothing=alpha), logits, rng=rng)


@given(seed=seeds)
def test_class_indices_second_order(seed):
    rng = np.random.default_rng(seed)
    logits, labels = rng.standard_normal((3, 4)), rng.integers(0, 4, 3)
    check_second_order(lambda z: L.logitcrossentropy(z, labels, label_smoothing=0.1), logits, rng=rng)


def test_class_indices_keep_float32_and_match_the_formula():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 5)).astype(np.float32)
    labels = rng.integers(0, 5, 8)
    value, (g,) = fluxpy.withgradient(lambda z: L.logitcrossentropy(z, labels), logits)
    assert value.dtype == g.dtype == np.float32
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z).sum(-1))
    assert float(value) == pytest.approx(np.mean(lse - z[np.arange(8), labels]), rel=1e-6)


@pytest.mark.parametrize("bad", [-1, 3, 100])
def test_class_indices_out_of_range(bad):
    labels = np.array([0, bad, 2])
    lo, hi = min(0, bad), max(2, bad)
    with pytest.raises(ValueError) as err:
        L.logitcrossentropy(np.zeros((3, 3), np.float32), labels)
    assert str(err.value) == (f"logitcrossentropy expects class indices in [0, 3) (ŷ has 3 classes on its last axis), "
                              f"got values from {lo} to {hi} in y of shape (3,) int64")


def test_class_indices_checked_before_any_kernel(monkeypatch):
    def boom(*args, **kw):
        raise AssertionError("a kernel ran")
    monkeypatch.setattr(L, "logit_crossentropy_rows", boom)
    monkeypatch.setattr(L, "logit_crossentropy_labels", boom)
    with pytest.raises(ValueError, match="class indices in"):
        L.logitcrossentropy(np.zeros((3, 3)), np.array([0, 1, 5]))
    with pytest.raises(ValueError, match="expects y in"):
        L.logitcrossentropy(np.zeros((3, 3)), np.full((3, 3), 2.0))


def test_unchecked_bad_indices_poison_their_rows():
    """Without value checks (the GPU's default) a bad index cannot pass silently: its row of the loss is NaN."""
    with policy(False):
        rows = L.logitcrossentropy(np.zeros((4, 3)), np.array([0, -1, 3, 2]), agg=lambda l: l)
        g, = fluxpy.gradient(lambda z: L.logitcrossentropy(z, np.array([0, 5])), np.zeros((2, 3)))
    np.testing.assert_allclose(rows[[0, 3]], np.log(3))
    assert np.isnan(rows[1]) and np.isnan(rows[2])
    assert np.isnan(g[1]).all()


def test_boolean_or_wrongly_shaped_indices_are_shape_errors():
    with pytest.raises(ValueError, match=r"logitcrossentropy expects ŷ and y of the same shape, got \(3, 4\) and \(3,\)"):
        L.logitcrossentropy(np.zeros((3, 4)), np.array([True, False, True]))
    with pytest.raises(ValueError, match=r"got \(3, 4\) and \(4,\)"):
        L.logitcrossentropy(np.zeros((3, 4)), np.array([0, 1, 2, 3]))


@given(problem=index_problems(), reduction=st.sampled_from(["mean", "sum", "none"]),
       alpha=st.sampled_from([0.0, 0.2]))
def test_class_indices_match_torch_cross_entropy(problem, reduction, alpha):
    torch = pytest.importorskip("torch")
    lead, classes, dtype, seed = problem
    if not lead:
        return   # torch wants a batch axis
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(lead + (classes,))
    labels = rng.integers(0, classes, lead)
    agg = {"mean": fluxpy.mean, "sum": sum, "none": lambda l: l}[reduction]
    cot = rng.standard_normal(lead) if reduction == "none" else 1.0
    value, (g,) = fluxpy.withgradient(
        lambda z: (L.logitcrossentropy(z, labels.astype(dtype), agg=agg, label_smoothing=alpha) * cot).sum(), logits)
    t = torch.tensor(logits, requires_grad=True)
    out = torch.nn.functional.cross_entropy(torch.movedim(t, -1, 1), torch.tensor(labels), reduction=reduction,
                                            label_smoothing=alpha)
    (out * torch.tensor(cot)).sum().backward()
    assert float(value) == pytest.approx((out * torch.tensor(cot)).sum().item(), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-9, atol=1e-12)
