"""fluxpy's float32 flash attention kernels (``fluxpy/kernels/cuda/flash_attention.cu``) run on the CPU, without a
GPU: the source as NVRTC gets it, compiled by g++ with ``tests/cuda_on_cpu/shim.h`` (a thread per CUDA thread,
barriers for ``__syncthreads`` and the warp shuffles, one block at a time), launched by ``fluxpy.kernels.cuda_flash``'s
own host code (its CuPy calls given NumPy, its launches the compiled library's) through
``dot_product_attention(..., need_scores=False)`` on float32 arrays, against the composite in float64. It checks the
kernels' indexing, tails, masks, broadcast strides and NaN rules; registers, speed and the GPU's own arithmetic are
``tests/gpu/test_flash_attention_gpu.py``'s. Skips where g++ lacks C++20's ``<barrier>``.
"""
import ctypes
import types

import numpy as np
import pytest

import fluxpy
from fluxpy.kernels import compiler, cuda_flash
from fluxpy.ops.attention import dot_product_attention, fused_reason
from kernel_on_cpu import build_folder, library

TOLERANCE = 3e-5   # as tests/gpu/test_flash_attention_gpu.py


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    return build_folder(tmp_path_factory, cuda_flash.SOURCE, "flash_attention.cpp")


class _Function:
    def __init__(self, library, kernel):
        self.library, self.kernel = library, kernel
        self.max_dynamic_shared_size_bytes = 0


def _argument(a):
    if isinstance(a, np.ndarray):
        assert a.dtype == np.float32, f"a kernel got a {a.dtype} array"
        return ctypes.c_void_p(a.__array_interface__["data"][0])
    kinds = {np.uint64: ctypes.c_void_p, np.int64: ctypes.c_longlong, np.int32: ctypes.c_int,
             np.float32: ctypes.c_float}
    assert type(a) in kinds, f"a kernel argument of type {type(a).__name__} ({a!r}): CuPy takes NumPy scalars"
    return kinds[type(a)](a.item())


def _launch(fn, grid, block, args, shared_mem=0):
    grid = (grid if isinstance(grid, tuple) else (int(grid),)) + (1, 1)
    block = block if isinstance(block, tuple) else (int(block),)
    assert fn.max_dynamic_shared_size_bytes >= shared_mem, "the launch did not opt into its shared memory"
    assert shared_mem <= 232448, f"{shared_mem} bytes of shared memory: more than an sm_90 block has"
    values = [_argument(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    assert fn.library.emu_launch(fn.kernel.encode(), grid[0], grid[1], grid[2], block[0], pointers) == 0


@pytest.fixture()
def on_cpu(build, monkeypatch):
    """cuda_flash's host code with NumPy for CuPy and the CPU build of each (DQK, DV) variant for its launches."""
    libraries = {}

    def function(name, kernel, defines, options=()):
        assert name == cuda_flash.SOURCE
        key = (defines["DQK"], defines["DV"])
        if key not in libraries:
            libraries[key] = library(build, cuda_flash.SOURCE, "flash_attention.cpp", defines)
        return _Function(libraries[key], kernel)

    standin = types.SimpleNamespace(ndarray=np.ndarray, empty=np.empty, ascontiguousarray=np.ascontiguousarray)
    monkeypatch.setattr(cuda_flash, "cupy", standin)
    monkeypatch.setattr(cuda_flash, "_address", lambda a: a.__array_interface__["data"][0])
    monkeypatch.setattr(compiler, "function", function)
    monkeypatch.setattr(compiler, "launch", _launch)


def _run(q, k, v, w, heads, need_scores, **kw):
    def attend(q, k, v):
        return dot_product_attention(q, k, v, nheads=heads, need_scores=need_scores, **kw)[0]
    y, back = fluxpy.pullback(attend, q, k, v)
    reason = fused_reason()
    return [np.asarray(a, np.float64) for a in (y, *back(w))], reason


def _check(q, k, v, w, heads, **kw):
    """The kernels' y, dq, dk, dv against the float64 composite's: NaN at the same places, else within TOLERANCE."""
    before = cuda_flash.stats()
    got, reason = _run(q, k, v, w, heads, False, **kw)
    assert reason == "", f"the flash kernels did not run: {reason}"
    assert cuda_flash.stats()["backward"] == before["backward"] + 1
    wide = {key: (val.astype(np.float64) if key == "bias" else val) for key, val in kw.items()}
    want, _ = _run(*(a.astype(np.float64) for a in (q, k, v, w)), heads, True, **wide)
    for name, g, r in zip(("y", "dq", "dk", "dv"), got, want):
        assert g.shape == r.shape
        differ = np.argwhere(np.isnan(g) != np.isnan(r))
        assert not len(differ), f"{name}: NaN where the composite has none, or the reverse, at {differ[:4].tolist()}"
        ok = ~np.isnan(r)
        if ok.any():
            error = np.abs(g - r)[ok].max() / max(np.abs(r[ok]).max(), 1e-30)
            assert error < TOLERANCE, f"{name}: relative error {error:.2e}"


def _draw(seed, n, lq, lk, heads, dqk, dv):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in
            ((n, lq, heads * dqk), (n, lk, heads * dqk), (n, lk, heads * dv), (n, lq, heads * dv))]


CASES = [   # n, lq, lk, heads, dqk, dv, keywords: every padded head size, tails, Lq != Lk both ways, at most 64
    # keys (the one-launch backward) and more
    (2, 33, 47, 2, 32, 32, {}),
    (1, 130, 70, 1, 16, 48, {"causal": True}),
    (1, 70, 130, 1, 48, 80, {"causal": True}),
    (1, 100, 100, 2, 128, 128, {"causal": True}),
    (1, 65, 129, 1, 80, 16, {}),
    (1, 40, 50, 2, 7, 5, {}),
    (1, 130, 40, 1, 32, 64, {"causal": True}),   # one key block, three query blocks: the one-launch backward
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_kernels_on_the_cpu_equal_the_float64_composite(on_cpu, case):
    n, lq, lk, heads, dqk, dv, kw = CASES[case]
    _check(*_draw(case, n, lq, lk, heads, dqk, dv), heads, **kw)


def test_masks_a_query_with_no_key_and_a_broadcast_bias_on_the_cpu(on_cpu):
    rng = np.random.default_rng(7)
    n, lq, lk, heads, d = 2, 70, 90, 2, 32
    arrays = _draw(7, n, lq, lk, heads, d, d)
    padding = np.arange(lk) < rng.integers(1, lk + 1, n)[:, None, None, None]
    _check(*arrays, heads, mask=padding, causal=True)
    no_key = rng.random((lq, lk)) < 0.6
    no_key[:, 0] = True
    no_key[7] = False
    _check(*arrays, heads, mask=no_key)
    _check(*arrays, heads, mask=padding, bias=rng.standard_normal((1, heads, lq, lk)).astype(np.float32))
    _check(*arrays, heads, bias=rng.standard_normal((lq, 1)).astype(np.float32))


def test_strided_inputs_and_a_broadcast_cotangent_on_the_cpu(on_cpu):
    rng = np.random.default_rng(8)
    n, length, heads, d = 2, 75, 2, 7
    f = heads * d
    qkv = rng.standard_normal((n, length, 3 * f)).astype(np.float32)   # views off 16-byte alignment: scalar loads
    w = np.broadcast_to(rng.standard_normal(f).astype(np.float32), (n, length, f))
    _check(qkv[..., :f], qkv[..., f:2 * f], qkv[..., 2 * f:], w, heads, causal=True)
