"""NumPy kernels for one step of the recurrent cells' gates (the ops of :mod:`fluxpy.ops.recurrent`).

Each step's pointwise maths is a handful of in-place ufunc calls on whole arrays (the four LSTM gates are made
sigmoid together, the candidate overwritten with its tanh), with no Python per element and no tape:

- :func:`lstm_gates_forward` ``(gates, c_prev, gates_h, save) -> (y, act)``: ``y = stack([h, c])``
  ``(2, *lead, H)``, ``act`` the activated gates ``[i, f, g, o]`` ``(*lead, 4H)`` (None without ``save``);
- :func:`lstm_gates_backward` ``(dy, act, y, c_prev) -> (dgates, dc_prev)`` (``dc_prev`` of the full shape);
- :func:`gru_gates_forward` ``(gi, gh, h_prev, save) -> (h, act)``, ``act = [r, z, n, gh_n]`` ``(*lead, 4H)``;
- :func:`gru_gates_backward` ``(dh, act, h_prev) -> (dgi, dgh, dh_prev)`` (full shapes).

Operands broadcast along their leading axes (a state of shape ``(H,)`` serves a batch). float16 and bfloat16 are
computed in float32 and each result rounded once to the operands' dtype (the GPU kernels do the same);
:data:`KERNELS` takes calls whose arrays share one of :data:`fluxpy.kernels.halfs.KERNEL_DTYPES`.

>>> import numpy as np
>>> y, act = lstm_gates_forward(np.zeros((1, 4)), np.ones((1, 1)), None, True)
>>> y.ravel().tolist(), act.ravel().tolist()   # h = 0.5 tanh(0.5), c = 0.5 * 1 + 0.5 * 0
([0.23105857863000487, 0.5], [0.5, 0.5, 0.0, 0.5])
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .halfs import KERNEL_DTYPES, is_half

__all__ = ["lstm_gates_forward", "lstm_gates_backward", "gru_gates_forward", "gru_gates_backward", "supports",
           "KERNELS"]


def _wide(a):
    """``a`` in its compute dtype: float32 for the halves (a copy), else ``a`` itself; None stays None."""
    return a.astype(np.float32) if a is not None and is_half(a.dtype) else a


def _narrow(a, dtype):
    return a if a is None or a.dtype == dtype else a.astype(dtype)


def _lead(*arrays):
    return np.broadcast_shapes(*(a.shape[:-1] for a in arrays if a is not None))


def _sigmoid_(a):
    """``a`` replaced by ``1 / (1 + exp(-a))`` in place (exp overflowing to inf gives the exact 0)."""
    np.negative(a, out=a)
    with np.errstate(over="ignore", under="ignore"):
        np.exp(a, out=a)
    a += 1
    np.reciprocal(a, out=a)
    return a


def lstm_gates_forward(gates: np.ndarray, c_prev: np.ndarray, gates_h: np.ndarray | None = None,
                       save: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """``(y, act)``: ``z = gates + gates_h``, ``[i, f, g, o] = [sig, sig, tanh, sig](z)``, ``c = f c_prev + i g``,
    ``h = o tanh(c)``, ``y = stack([h, c])``; ``act`` (the activated gates) only with ``save``."""
    dtype = gates.dtype
    gates, c_prev, gates_h = _wide(gates), _wide(c_prev), _wide(gates_h)
    hidden = gates.shape[-1] // 4
    lead = _lead(gates, c_prev, gates_h)
    a = np.empty(lead + (4 * hidden,), gates.dtype)
    if gates_h is None:
        a[...] = gates
    else:
        np.add(gates, gates_h, out=a)
    g = a[..., 2 * hidden:3 * hidden]
    tg = np.tanh(g)
    _sigmoid_(a)
    g[...] = tg
    i, f, o = a[..., :hidden], a[..., hidden:2 * hidden], a[..., 3 * hidden:]
    y = np.empty((2,) + lead + (hidden,), a.dtype)
    h, c = y[0], y[1]
    np.multiply(f, c_prev, out=c)
    np.multiply(i, g, out=tg)
    c += tg
    np.tanh(c, out=h)
    h *= o
    return _narrow(y, dtype), (_narrow(a, dtype) if save else None)


def lstm_gates_backward(dy: np.ndarray, act: np.ndarray, y: np.ndarray,
                        c_prev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dgates, dc_prev)`` from the cotangent ``dy`` of ``y = stack([h, c])`` and the forward's ``act`` and
    ``y``: ``dc' = dc + dh o (1 - tanh(c)^2)``, ``dgates = [dc' g i(1-i), dc' c_prev f(1-f), dc' i (1-g^2),
    dh tanh(c) o(1-o)]``, ``dc_prev = dc' f`` (of the full shape)."""
    dtype = act.dtype
    dy, act, y, c_prev = _wide(dy), _wide(act), _wide(y), _wide(c_prev)
    hidden = act.shape[-1] // 4
    i, f, g, o = (act[..., k * hidden:(k + 1) * hidden] for k in range(4))
    dh, dc = dy[0], dy[1]
    tc = np.tanh(y[1])
    dz = np.empty(y.shape[1:-1] + (4 * hidden,), act.dtype)
    sd = np.subtract(1, act)
    sd *= act                                    # s (1 - s), the sigmoid's derivative (the g block unused)
    d_o = dz[..., 3 * hidden:]
    np.multiply(dh, tc, out=d_o)
    d_o *= sd[..., 3 * hidden:]
    dct = np.multiply(tc, tc)
    np.subtract(1, dct, out=dct)
    dct *= o
    dct *= dh
    dct += dc
    d_i = dz[..., :hidden]
    np.multiply(dct, g, out=d_i)
    d_i *= sd[..., :hidden]
    d_f = dz[..., hidden:2 * hidden]
    np.multiply(dct, c_prev, out=d_f)
    d_f *= sd[..., hidden:2 * hidden]
    gd = np.multiply(g, g)
    np.subtract(1, gd, out=gd)
    gd *= i
    np.multiply(dct, gd, out=dz[..., 2 * hidden:3 * hidden])
    dct *= f
    return _narrow(dz, dtype), _narrow(dct, dtype)


def gru_gates_forward(gi: np.ndarray, gh: np.ndarray, h_prev: np.ndarray,
                      save: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """``(h, act)``: ``r = sig(gi_r + gh_r)``, ``z = sig(gi_z + gh_z)``, ``n = tanh(gi_n + r gh_n)``,
    ``h = (1 - z) n + z h_prev``; ``act = [r, z, n, gh_n]`` only with ``save``."""
    dtype = gi.dtype
    gi, gh, h_prev = _wide(gi), _wide(gh), _wide(h_prev)
    hidden = gi.shape[-1] // 3
    lead = _lead(gi, gh, h_prev)
    a = np.empty(lead + ((4 if save else 3) * hidden,), gi.dtype)
    rz = a[..., :2 * hidden]
    np.add(gi[..., :2 * hidden], gh[..., :2 * hidden], out=rz)
    _sigmoid_(rz)
    r, z, n = a[..., :hidden], a[..., hidden:2 * hidden], a[..., 2 * hidden:3 * hidden]
    ghn = gh[..., 2 * hidden:]
    if save:
        a[..., 3 * hidden:] = ghn
    np.multiply(r, ghn, out=n)
    n += gi[..., 2 * hidden:]
    np.tanh(n, out=n)
    h = np.subtract(1, z)
    h *= n
    zh = np.multiply(z, h_prev)
    h += zh
    return _narrow(h, dtype), (_narrow(a, dtype) if save else None)


def gru_gates_backward(dh: np.ndarray, act: np.ndarray,
                       h_prev: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dgi, dgh, dh_prev)`` from the cotangent ``dh`` and the forward's ``act = [r, z, n, gh_n]``:
    ``dn' = dh (1 - z)(1 - n^2)``, ``dz' = dh (h_prev - n) z(1-z)``, ``dr' = dn' gh_n r(1-r)``,
    ``dgi = [dr', dz', dn']``, ``dgh = [dr', dz', dn' r]``, ``dh_prev = dh z`` (all of the full shape)."""
    dtype = act.dtype
    dh, act, h_prev = _wide(dh), _wide(act), _wide(h_prev)
    hidden = act.shape[-1] // 4
    r, z, n, ghn = (act[..., k * hidden:(k + 1) * hidden] for k in range(4))
    dgi = np.empty(dh.shape[:-1] + (3 * hidden,), act.dtype)
    dgh = np.empty_like(dgi)
    sd = np.subtract(1, act[..., :2 * hidden])
    sd *= act[..., :2 * hidden]                  # r (1 - r), z (1 - z)
    dpn = dgi[..., 2 * hidden:]
    np.subtract(1, z, out=dpn)
    dpn *= dh
    nn = np.multiply(n, n)
    np.subtract(1, nn, out=nn)
    dpn *= nn
    dpz = dgi[..., hidden:2 * hidden]
    np.subtract(h_prev, n, out=dpz)
    dpz *= dh
    dpz *= sd[..., hidden:]
    dpr = dgi[..., :hidden]
    np.multiply(dpn, ghn, out=dpr)
    dpr *= sd[..., :hidden]
    dgh[..., :2 * hidden] = dgi[..., :2 * hidden]
    np.multiply(dpn, r, out=dgh[..., 2 * hidden:])
    dhp = np.multiply(dh, z)
    return _narrow(dgi, dtype), _narrow(dgh, dtype), _narrow(dhp, dtype)


def supports(*args: Any) -> bool:
    """NumPy arrays (None and flags aside) of one dtype among float16, bfloat16, float32 and float64."""
    dtype = None
    for a in args:
        if a is None or isinstance(a, bool):
            continue
        if type(a) is not np.ndarray or a.dtype not in KERNEL_DTYPES or (dtype is not None and a.dtype != dtype):
            return False
        dtype = a.dtype
    return dtype is not None


KERNELS = {"lstm_gates_forward": (lstm_gates_forward, supports),
           "lstm_gates_backward": (lstm_gates_backward, supports),
           "gru_gates_forward": (gru_gates_forward, supports),
           "gru_gates_backward": (gru_gates_backward, supports)}
