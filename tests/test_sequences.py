"""Variable-length sequences (fluxpy/sequences.py): pad_sequence, unpad_sequence, batchseq and sequence_mask against
NumPy loops, and ``lengths=`` through RNN, LSTM, GRU and Recurrence against running each sequence alone at its own
length (outputs, final states, gradients), in float64 with finite differences."""
import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import GRU, LSTM, RNN, DataLoader, GRUCell, Recurrence, batchseq, pad_sequence, sequence_mask, \
    unpad_sequence
from gradcheck import check_grad

# ---------------------------------------------------------------------------------------------
# Padding helpers


def _np_pad(seqs, batch_first, value, side):
    longest = max(len(s) for s in seqs)
    out = np.full((len(seqs), longest) + seqs[0].shape[1:], value, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        if side == "right":
            out[i, :len(s)] = s
        else:
            out[i, longest - len(s):] = s
    return out if batch_first else np.swapaxes(out, 0, 1)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(lambda ls: max(ls) > 0),
       trailing=st.sampled_from([(), (2,), (2, 3)]), batch_first=st.booleans(), side=st.sampled_from(["right", "left"]),
       value=st.sampled_from([0.0, -1.5]), seed=st.integers(0, 2 ** 16))
def test_pad_sequence_matches_a_numpy_loop_and_differentiates(lengths, trailing, batch_first, side, value, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((n,) + trailing) for n in lengths]
    got = pad_sequence(seqs, batch_first=batch_first, padding_value=value, padding_side=side)
    np.testing.assert_array_equal(got, _np_pad(seqs, batch_first, value, side))
    grads = check_grad(lambda *s: pad_sequence(list(s), batch_first=batch_first, padding_value=value,
                                               padding_side=side), *seqs, rng=rng)
    assert [g.shape for g in grads] == [s.shape for s in seqs]


def test_pad_sequence_lists_dtypes_and_errors():
    ids = pad_sequence([[5, 2, 7], [3], [1, 1]])
    assert ids.dtype.kind == "i" and ids.tolist() == [[5, 2, 7], [3, 0, 0], [1, 1, 0]]
    assert pad_sequence([np.ones(2, np.float32)]).dtype == np.float32
    with pytest.raises(ValueError, match=r"pad_sequence expects sequences \(L_i, \*\) of one trailing shape and "
                                         r"dtype, got sequence 0 ndarray of shape \(2, 3\) float64 and sequence 1 "
                                         r"ndarray of shape \(2, 4\) float64"):
        pad_sequence([np.ones((2, 3)), np.ones((2, 4))])
    with pytest.raises(ValueError, match="sequence 1 ndarray of shape \\(2,\\) float32"):
        pad_sequence([np.ones(2), np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="at least one sequence"):
        pad_sequence([])
    with pytest.raises(ValueError, match=r"a time axis first, \(L_i, \*\), got sequence 0 of shape \(\)"):
        pad_sequence([np.float64(1.0)])
    with pytest.raises(ValueError, match="padding_side \"right\" or \"left\", got 'up'"):
        pad_sequence([np.ones(2)], padding_side="up")
    with pytest.raises(TypeError, match="a list of arrays of shape"):
        pad_sequence(3)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(lambda ls: max(ls) > 0),
       batch_first=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_unpad_sequence_inverts_pad_sequence(lengths, batch_first, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((n, 2)) for n in lengths]
    back = unpad_sequence(pad_sequence(seqs, batch_first=batch_first), np.array(lengths), batch_first=batch_first)
    assert len(back) == len(seqs) and all(np.array_equal(a, b) for a, b in zip(back, seqs))
    grads = check_grad(lambda p: fluxpy.concatenate(unpad_sequence(p, lengths, batch_first)),
                       pad_sequence(seqs, batch_first=batch_first), rng=rng)
    mask = sequence_mask(lengths, max(lengths))
    mask = mask if batch_first else mask.T
    assert np.all(grads[0][~mask] == 0)


def test_unpad_sequence_errors():
    with pytest.raises(ValueError, match=r"unpad_sequence expects lengths, 2 ints in \[0, 3\], got ndarray of shape "
                                         r"\(2,\) int64 from 1 to 4"):
        unpad_sequence(np.ones((2, 3)), [1, 4])
    with pytest.raises(ValueError, match="2 ints in"):
        unpad_sequence(np.ones((2, 3)), [1])
    with pytest.raises(ValueError, match=r"a padded array \(N, L, \*\)"):
        unpad_sequence(np.ones(3), [1, 1, 1])


def test_batchseq_is_mlutils():
    # MLUtils' docstring: batchseq([[1, 2, 3], [4, 5]], 0) == [[1, 4], [2, 5], [3, 0]]
    assert [b.tolist() for b in batchseq([[1, 2, 3], [4, 5]], 0)] == [[1, 4], [2, 5], [3, 0]]
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((n, 3)) for n in (2, 4, 1)]
    steps = batchseq(seqs, -1.0)
    padded = pad_sequence(seqs, padding_value=-1.0)
    assert len(steps) == 4 and all(np.array_equal(s, padded[:, t]) for t, s in enumerate(steps))


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=0, max_size=5), extra=st.integers(0, 3))
def test_sequence_mask_matches_a_loop(lengths, extra):
    maxlen = max(lengths, default=0) + extra
    want = np.array([[t < n for t in range(maxlen)] for n in lengths], dtype=bool).reshape(len(lengths), maxlen)
    np.testing.assert_array_equal(sequence_mask(np.array(lengths, dtype=np.int64), maxlen), want)
    if extra == 0:
        np.testing.assert_array_equal(sequence_mask(lengths), want)


def test_sequence_mask_errors():
    with pytest.raises(ValueError, match="sequence_mask expects lengths, a 1-d array of ints, got ndarray of shape "
                                         r"\(2,\) float64"):
        sequence_mask(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-d array of ints"):
        sequence_mask(np.ones((2, 2), int))
    with pytest.raises(ValueError, match="maxlen, an int >= 0 or None, got -1"):
        sequence_mask([1], -1)


# ---------------------------------------------------------------------------------------------
# lengths= through the recurrent layers: each sequence as if run alone


MAKERS = {"rnn": lambda i, h, r: RNN(i, h, rng=r), "lstm": lambda i, h, r: LSTM(i, h, rng=r),
          "gru": lambda i, h, r: GRU(i, h, rng=r), "recurrence": lambda i, h, r: Recurrence(GRUCell(i, h, rng=r))}


def _layer(kind, n_in, hidden, rng):
    layer = fluxpy.f64(MAKERS[kind](n_in, hidden, int(rng.integers(1 << 30))))
    layer.cell.bias[...] = rng.standard_normal(layer.cell.bias.shape) * 0.5
    return layer


def _states(state):
    return state if isinstance(state, tuple) else (state,)


def _initial(kind, how, n, hidden, rng):
    """None, one state per sequence ``(N, H)``, or one shared ``(H,)``; a pair for an LSTM."""
    if how == "none":
        return None
    shape = (n, hidden) if how == "batched" else (hidden,)
    parts = tuple(rng.standard_normal(shape) for _ in range(2 if kind == "lstm" else 1))
    return parts if kind == "lstm" else parts[0]


def _row(state, b, how):
    """Sequence ``b``'s part of an initial state, for running it alone."""
    if state is None or how == "shared":
        return state
    return tuple(s[b:b + 1] for s in state) if isinstance(state, tuple) else state[b:b + 1]


@settings(max_examples=16, deadline=None)
@given(kind=st.sampled_from(sorted(MAKERS)), n=st.integers(1, 3), steps=st.integers(1, 4), n_in=st.integers(1, 3),
       hidden=st.integers(1, 3), how=st.sampled_from(["none", "batched", "shared"]), seed=st.integers(0, 2 ** 16))
def test_each_sequence_is_as_if_run_alone(kind, n, steps, n_in, hidden, how, seed):
    rng = np.random.default_rng(seed)
    layer = _layer(kind, n_in, hidden, rng)
    lengths = rng.integers(1, steps + 1, n)
    x = rng.standard_normal((n, steps, n_in))
    x[~sequence_mask(lengths, steps)] = 0.0
    h0 = _initial(kind, how, n, hidden, rng)
    y, state = layer(x, h0, lengths=lengths, return_state=True)
    assert y.shape == (n, steps, hidden) and not np.any(y[~sequence_mask(lengths, steps)])
    assert np.array_equal(layer(x, h0, lengths=lengths), y)
    for b, length in enumerate(lengths):
        alone, alone_state = layer(x[b:b + 1, :length], _row(h0, b, how), return_state=True)
        np.testing.assert_allclose(y[b, :length], alone[0], rtol=1e-12, atol=1e-14)
        for s, a in zip(_states(state), _states(alone_state)):
            np.testing.assert_allclose(s[b], a[0], rtol=1e-12, atol=1e-14)


def _loss(layer, x, h0, lengths, cot_y, cot_s):
    y, state = layer(x, h0, lengths=lengths, return_state=True)
    total = (y * cot_y).sum()
    for s, c in zip(_states(state), cot_s):
        total = total + (s * c).sum()
    return total


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(sorted(MAKERS)), n=st.integers(1, 3), steps=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_gradients_are_the_sum_of_each_sequence_alone(kind, n, steps, seed):
    """The gradients of a loss of the outputs and final states, with respect to the input, the initial state and the
    weights: those of each sequence run alone, summed (zero for the padded steps of x)."""
    rng = np.random.default_rng(seed)
    n_in, hidden = 2, 3
    layer = _layer(kind, n_in, hidden, rng)
    lengths = rng.integers(1, steps + 1, n)
    x = rng.standard_normal((n, steps, n_in))          # padding of any finite value changes nothing
    h0 = _initial(kind, "batched", n, hidden, rng)
    cot_y = rng.standard_normal((n, steps, hidden))
    cot_s = [rng.standard_normal((n, hidden)) for _ in _states(h0)]
    gx, gh, gm = fluxpy.gradient(lambda x, h, m: _loss(m, x, h, lengths, cot_y, cot_s), x, h0, layer)
    assert not np.any(gx[~sequence_mask(lengths, steps)])
    want_w = {k: np.zeros_like(v) for k, v in gm["cell"].items() if v is not None}
    for b, length in enumerate(lengths):
        xb, hb = x[b:b + 1, :length], _row(h0, b, "batched")
        cy, cs = cot_y[b:b + 1, :length], [c[b:b + 1] for c in cot_s]
        ax, ah, am = fluxpy.gradient(lambda x, h, m: _loss(m, x, h, np.array([length]), cy, cs), xb, hb, layer)
        np.testing.assert_allclose(gx[b, :length], ax[0], rtol=1e-10, atol=1e-12)
        for g, a in zip(_states(gh), _states(ah)):
            np.testing.assert_allclose(g[b], a[0], rtol=1e-10, atol=1e-12)
        for k in want_w:
            want_w[k] += am["cell"][k]
    for k, w in want_w.items():
        np.testing.assert_allclose(gm["cell"][k], w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_finite_differences_with_lengths(kind):
    rng = np.random.default_rng(len(kind))
    layer = _layer(kind, 2, 3, rng)
    lengths = np.array([3, 1, 2])
    x = rng.standard_normal((3, 3, 2))
    h0 = _initial(kind, "shared", 3, 3, rng)

    def outputs_and_state(x, *h0):
        y, state = layer(x, h0 if kind == "lstm" else h0[0], lengths=lengths, return_state=True)
        return fluxpy.concatenate([fluxpy.reshape(y, (3, 9))] + list(_states(state)), axis=1)
    check_grad(outputs_and_state, x, *_states(h0), rng=rng)
    check_grad(lambda x: layer(x, lengths=lengths), x, rng=rng)

    def with_weight(w):
        other = copy.copy(layer)
        other.cell = copy.copy(layer.cell)
        other.cell.weight_hh = w
        y, state = other(x, lengths=lengths, return_state=True)
        return fluxpy.concatenate([fluxpy.reshape(y, (3, 9))] + list(_states(state)), axis=1)
    check_grad(with_weight, layer.cell.weight_hh, rng=rng)


def test_full_lengths_are_the_plain_call_and_a_custom_cell_with_a_list_state():
    rng = np.random.default_rng(4)
    lstm = _layer("lstm", 2, 3, rng)
    x = rng.standard_normal((2, 4, 2))
    y, (h, c) = lstm(x, lengths=[4, 4], return_state=True)
    y0, (h0, c0) = lstm(x, return_state=True)
    assert np.array_equal(y, y0) and np.array_equal(h, h0) and np.array_equal(c, c0)

    def cell(xt, state):   # a running sum, its state a list
        total = xt if state is None else xt + state[0]
        return total, [total]
    y, state = Recurrence(cell)(x, lengths=np.array([2, 3]), return_state=True)
    np.testing.assert_allclose(state[0], [x[0, :2].sum(0), x[1, :3].sum(0)])
    np.testing.assert_allclose(y[1, 2], x[1, :3].sum(0))
    assert not y[0, 2:].any() and not y[1, 3:].any()


def test_lengths_errors_name_the_layer():
    lstm = LSTM(2, 3, rng=0)
    x = np.zeros((2, 4, 2), np.float32)
    with pytest.raises(ValueError, match=r"LSTM\(2 => 3\) expects lengths in \[1, 4\] \(x's time steps, the padded "
                                         r"length\), got values from 0 to 2"):
        lstm(x, lengths=[0, 2])
    with pytest.raises(ValueError, match=r"lengths in \[1, 4\] .* from 2 to 5"):
        lstm(x, lengths=np.array([5, 2]))
    with pytest.raises(ValueError, match=r"LSTM\(2 => 3\) expects lengths of shape \(2,\), one int per sequence, "
                                         r"got \(3,\) int64"):
        lstm(x, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match=r"lengths of shape \(2,\), one int per sequence, got \(2,\) float64"):
        lstm(x, lengths=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"GRU\(2 => 3\) expects x of shape \(N, T, in\) with lengths="):
        GRU(2, 3, rng=0)(x[0], lengths=[2])

    def bad_cell(xt, state):
        return xt, {"h": xt}
    with pytest.raises(TypeError, match="must be arrays, or tuples or lists of them"):
        Recurrence(bad_cell)(x, lengths=[1, 2], return_state=True)


def test_a_dataloader_pads_sequences_for_an_lstm_that_trains():
    """The pipeline end to end: a list of (sequence, label) observations, a collate function that pads them and
    keeps their lengths, an LSTM that reads the lengths, train."""
    rng = np.random.default_rng(5)
    observations = []
    for _ in range(48):
        length = int(rng.integers(1, 7))
        seq = rng.standard_normal((length, 2)).astype(np.float32)
        observations.append((seq, np.float32(seq[:, 0].sum() > 0)))

    def collate(batch):
        seqs, labels = zip(*batch)
        return pad_sequence(list(seqs)), np.array([len(s) for s in seqs]), np.array(labels).reshape(-1, 1)
    model = {"lstm": LSTM(2, 8, rng=1), "head": fluxpy.Dense(8, 1, rng=2)}

    def loss(m, x, lengths, y):
        _, (h, _) = m["lstm"](x, lengths=lengths, return_state=True)
        return fluxpy.logitbinarycrossentropy(m["head"](h), y)
    loader = DataLoader(observations, batchsize=16, shuffle=True, rng=0, collate=collate, workers=2)
    x, lengths, y = next(iter(loader))
    assert x.shape[0] == 16 and x.shape[1] == lengths.max() and y.shape == (16, 1)
    losses = fluxpy.train(loss, model, loader, fluxpy.setup(fluxpy.Adam(0.02), model), epochs=20, progress=False)
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3])


def test_pytorch_pad_sequence_known_answers():
    """PyTorch's test_nn.py ``test_pad_sequence``, with its positional (batch_first, padding_value); the default
    batch_first differs (fluxpy's True, PyTorch's False)."""
    a, b, c = np.array([1, 2, 3]), np.array([4, 5]), np.array([6])
    expected = np.array([[4, 5, 0], [1, 2, 3], [6, 0, 0]])
    np.testing.assert_array_equal(pad_sequence([b, a, c], True), expected)
    np.testing.assert_array_equal(pad_sequence([b, a, c], False), expected.T)
    np.testing.assert_array_equal(pad_sequence([b, a, c], True, 1), [[4, 5, 1], [1, 2, 3], [6, 1, 1]])
    np.testing.assert_array_equal(pad_sequence([b, a, c], True, padding_side="left"), [[0, 4, 5], [1, 2, 3], [0, 0, 6]])
