"""Issue 39's audit, "types and messages": recurrent states of another dtype, other libraries' arrays given to a
layer, errors naming the outer layer (not its cell or an inner matmul), attention and causal masks over zero
steps, a scatter whose indices would make a huge destination, and a non-numeric loss scale. Each example with its
siblings: every error names the layer or op, what it expected and what it got."""
import importlib

import numpy as np
import pytest

import fluxpy
from fluxpy import (GRU, LSTM, RNN, BatchNorm, Conv, Dense, GRUCell, LayerNorm, LSTMCell, MultiHeadAttention,
                    Recurrence, RNNCell, causal_mask, dot_product_attention, scatter)
from fluxpy.layers._checks import _describe_input

scatter_module = importlib.import_module("fluxpy.ops.scatter")

LAYERS = {"RNN": RNN, "LSTM": LSTM, "GRU": GRU}
CELLS = {"RNNCell": RNNCell, "LSTMCell": LSTMCell, "GRUCell": GRUCell}


def _state(lstm, h, c):
    return (h, c) if lstm else h


# --- 1. a recurrent state of another dtype is an error, never silently promoted --------------------------------


@pytest.mark.parametrize("name, which", [("RNN", "h"), ("GRU", "h"), ("LSTM", "h"), ("LSTM", "c")])
@pytest.mark.parametrize("batched", [True, False])
def test_layer_refuses_a_state_of_another_dtype(name, which, batched):
    rng = np.random.default_rng(0)
    n, steps, n_in, hidden = rng.integers(1, 5), rng.integers(1, 6), rng.integers(1, 5), rng.integers(1, 5)
    layer = LAYERS[name](n_in, hidden, rng=1)
    x = rng.standard_normal((n, steps, n_in) if batched else (steps, n_in)).astype(np.float32)
    lead = (n,) if batched else ()
    good, bad = (rng.standard_normal(lead + (hidden,)).astype(np.float32) for _ in range(2))
    bad = bad.astype(np.float64)
    h, c = (bad, good) if which == "h" else (good, bad)
    with pytest.raises(fluxpy.DTypeMismatch) as err:
        layer(x, _state(name == "LSTM", h, c))
    msg = str(err.value)
    assert msg.startswith(f"{layer!r} expects state {which} of dtype float32"), msg
    assert "float64" in msg and f"{which}.astype(np.float32)" in msg and "Cell" not in msg
    y = layer(x, _state(name == "LSTM", good, good.copy()))   # the same state in the parameters' dtype runs
    assert y.dtype == np.float32 and y.shape == x.shape[:-1] + (hidden,)


@pytest.mark.parametrize("name", sorted(CELLS))
@pytest.mark.parametrize("got", [np.float64, np.float16, np.int64])
def test_cell_refuses_a_state_of_another_dtype(name, got):
    rng = np.random.default_rng(1)
    n, n_in, hidden = rng.integers(1, 5), rng.integers(1, 5), rng.integers(1, 5)
    cell = CELLS[name](n_in, hidden, rng=2)
    x = rng.standard_normal((n, n_in)).astype(np.float32)
    h = rng.standard_normal((n, hidden)).astype(got)
    with pytest.raises(fluxpy.DTypeMismatch, match=rf"^{name}\(.*\) expects state h of dtype float32 .*got "
                                                    rf"\({n}, {hidden}\) {np.dtype(got).name}"):
        cell(x, _state(name == "LSTMCell", h, h.astype(np.float32)))


def test_a_float64_model_refuses_a_float32_state():
    lstm = fluxpy.f64(LSTM(3, 4, rng=0))
    x = np.random.default_rng(2).standard_normal((2, 5, 3))
    h0 = np.zeros((2, 4), np.float32)
    with pytest.raises(fluxpy.DTypeMismatch, match=r"LSTM\(3 => 4\) expects state h of dtype float64.*float32: "
                                                   r"convert state h with h.astype\(np.float64\), or the model with "
                                                   r"fluxpy.f32\(model\)"):
        lstm(x, (h0, h0.astype(np.float64)))


def test_recurrence_names_itself_for_a_state_of_another_dtype():
    r = Recurrence(GRUCell(2, 3, rng=0))
    x = np.ones((4, 5, 2), np.float32)
    with pytest.raises(fluxpy.DTypeMismatch, match=r"^Recurrence\(GRUCell\(2 => 3\)\) expects state h of dtype "
                                                   r"float32"):
        r(x, np.zeros((4, 3)))


# --- 2. another library's array: a clear error, never a crash while the message is built ----------------------


class ForeignDType:
    """A dtype that NumPy cannot interpret (as torch.float32)."""

    def __repr__(self):
        return "foreign.float32"


class ForeignArray:
    """Another library's array, as a torch tensor looks to fluxpy: a shape, a non-NumPy dtype, ``__array__`` and
    ``__dlpack__``."""

    def __init__(self, shape):
        self.shape, self.dtype = tuple(shape), ForeignDType()
        self._data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    def __array__(self, dtype=None, copy=None):
        return self._data if dtype is None else self._data.astype(dtype)

    def __dlpack__(self, stream=None):
        return self._data.__dlpack__()

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()


FOREIGN_CASES = {
    "Dense": (lambda: Dense(3, 2), (4, 3)),
    "Dense, wrong size": (lambda: Dense(5, 2), (4, 3)),
    "Conv": (lambda: Conv((3, 3), 2, 3), (1, 2, 5, 5)),
    "Conv, wrong rank": (lambda: Conv((3, 3), 2, 3), (4, 3)),
    "LayerNorm": (lambda: LayerNorm(3), (4, 3)),
    "BatchNorm": (lambda: BatchNorm(3), (4, 3, 2, 2)),
    "LSTM": (lambda: LSTM(3, 2), (4, 5, 3)),
    "GRU unbatched": (lambda: GRU(3, 2), (5, 3)),
    "RNNCell": (lambda: RNNCell(3, 2), (4, 3)),
    "LSTMCell unbatched": (lambda: LSTMCell(3, 2), (3,)),
    "MultiHeadAttention": (lambda: MultiHeadAttention(4, nheads=2), (2, 3, 4)),
}


@pytest.mark.parametrize("case", sorted(FOREIGN_CASES))
def test_a_foreign_array_gets_a_clear_error(case):
    make, shape = FOREIGN_CASES[case]
    layer, x = make(), ForeignArray(shape)
    with pytest.raises(TypeError) as err:
        layer(x)
    msg = str(err.value)
    assert msg.startswith(f"{layer!r} expects "), msg
    assert "NumPy or CuPy array" in msg and "ForeignArray" in msg and str(shape) in msg
    assert "numpy.asarray(" in msg and "from_dlpack" in msg
    if "wrong" not in case:   # the conversion the message suggests runs
        assert layer(np.asarray(x)) is not None


def test_a_foreign_state_gets_a_clear_error():
    gru = GRU(3, 2)
    with pytest.raises(TypeError, match=r"^GRU\(3 => 2\) expects state h as a NumPy or CuPy array, got a "
                                        r".*ForeignArray \(4, 2\) foreign.float32"):
        gru(np.ones((4, 5, 3), np.float32), ForeignArray((4, 2)))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_dot_product_attention_names_a_foreign_operand(which):
    arrays = [np.ones((2, 3, 4), np.float32) for _ in range(3)]
    arrays[which] = ForeignArray((2, 3, 4))
    name = "qkv"[which]
    with pytest.raises(TypeError, match=rf"dot_product_attention expects {name} as a NumPy or CuPy array, got "
                                        rf".*ForeignArray: convert it with numpy.asarray\({name}\)"):
        dot_product_attention(*arrays)


class UnprintableDType:
    def __repr__(self):
        raise RuntimeError("no repr here")

    __str__ = __repr__


class Unprintable:
    """An array-like object whose dtype raises when printed: a message about it must still be built."""
    shape, dtype = (4, 3), UnprintableDType()


class NoShape:
    @property
    def shape(self):
        raise RuntimeError("no shape here")


def test_messages_never_raise_while_they_are_built():
    with pytest.raises(TypeError, match=r"Dense\(3 => 2\) expects x as a NumPy or CuPy array, got a .*Unprintable"):
        Dense(3, 2)(Unprintable())
    assert _describe_input(NoShape()).endswith("NoShape") and _describe_input(Unprintable()).endswith("Unprintable")
    with pytest.raises(fluxpy.DimensionMismatch, match=r"Dense\(3 => 2\) expects .*got a list"):
        Dense(3, 2)([[1.0, 2.0, 3.0]])


def test_a_torch_tensor_gets_a_clear_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"Dense\(3 => 2\) expects x as a NumPy or CuPy array, got a torch.Tensor "
                                        r"\(4, 3\) torch.float32"):
        Dense(3, 2)(torch.ones(4, 3))


# --- 3. the outer layer checks its input first and names itself ------------------------------------------------


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("batched", [True, False])
def test_recurrent_layer_names_itself_for_a_wrong_feature_size(name, batched):
    rng = np.random.default_rng(3)
    n_in, wrong = 3, int(rng.integers(4, 9))
    layer = LAYERS[name](n_in, 4)
    x = np.ones((2, 5, wrong) if batched else (5, wrong), np.float32)
    with pytest.raises(fluxpy.DimensionMismatch) as err:
        layer(x)
    msg = str(err.value)
    assert msg.startswith(f"{layer!r} expects x of shape (N, T, {n_in}) (batch first) or (T, {n_in}), got "
                          f"{x.shape} float32"), msg
    assert "Cell" not in msg and "(1, " not in msg   # neither the cell nor one step's shape
    with pytest.raises(fluxpy.DTypeMismatch, match=rf"^{name}\(3 => 4.*\) expects x of dtype float32"):
        layer(np.ones(x.shape[:-1] + (n_in,)))


def test_recurrent_layer_names_itself_for_a_wrong_state_shape():
    lstm = LSTM(3, 4)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"^LSTM\(3 => 4\) expects a state of shape \(batch, hidden\) "
                                                       r"= \(2, 4\) or \(hidden,\) = \(4,\), got \(2, 5\) float32"):
        lstm(np.ones((2, 5, 3), np.float32), (np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32)))
    with pytest.raises(fluxpy.DimensionMismatch, match=r"^LSTM\(3 => 4\) expects its state as a pair \(h, c\)"):
        lstm(np.ones((2, 5, 3), np.float32), np.zeros((2, 4), np.float32))


def test_recurrence_of_a_custom_cell_names_itself():
    dense = Dense(3, 2)

    def cell(x, state):
        h = dense(x)
        return h, h
    r = Recurrence(cell)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"^Recurrence\(.*\): Dense\(3 => 2\) expects"):
        r(np.ones((2, 5, 4), np.float32))


def _mha_inputs(rng, n=2, lq=3, lk=4, dim=8):
    q = rng.standard_normal((n, lq, dim)).astype(np.float32)
    k = rng.standard_normal((n, lk, dim)).astype(np.float32)
    return q, k, k.copy()


@pytest.mark.parametrize("bad", ["q features", "k features", "v rank", "q dtype", "v dtype", "batch", "Lv"])
def test_multiheadattention_names_itself(bad):
    rng = np.random.default_rng(4)
    mha = MultiHeadAttention(8, nheads=2)
    q, k, v = _mha_inputs(rng)
    q, k, v = {"q features": (q[..., :5], k, v), "k features": (q, k[..., :6], v), "v rank": (q, k, v[0]),
               "q dtype": (q.astype(np.float64), k, v), "v dtype": (q, k, v.astype(np.float16)),
               "batch": (q, k[:1], v[:1]), "Lv": (q, k, v[:, :2])}[bad]
    with pytest.raises((fluxpy.DimensionMismatch, fluxpy.DTypeMismatch)) as err:
        mha(q, k, v)
    msg = str(err.value)
    assert msg.startswith("MultiHeadAttention(8, nheads=2) expects "), msg
    assert "Dense" not in msg and "dot_product_attention" not in msg


@pytest.mark.parametrize("bad", ["mask shape", "mask dtype", "bias shape"])
def test_multiheadattention_names_itself_for_a_mask_or_bias_that_does_not_fit(bad):
    rng = np.random.default_rng(9)
    mha = MultiHeadAttention(8, nheads=2)
    q, k, v = _mha_inputs(rng)
    kw = {"mask shape": {"mask": causal_mask(5)}, "mask dtype": {"mask": np.ones((3, 4), np.float32)},
          "bias shape": {"bias": rng.standard_normal((4, 3)).astype(np.float32)}}[bad]
    with pytest.raises(TypeError if bad == "mask dtype" else fluxpy.DimensionMismatch,
                       match=r"^MultiHeadAttention\(8, nheads=2\) expects a (boolean )?(mask|bias)"):
        mha(q, k, v, **kw)


# --- 4. zero steps: causal_mask and attention ------------------------------------------------------------------


def test_causal_mask_of_zero_and_of_numpy_ints():
    assert causal_mask(0).shape == (0, 0) and causal_mask(np.ones((2, 0, 4))).shape == (0, 0)
    n = int(np.random.default_rng(5).integers(1, 9))
    np.testing.assert_array_equal(causal_mask(np.int64(n)), causal_mask(n))
    np.testing.assert_array_equal(causal_mask(n), np.tril(np.ones((n, n), bool)))


@pytest.mark.parametrize("bad, kind", [(-1, ValueError), (np.int32(-3), ValueError), (np.ones(3), ValueError),
                                       (2.5, TypeError), ("3", TypeError), (None, TypeError)])
def test_causal_mask_refuses_what_is_no_length(bad, kind):
    with pytest.raises(kind, match=r"^causal_mask expects a length, an int >= 0, or an array \(N, L, \.\.\.\), got"):
        causal_mask(bad)


@pytest.mark.parametrize("lq", [1, 3])
def test_attention_over_zero_keys_is_a_clear_error(lq):
    q = np.ones((2, lq, 4))
    empty = np.ones((2, 0, 4))
    with pytest.raises(ValueError, match=rf"^dot_product_attention expects at least one key \(Lk >= 1\) for {lq} "
                                         rf"queries.*got q \(2, {lq}, 4\), k \(2, 0, 4\)"):
        dot_product_attention(q, empty, empty, nheads=2)
    with pytest.raises(fluxpy.DimensionMismatch, match=r"^MultiHeadAttention\(4, nheads=2\) expects at least one "
                                                       r"key"):
        MultiHeadAttention(4, nheads=2)(q.astype(np.float32), empty.astype(np.float32))


@pytest.mark.parametrize("lk", [0, 3])
def test_attention_over_zero_queries_is_empty(lk):
    rng = np.random.default_rng(6)
    n, dim, vdim, heads = 2, 4, 6, 2
    q = rng.standard_normal((n, 0, dim))
    k, v = rng.standard_normal((n, lk, dim)), rng.standard_normal((n, lk, vdim))
    y, scores = dot_product_attention(q, k, v, causal_mask(lk)[:0] if lk else None, nheads=heads)
    assert y.shape == (n, 0, vdim) and scores.shape == (n, heads, 0, lk)
    dq, dk, dv = fluxpy.gradient(lambda q, k, v: fluxpy.sum(dot_product_attention(q, k, v, nheads=heads)[0]), q, k,
                                 v)
    assert dq.shape == q.shape and not np.any(dk) and not np.any(dv)


def test_multiheadattention_over_an_empty_sequence_is_empty():
    x = np.ones((3, 0, 4), np.float32)
    y, scores = MultiHeadAttention(4, nheads=2, out_dim=5)(x, mask=causal_mask(x))
    assert y.shape == (3, 0, 5) and scores.shape == (3, 2, 0, 0)


def test_attention_of_no_feature_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^dot_product_attention expects q and k of at least one feature"):
        dot_product_attention(np.ones((1, 2, 0)), np.ones((1, 2, 0)), np.ones((1, 2, 3)))


# --- 5. scatter without dstsize: a bounded destination ----------------------------------------------------------


@pytest.mark.parametrize("form", ["1-d", "rows", "pairs", "axis"])
def test_scatter_refuses_a_huge_destination_before_allocating(form):
    rng = np.random.default_rng(7)
    huge = int(rng.integers(10**11, 10**13))
    src, idx, kw = {"1-d": (np.ones(2), np.array([0, huge]), {}),
                    "rows": (np.ones((2, 3)), np.array([0, huge]), {}),
                    "pairs": (np.ones(2), (np.array([0, 3]), np.array([huge, 1])), {}),
                    "axis": (np.ones((2, 3)), np.array([[0, 1, 2], [1, huge, 0]]), {"axis": 1})}[form]
    with pytest.raises(ValueError, match=rf"^scatter: without dstsize, the largest index {huge} makes dst of shape "
                                         rf".*more than 2147483648 .*pass dstsize"):
        scatter("+", src, idx, **kw)


def test_scatter_bound_is_on_the_entries_and_dstsize_lifts_it(monkeypatch):
    monkeypatch.setattr(scatter_module, "MAX_INFERRED_ENTRIES", 12)
    rng = np.random.default_rng(8)
    src = rng.standard_normal((2, 3))
    assert scatter("+", src, np.array([0, 3])).shape == (4, 3)   # 12 entries: within the bound
    with pytest.raises(ValueError, match=r"the largest index 4 makes dst of shape \(5, 3\), 15 entries"):
        scatter("+", src, np.array([0, 4]))
    y = scatter("+", src, np.array([0, 4]), dstsize=(5, 3))   # dstsize is the user's on purpose
    np.testing.assert_array_equal(y[[0, 4]], src)
    with pytest.raises(ValueError, match=r"the largest index 6 makes dst of shape \(2, 7\), 14 entries, more than "
                                         r"12 "):
        scatter("+", src[:, :2], np.array([[0, 6], [1, 2]]), axis=1)


# --- 6. a non-numeric loss scale -------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["abc", "1024", [2.0], 1j, True, object()])
def test_mixed_precision_refuses_a_non_numeric_loss_scale(scale):
    with pytest.raises(TypeError, match=r"loss_scale .* must be a positive finite number, got"):
        fluxpy.mixed_precision(Dense(2, 2), np.float16, loss_scale=scale)


@pytest.mark.parametrize("scale", [0.0, -4.0, float("inf"), float("nan")])
def test_mixed_precision_refuses_a_loss_scale_out_of_range(scale):
    with pytest.raises(ValueError, match=r"loss_scale .* must be a positive finite number"):
        fluxpy.mixed_precision(Dense(2, 2), np.float16, loss_scale=scale)
