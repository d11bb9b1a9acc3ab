"""logitcrossentropy against class indices (fluxpy/ops/crossentropy.py: logit_crossentropy_labels): the dense path
it replaces (one-hot targets through logit_crossentropy_rows), finite differences, PyTorch, bad labels, and the GPU
glue's launch arguments read back through a transcription of the kernels."""
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy import losses as L
from fluxpy.kernels import compiler
from fluxpy.ops import crossentropy as CE
from fluxpy.ops.crossentropy import logit_crossentropy_labels, logit_crossentropy_labels_backward
from fluxpy.ops.softmax import logit_crossentropy_rows
from gradcheck import check_grad, check_second_order

seeds = st.integers(0, 2**31 - 1)
AGGS = {"mean": fluxpy.mean, "sum": sum, "none": lambda l: l}
BF16 = np.dtype(ml_dtypes.bfloat16)


@st.composite
def problems(draw):
    """``(logits, labels, keywords)``: logits of a form (a batch, a GPT's (N, L, C), one example, segmentation
    logits with the classes on axis 1), labels of an integer dtype, and the loss's options."""
    rng = np.random.default_rng(draw(seeds))
    form = draw(st.sampled_from(["rows", "tokens", "one", "axis1"]))
    c = draw(st.integers(1, 9))
    lead = {"rows": (draw(st.integers(1, 7)),), "tokens": (draw(st.integers(1, 3)), draw(st.integers(1, 5))),
            "one": (), "axis1": (draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 2)))}[form]
    labels = rng.integers(0, c, lead).astype(draw(st.sampled_from([np.int64, np.int32, np.uint8])))
    ignore = draw(st.sampled_from([None, -100, 0]))
    if ignore is not None and labels.dtype.kind == "i" and labels.size:
        labels[rng.random(lead) < 0.3] = ignore
    weight = None
    if draw(st.booleans()):
        weight = rng.uniform(0.1, 3.0, c)
        weight[rng.random(c) < 0.2] = 0.0   # a class of weight 0 adds nothing
    logits = rng.standard_normal(lead + (c,)) * 3
    keywords = {"label_smoothing": draw(st.sampled_from([0.0, 0.1, 0.37])), "weight": weight, "ignore_index": ignore,
                "agg": draw(st.sampled_from(sorted(AGGS)))}
    if form == "axis1":
        logits, keywords["axis"] = np.moveaxis(logits, -1, 1), 1
    return logits, labels, keywords


def dense_targets(labels, c, alpha, weight, ignore):
    """The targets the class-index path used to build: one-hot, smoothed, ignored rows zeroed, weighted."""
    kept = None if ignore is None else labels != ignore
    y = np.eye(c)[labels if kept is None else np.where(kept, labels, 0)]
    y = y if alpha == 0 else y * (1 - alpha) + alpha / c
    y = y if kept is None else y * kept[..., None]
    return y if weight is None else y * weight


def dense_loss(logits, labels, *, agg, label_smoothing, weight, ignore_index, axis=-1):
    """logitcrossentropy of class indices as it was: dense targets through logit_crossentropy_rows, PyTorch's
    weighted mean where there are weights or ignored examples."""
    x = logits if axis == -1 else fluxpy.ops.transpose(logits, (0, 2, 3, 1))
    c = x.shape[-1]
    y = dense_targets(labels, c, label_smoothing, weight, ignore_index)
    rows = fluxpy.ops.reshape(logit_crossentropy_rows(fluxpy.ops.reshape(x, (-1, c)), y.reshape(-1, c)), labels.shape)
    if agg == "mean" and (weight is not None or ignore_index is not None):
        kept = np.ones(labels.shape) if ignore_index is None else labels != ignore_index
        counted = (np.ones(c) if weight is None else weight)[np.where(kept, labels, 0)] * kept
        return fluxpy.ops.sum(rows) / counted.sum()
    return fluxpy.ops.sum(rows) if agg == "sum" else AGGS[agg](rows)


def new_loss(logits, labels, *, agg, **keywords):
    return L.logitcrossentropy(logits, labels, agg=AGGS[agg], **keywords)


def _scalar(f, cot):
    return lambda z: (f(z) * cot).sum()


@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:invalid value")   # a mean over weights that are all 0
@given(problem=problems())
def test_class_indices_equal_the_dense_path_in_float64(problem):
    """Values and gradients as the dense path's, bit for bit without smoothing (the same operations on the same
    numbers), to rounding with it (the smoothing's terms are summed in another order)."""
    logits, labels, kw = problem
    got = new_loss(logits, labels, **kw)
    want = dense_loss(logits, labels, **kw)
    cot = np.random.default_rng(0).standard_normal(np.shape(got))
    g, = fluxpy.gradient(_scalar(lambda z: new_loss(z, labels, **kw), cot), logits)
    g_want, = fluxpy.gradient(_scalar(lambda z: dense_loss(z, labels, **kw), cot), logits)
    assert np.shape(got) == np.shape(want) and g.shape == logits.shape
    if kw["label_smoothing"] == 0:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(g, g_want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(g, g_want, rtol=1e-12, atol=1e-14)


@given(problem=problems())
def test_finite_differences_and_second_derivatives(problem):
    logits, labels, kw = problem
    kept = [k for k in range(logits.shape[kw.get("axis", -1)]) if k != kw["ignore_index"]]
    if kw["ignore_index"] is not None and kept:
        labels = labels.copy()
        labels.reshape(-1)[0] = kept[0]   # one kept example at least (a mean over none is NaN)
    elif kw["ignore_index"] is not None:
        labels, kw = np.zeros_like(labels), dict(kw, ignore_index=None)
    if kw["weight"] is not None:   # a weighted mean over weights 0 is NaN
        kw = dict(kw, weight=kw["weight"].copy())
        kw["weight"][labels.reshape(-1)[0]] = 1.0
    rng = np.random.default_rng(1)
    f = lambda z: new_loss(z, labels, **kw)
    check_grad(f, logits, rng=rng)
    check_second_order(f, logits, rng=rng, rtol=1e-5)


def test_the_hessian_vector_product_is_the_dense_paths():
    rng = np.random.default_rng(2)
    logits, labels = rng.standard_normal((6, 5)), rng.integers(0, 5, 6)
    labels[1] = -1
    kw = dict(agg="mean", label_smoothing=0.2, weight=rng.uniform(0.5, 2.0, 5), ignore_index=-1)
    v = rng.standard_normal(logits.shape)

    def hvp(loss):
        return fluxpy.gradient(lambda z: (fluxpy.gradient(lambda q: loss(q, labels, **kw), z)[0] * v).sum(), logits)[0]
    np.testing.assert_allclose(hvp(new_loss), hvp(dense_loss), rtol=1e-12, atol=1e-14)


def test_the_first_derivative_never_builds_the_targets_and_the_second_does(monkeypatch):
    built = []
    dense = CE._dense_targets
    monkeypatch.setattr(CE, "_dense_targets", lambda *a: built.append(a) or dense(*a))
    rng = np.random.default_rng(3)
    logits, labels = rng.standard_normal((4, 3, 5)), rng.integers(0, 5, (4, 3))
    f = lambda z: L.logitcrossentropy(z, labels, label_smoothing=0.1, weight=np.arange(1.0, 6.0), ignore_index=2)
    fluxpy.withgradient(f, logits)
    assert not built
    fluxpy.gradient(lambda z: fluxpy.gradient(f, z)[0].sum(), logits)
    assert built


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_float32_and_halves_keep_their_dtype_and_round_a_float32_result(dtype, alpha):
    rng = np.random.default_rng(4)
    logits, labels = (rng.standard_normal((16, 3, 11)) * 3).astype(dtype), rng.integers(0, 11, (16, 3))
    weight = rng.uniform(0.5, 2.0, 11).astype(dtype)
    kw = dict(label_smoothing=alpha, weight=weight, ignore_index=4)
    value, (g,) = fluxpy.withgradient(lambda z: L.logitcrossentropy(z, labels, **kw), logits)
    exact, (g64,) = fluxpy.withgradient(lambda z: L.logitcrossentropy(z, labels, **kw),
                                        logits.astype(np.float64))
    assert value.dtype == g.dtype == np.dtype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(float(value), float(exact), rtol=tol)
    np.testing.assert_allclose(g.astype(np.float64), g64, rtol=tol, atol=tol * np.abs(g64).max())


@given(n=st.integers(1, 9), c=st.integers(1, 7), weighted=st.booleans(), ignore=st.sampled_from([None, -100, 1]),
       alpha=st.sampled_from([0.0, 0.1, 0.4]), reduction=st.sampled_from(["mean", "sum", "none"]),
       tokens=st.sampled_from([None, 3]), seed=seeds)
def test_torch_cross_entropy_in_float64(n, c, weighted, ignore, alpha, reduction, tokens, seed):
    """PyTorch's ``cross_entropy(logits, target, weight, ignore_index, label_smoothing, reduction)``, its (N, C, L)
    form against our (N, L, C) one for a sequence of tokens."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    lead = (n,) if tokens is None else (n, tokens)
    logits, labels = rng.standard_normal(lead + (c,)) * 2, rng.integers(0, c, lead)
    if ignore is not None:
        labels[rng.random(lead) < 0.3] = ignore
        labels.reshape(-1)[0] = 0 if ignore == 1 else c - 1
    weight = rng.uniform(0.1, 3.0, c) if weighted else None
    cot = rng.standard_normal(lead) if reduction == "none" else 1.0
    value, (g,) = fluxpy.withgradient(
        lambda z: (L.logitcrossentropy(z, labels, agg=AGGS[reduction], label_smoothing=alpha, weight=weight,
                                       ignore_index=ignore) * cot).sum(), logits)
    t = torch.tensor(logits, requires_grad=True)
    out = torch.nn.functional.cross_entropy(
        torch.movedim(t, -1, 1), torch.tensor(labels), weight=None if weight is None else torch.tensor(weight),
        ignore_index=-12345 if ignore is None else ignore, reduction=reduction, label_smoothing=alpha)
    (out * torch.tensor(cot)).sum().backward()
    assert float(value) == pytest.approx((out * torch.tensor(cot)).sum().item(), rel=1e-12, abs=1e-13)
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-11, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# Bad labels and arguments


@pytest.mark.parametrize("ignore", [None, -100])
def test_labels_out_of_range_raise_as_before(ignore):
    labels = np.array([0, -100, 3, 1])
    lo = -1 if ignore is None else 0
    with pytest.raises(ValueError) as err:
        L.logitcrossentropy(np.zeros((4, 3)), np.where(labels == -100, -1, labels) if ignore is None else labels,
                            ignore_index=ignore, label_smoothing=0.1)
    assert str(err.value) == (f"logitcrossentropy expects class indices in [0, 3) (ŷ has 3 classes on its last axis), "
                              f"got values from {lo} to 3 in y of shape (4,) int64")


def test_float_and_wrongly_shaped_labels_raise_as_before():
    with pytest.raises(ValueError, match=r"^logitcrossentropy expects ŷ and y of the same shape, got \(3, 4\) and "
                                         r"\(3,\)$"):
        L.logitcrossentropy(np.zeros((3, 4)), np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"^logitcrossentropy expects ŷ and y of the same shape, got \(2, 3, 4\) and "
                                         r"\(3,\)$"):
        L.logitcrossentropy(np.zeros((2, 3, 4)), np.array([0, 1, 2]))


@pytest.mark.parametrize("alpha", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_unchecked_bad_labels_poison_their_rows_and_nothing_else(alpha, weighted):
    labels = np.array([0, -1, 3, 2, 7, 1])
    weight = np.array([1.0, 2.0, 0.5]) if weighted else None
    logits = np.random.default_rng(5).standard_normal((6, 3))
    with fluxpy.options(value_checks=False):
        rows = L.logitcrossentropy(logits, labels, agg=lambda l: l, label_smoothing=alpha, weight=weight,
                                   ignore_index=7)
        g, = fluxpy.gradient(lambda z: L.logitcrossentropy(z, labels, agg=sum, label_smoothing=alpha,
                                                           weight=weight, ignore_index=7), logits)
    good = [0, 3, 5]
    want = dense_loss(logits[good], labels[good], agg="none", label_smoothing=alpha, weight=weight, ignore_index=None)
    np.testing.assert_allclose(rows[good], want, rtol=1e-13)
    assert np.isnan(rows[[1, 2]]).all() and rows[4] == 0
    assert np.isnan(g[[1, 2]]).all() and np.isfinite(g[[0, 3, 4, 5]]).all() and (g[4] == 0).all()


def test_the_op_names_its_bad_arguments():
    x, labels = np.zeros((2, 3)), np.array([0, 1])
    with pytest.raises(ValueError, match=r"logit_crossentropy_labels expects ŷ, \(N, C\) floating-point logits with "
                                         r"C >= 1, got \(2, 3, 1\) float64"):
        logit_crossentropy_labels(np.zeros((2, 3, 1)), labels)
    with pytest.raises(ValueError, match=r"got \(2, 3\) int64"):
        logit_crossentropy_labels(np.zeros((2, 3), np.int64), labels)
    with pytest.raises(ValueError, match=r"expects labels, \(2,\) integer class indices for ŷ of shape \(2, 3\), got "
                                         r"\(2,\) float64"):
        logit_crossentropy_labels(x, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"got \(3,\) int64"):
        logit_crossentropy_labels(x, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"expects smoothing in \[0, 1\), got 1.0"):
        logit_crossentropy_labels(x, labels, smoothing=1.0)
    with pytest.raises(TypeError, match="expects ignore_index to be None or an int"):
        logit_crossentropy_labels(x, labels, ignore_index=0.5)
    with pytest.raises(ValueError, match=r"expects weight, \(3,\) class weights, got \(2,\) float64"):
        logit_crossentropy_labels(x, labels, weight=np.ones(2))


def test_the_op_takes_any_integer_labels_and_lists_of_weights():
    rng = np.random.default_rng(6)
    x, labels = rng.standard_normal((5, 4)), rng.integers(0, 4, 5)
    want = logit_crossentropy_labels(x, labels, weight=np.array([1.0, 2.0, 3.0, 4.0]), smoothing=0.1)
    for dtype in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.uint64):
        np.testing.assert_array_equal(
            logit_crossentropy_labels(x, labels.astype(dtype), weight=[1, 2, 3, 4], smoothing=0.1), want)
    np.testing.assert_array_equal(logit_crossentropy_labels(x, labels[::-1].copy()[::-1]), logit_crossentropy_labels(
        x, labels))


def test_the_backward_op_is_the_dense_rules():
    rng = np.random.default_rng(7)
    x, labels, dl = rng.standard_normal((6, 5)), rng.integers(0, 5, 6), rng.standard_normal(6)
    labels[2] = 9
    w = rng.uniform(0.5, 2.0, 5)
    got = logit_crossentropy_labels_backward(dl, x, labels, w, 0.3, 9)
    y = dense_targets(labels, 5, 0.3, w, 9)
    np.testing.assert_allclose(got, dl[:, None] * (fluxpy.softmax(x) * y.sum(1, keepdims=True) - y), rtol=1e-13,
                               atol=1e-15)
    assert (got[2] == 0).all()


# ---------------------------------------------------------------------------------------------
# The GPU glue (fluxpy/kernels/cuda_softmax.py) on host arrays: each launch's arguments against the kernel's
# parameters in softmax.cu, and a transcription of the kernel run from them (the CUDA code itself runs on a GPU only:
# tests/gpu/test_crossentropy_labels_gpu.py)


class _Device:
    """A host array standing in for a CuPy one: what the glue reads of it."""

    def __init__(self, a):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    strides = property(lambda self: self.a.strides)
    itemsize = property(lambda self: self.a.itemsize)
    ndim = property(lambda self: self.a.ndim)
    flags = property(lambda self: self.a.flags)


def _parameters(kernel):
    """``[(type, name)]`` of ``kernel`` in softmax.cu, pointers with a trailing ``*``."""
    text = compiler.source("softmax.cu")
    signature = re.search(r'extern "C" __global__ void ' + kernel + r"\(([^)]*)\)", text).group(1)
    out = []
    for p in " ".join(signature.split()).split(","):
        *kind, name = p.replace("*", " * ").split()
        out.append((" ".join(k for k in kind if k != "const"), name))
    return out


_SCALARS = {"int": np.int32, "long long": np.int64}


def _launcher(kernel, dtype, runs):
    """A stand-in for the compiled ``kernel`` of ``dtype``: checks the arguments, then runs :func:`_transcribed`."""
    compute = np.float64 if dtype == np.float64 else np.float32
    params = _parameters(kernel)

    def launch(grid, block, args):
        assert len(args) == len(params), f"{kernel}: {len(args)} arguments for {len(params)} parameters"
        named = {}
        for (kind, name), arg in zip(params, args):
            if kind.endswith("*"):
                assert isinstance(arg, _Device) or (arg == np.uint64(0) and name == "weight"), (kernel, name, arg)
                if kind == "T *":
                    assert arg is None or not isinstance(arg, _Device) or arg.dtype == dtype, (kernel, name)
                named[name] = arg.a if isinstance(arg, _Device) else None
            else:
                want = compute if kind == "ACC" else _SCALARS[kind]
                assert type(arg) is want, f"{kernel}: {name} is a {kind}, got {type(arg).__name__}"
                named[name] = arg.item()
        assert grid[0] * block[0] // 32 >= named["n"]
        runs.append(kernel)
        _transcribed(kernel, named, compute)
    return launch


def _transcribed(kernel, p, compute):
    """softmax.cu's ce_labels_forward / ce_labels_backward, a row at a time, from their arguments."""
    c, weight = p["c"], p["weight"]
    labels = p["labels"].view(np.int64 if p["label_bytes"] == 8 else np.int32)
    for row in range(p["n"]):
        k = int(labels[row])
        t, h, u = -1, compute(0), compute(0)
        if not (p["has_ignore"] and k == p["ignore"]):
            if k < 0 or k >= c:
                h = u = compute(np.nan)
            else:
                t, h, u = k, compute(p["hard"]) * (1 if weight is None else weight[k].astype(compute)), p["uniform"]
        a = p["yhat"][row].astype(compute)
        w = np.ones(c, compute) if weight is None else weight.astype(compute)
        lse = np.log(np.exp(a - a.max()).sum()) + a.max()
        sw, swa = w.sum(), np.where(w != 0, w * a, 0).sum()
        if kernel == "ce_labels_forward":
            loss = (h * (lse - (a[t] if t >= 0 else 0)) if h != 0 else 0) + (u * (sw * lse - swa) if u != 0 else 0)
            p["out"][row] = loss
        else:
            mass = h + (u * sw if u != 0 else 0)
            y = np.where(np.arange(c) == t, h, 0) + (u * w if u != 0 else 0)
            p["dx"][row] = p["dl"][row * p["dl_stride"]] * (np.exp(a - lse) * mass - y)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BF16], ids=str)
@pytest.mark.parametrize("label_type", [np.int32, np.int64])
@pytest.mark.parametrize("options", [dict(smoothing=0.0), dict(smoothing=0.2, weight=True, ignore_index=-100),
                                     dict(smoothing=0.1, ignore_index=2**70)])
def test_the_gpu_glue_launches_what_the_kernels_read(dtype, label_type, options, monkeypatch):
    import types

    from fluxpy.kernels import cuda_softmax as K
    runs = []
    fake = types.SimpleNamespace(ndarray=_Device, empty=lambda n, dtype: _Device(np.full(n, np.nan, dtype)),
                                 empty_like=lambda a: _Device(np.full_like(a.a, np.nan)))
    monkeypatch.setattr(K, "cupy", fake)
    monkeypatch.setattr(K, "_function", lambda kernel, dt: _launcher(kernel, np.dtype(dt), runs))
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((11, 37)) * 3).astype(dtype)
    labels = rng.integers(0, 37, 11).astype(label_type)
    labels[[3, 7]] = [-100, 40]   # ignored (where -100 is ignore_index), and out of range
    weight = rng.uniform(0.5, 2.0, 37).astype(dtype) if options.get("weight") else None
    smoothing, ignore = options["smoothing"], options.get("ignore_index")
    dl = np.broadcast_to(rng.standard_normal(1).astype(dtype), (11,))   # a mean's cotangent: stride 0
    args = (_Device(labels), None if weight is None else _Device(weight), smoothing, ignore)
    assert K.KERNELS["logit_crossentropy_labels"][1](_Device(x), *args)
    assert K.KERNELS["logit_crossentropy_labels_backward"][1](_Device(dl), _Device(x), *args)
    assert not K.KERNELS["logit_crossentropy_labels"][1](_Device(x), _Device(labels.astype(np.uint8)), *args[1:])
    assert not K.KERNELS["logit_crossentropy_labels"][1](_Device(np.asfortranarray(x)), *args)
    out = K.logit_crossentropy_labels(_Device(x), *args).a
    dx = K.logit_crossentropy_labels_backward(_Device(dl), _Device(x), *args).a
    assert runs == ["ce_labels_forward", "ce_labels_backward"]
    want = logit_crossentropy_labels(x, labels, smoothing=smoothing, weight=weight, ignore_index=ignore)
    dwant = logit_crossentropy_labels_backward(dl, x, labels, weight, smoothing, ignore)
    assert out.dtype == dx.dtype == np.dtype(dtype)
    tol = {8: 1e-12, 4: 2e-5}.get(np.dtype(dtype).itemsize, 2e-2)
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    np.testing.assert_allclose(dx.astype(np.float64), dwant.astype(np.float64), rtol=tol, atol=tol)
    assert np.isnan(out[7]) and np.isnan(dx[7]).all()
    assert (out[3] == 0) == (ignore == -100)
