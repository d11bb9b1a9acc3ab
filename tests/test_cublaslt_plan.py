"""The host side of fluxpy's cuBLASLt binding (fluxpy.kernels.cublaslt) without a GPU: the plans (epilogue per
activation, the column-major problem, every reason to decline), the descriptors built against the real libcublasLt
where one is installed (its attribute ids and sizes: a wrong size is CUBLAS_STATUS_INVALID_VALUE), and the two
kernels run end to end against :class:`FakeCublasLt`, a stand-in for the library that keeps the descriptors'
attributes and runs ``cublasLtMatmul`` on host memory by address as column-major cuBLASLt would, epilogues included.
"""
import ctypes
import itertools
import types

import numpy as np
import pytest

from fluxpy.kernels import cublaslt
from fluxpy.options import options
from fluxpy.kernels.cublas import CublasError
from fluxpy.kernels.halfs import BFLOAT16

E = cublaslt.EPILOGUES
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16]


def _gelu(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))


# ---------------------------------------------------------------------------------------------
# Plans


def test_each_activation_has_its_epilogue_with_and_without_bias_and_saving():
    table = {(act, bias, save): cublaslt.forward_epilogue(act, bias, save)
             for act, bias, save in itertools.product(cublaslt.ACTIVATIONS, (True, False), (True, False))}
    assert table[("identity", True, False)] == E["BIAS"] == 4
    assert table[("identity", False, False)] == E["DEFAULT"] == 1
    assert table[("relu", True, False)] == E["RELU_BIAS"] == 6 and table[("relu", False, False)] == E["RELU"] == 2
    assert table[("gelu", True, False)] == E["GELU_BIAS"] == 36 and table[("gelu", False, False)] == E["GELU"] == 32
    assert table[("gelu", True, True)] == E["GELU_AUX_BIAS"] == 164 and table[("gelu", False, True)] == 160
    for act in ("identity", "relu"):   # their derivatives read the output: nothing to save
        assert "saves no pre-activation" in table[(act, True, True)]
    for act in ("gelu_erf", "swish", "tanh"):
        assert f"no cuBLASLt epilogue computes {act!r}" in cublaslt.forward_epilogue(act, True, False)


def test_the_epilogue_values_are_cublasLt_h_s():
    # cublasLtEpilogue_t in cublasLt.h (CUDA 13): the backward ones are bit combinations of these
    assert (E["RELU_AUX"], E["RELU_AUX_BIAS"], E["DRELU"], E["DRELU_BGRAD"]) == (130, 134, 136, 152)
    assert (E["GELU_AUX"], E["DGELU"], E["DGELU_BGRAD"], E["BGRADA"], E["BGRADB"]) == (160, 192, 208, 256, 512)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_the_forward_plan_is_the_transposed_product_of_the_rows(dtype, lead):
    k, n = 24, 40
    x, w, b = np.zeros(lead + (k,), dtype), np.zeros((n, k), dtype), np.zeros(n, dtype)
    save = dtype != np.float32   # float32 gelu saving its pre-activation is declined (see the test below)
    p = cublaslt.forward_plan(x, w, b, "gelu", save)
    m = int(np.prod(lead)) if lead else 1
    assert (p.m, p.n, p.k, p.transa, p.transb, p.lda, p.ldb, p.ldd) == (n, m, k, 1, 0, k, k, n)
    assert p.aux_ld == (n if save else 0)
    assert p.dtype == dtype and p.epilogue == E["GELU_AUX_BIAS" if save else "GELU_BIAS"] and not p.tf32
    assert p.layouts() == ((k, n, k), (k, m, k), (n, m, n))
    assert p.align[2] == 256 and p.align[4] == (256 if save else 0) and min(p.align[0], p.align[1], p.align[3]) >= 16


def test_float32_gelu_saving_its_preactivation_is_declined_unless_tf32_computes_it():
    """cuBLASLt's float32 gelu epilogue is a pass of its own after the SIMT product, and its saved pre-activation a
    second write (measured, BENCHMARKS.md dense): the op takes the bias epilogue and its own gelu instead. The halves'
    fused epilogue, and float32 without a saved pre-activation, are planned; TF32's tensor-core product too."""
    x, w, b = np.zeros((4, 16), np.float32), np.zeros((8, 16), np.float32), np.zeros(8, np.float32)
    reason = cublaslt.forward_plan(x, w, b, "gelu", True)
    assert isinstance(reason, str) and "float32 gelu" in reason and "bias epilogue" in reason
    assert cublaslt.forward_plan(x, w, b, "gelu", False).epilogue == E["GELU_BIAS"]
    assert cublaslt.forward_plan(x, w, b, "identity", False).epilogue == E["BIAS"]
    with options(allow_tf32=True):
        assert cublaslt.forward_plan(x, w, b, "gelu", True).epilogue == E["GELU_AUX_BIAS"]


def test_tf32_follows_the_option_for_float32_only():
    from fluxpy.options import options
    x, w = np.zeros((8, 16), np.float32), np.zeros((8, 16), np.float32)
    with options(allow_tf32=True):
        assert cublaslt.forward_plan(x, w, None, "relu", False).tf32
        assert not cublaslt.forward_plan(x.astype(np.float16), w.astype(np.float16), None, "relu", False).tf32
    assert not cublaslt.forward_plan(x, w, None, "relu", False).tf32


def test_the_weight_plan_sums_the_rows_of_dz_into_the_bias_gradient():
    dz, x = np.zeros((48, 16), np.float32), np.zeros((48, 8), np.float32)
    p = cublaslt.weight_plan(dz, x, True)
    assert (p.m, p.n, p.k, p.transa, p.transb, p.lda, p.ldb, p.ldd) == (8, 16, 48, 0, 1, 8, 16, 8)
    assert p.epilogue == E["BGRADB"] and p.align[3] == 256 and p.align[4] == 0
    assert cublaslt.weight_plan(dz, x, False).epilogue == E["DEFAULT"]


def _offset(shape, dtype, elements):
    """A C-contiguous array of ``shape`` starting ``elements`` past a 256-byte aligned address."""
    dtype, size = np.dtype(dtype), int(np.prod(shape))
    buf = np.zeros((size + elements) * dtype.itemsize + 512, np.uint8)
    start = -buf.ctypes.data % 256 + elements * dtype.itemsize
    return buf[start:start + size * dtype.itemsize].view(dtype).reshape(shape)


@pytest.mark.parametrize("case, expected", [
    ("float64", "run float32, float16 and bfloat16 here, got x of float64"),
    ("mixed bias", "the bias must have x's dtype float32"),
    ("mixed weight", "the weight must have x's dtype float16"),
    ("strided x", "x must be C-contiguous"),
    ("transposed weight", "the weight must be C-contiguous"),
    ("odd in", "in features (ld of x and w) = 6 elements of float32 is 24 bytes, not a multiple of 16"),
    ("odd out half", "out features (ld of y) = 12 elements of bfloat16 is 24 bytes"),
    ("unaligned x", "x lies at an address that is not a multiple of 16 bytes"),
    ("unaligned bias", "the bias lies at an address that is not a multiple of 16 bytes"),
    ("aux ld", "the saved pre-activation's leading dimension (out features 12) must be divisible by 8"),
    ("empty", "an empty product (rows 0, out 8, in 8)"),
    ("shapes", "do not fit"),
])
def test_every_reason_to_decline_is_named(case, expected):
    f32, f16 = np.float32, np.float16
    x, w, b, act, save = np.zeros((4, 8), f32), np.zeros((8, 8), f32), np.zeros(8, f32), "gelu", False
    if case == "float64":
        x, w, b = x.astype(np.float64), w.astype(np.float64), b.astype(np.float64)
    elif case == "mixed bias":
        b = b.astype(f16)
    elif case == "mixed weight":
        x, b = x.astype(f16), b.astype(f16)
    elif case == "strided x":
        x = np.zeros((4, 16), f32)[:, ::2]
    elif case == "transposed weight":
        w = np.zeros((8, 8), f32).T
    elif case == "odd in":
        x, w = np.zeros((4, 6), f32), np.zeros((8, 6), f32)
    elif case == "odd out half":
        x, w, b = np.zeros((4, 8), BFLOAT16), np.zeros((12, 8), BFLOAT16), np.zeros(12, BFLOAT16)
    elif case == "unaligned x":
        x = _offset((4, 8), f32, 1)
    elif case == "unaligned bias":
        b = _offset((8,), f32, 2)
    elif case == "aux ld":
        x, w, b, save = np.zeros((4, 8), f32), np.zeros((12, 8), f32), np.zeros(12, f32), True
    elif case == "empty":
        x = np.zeros((0, 8), f32)
    elif case == "shapes":
        b = np.zeros(7, f32)
    got = cublaslt.forward_plan(x, w, b, act, save)
    assert isinstance(got, str) and expected in got, got
    assert got.startswith("dense: ")


def test_aligned_inputs_plan_and_their_alignment_is_what_the_heuristic_is_told():
    x, w = _offset((4, 8), np.float32, 4), _offset((8, 8), np.float32, 8)   # 16- and 32-byte aligned, not more
    p = cublaslt.forward_plan(x, w, None, "relu", False)
    assert p.align == (16, 16, 256, 0, 0)
    x, b = _offset((4, 8), np.float32, 0), _offset((8,), np.float32, 12)
    assert cublaslt.forward_plan(x, w, b, "relu", False).align == (16, 256, 256, 16, 0)
    assert [cublaslt._alignment(p) for p in (0x1000, 0x1010, 0x1020, 0x1008)] == [256, 16, 16, 8]


def test_weight_plan_reasons():
    dz, x = np.zeros((8, 12), np.float16), np.zeros((8, 16), np.float16)
    assert "out features (ld of dz) = 12 elements of float16" in cublaslt.weight_plan(dz, x, True)
    assert "x must have dz's dtype float16" in cublaslt.weight_plan(dz[:, :8].copy(), x.astype(np.float32), True)
    assert "dz (rows, out) and x (rows, in)" in cublaslt.weight_plan(np.zeros((4, 8), np.float16), x, True)


# ---------------------------------------------------------------------------------------------
# The descriptors, against the real library where it is installed (no GPU needed to build them)


def _real_library():
    path = cublaslt.library_path()
    if path is None:
        pytest.skip("no libcublasLt here (it comes with CuPy's CUDA wheels or PyTorch's nvidia wheels)")
    return cublaslt._load()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_plan_builds_its_descriptors_in_the_real_library(dtype):
    lib = _real_library()
    built = 0
    for act, bias, save in itertools.product(cublaslt.ACTIVATIONS, (True, False), (True, False)):
        x, w = np.zeros((32, 64), dtype), np.zeros((16, 64), dtype)
        plan = cublaslt.forward_plan(x, w, np.zeros(16, dtype) if bias else None, act, save)
        if isinstance(plan, str):   # an aux only gelu has; float32 gelu's aux declined as slower than fluxpy's path
            assert (save and act != "gelu") or plan == cublaslt._slower_than_ours(act, save, np.dtype(dtype)), plan
            continue
        d = cublaslt._Described(lib, plan)
        assert d.desc and d.pref and len(d.layouts) == 3 and all(d.layouts)
        d.point(cublaslt._DESC_BIAS_POINTER, 1 << 20)
        d.point(cublaslt._DESC_AUX_POINTER, 1 << 21)
        d.close()
        built += 1
    for need_db in (True, False):
        d = cublaslt._Described(lib, cublaslt.weight_plan(np.zeros((32, 16), dtype), np.zeros((32, 8), dtype), need_db))
        d.close()
        built += 1
    assert built == (8 if dtype == np.float32 else 10)


def test_a_failed_call_names_the_call_and_the_status():
    lib = _real_library()
    d = cublaslt._Described(lib, cublaslt.weight_plan(np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32),
                                                       True))
    with pytest.raises(CublasError, match=r"cublasLtMatmulDescSetAttribute failed with CUBLAS_STATUS_INVALID_VALUE "
                                          r"\(7\) on the epilogue as 8 bytes"):
        cublaslt._set(lib, lib.cublasLtMatmulDescSetAttribute, d.desc, cublaslt._DESC_EPILOGUE, ctypes.c_uint64(4),
                      "the epilogue as 8 bytes")
    d.close()


# ---------------------------------------------------------------------------------------------
# A stand-in for libcublasLt: descriptors as Python objects, cublasLtMatmul on host memory by address


_TYPES = {0: np.dtype(np.float32), 2: np.dtype(np.float16), 14: BFLOAT16, 1: np.dtype(np.float64)}


class FakeCublasLt:
    """The calls of :data:`cublaslt._SIGNATURES` on host memory. ``cublasLtMatmul`` computes, in float64,
    ``D = op(A) op(B)`` of the column-major matrices its layouts describe, then the epilogue the descriptor names:
    the bias (one per row of ``D``), relu or the tanh gelu, the pre-activation to the aux buffer (``_AUX``), or the
    sums of ``op(B)`` over ``k`` to the bias pointer (``BGRADB``). Every pointer must be as aligned as the heuristic
    was told, and every access inside a registered buffer. ``no_algorithm``: epilogues the heuristic finds nothing
    for (``refuse``: it answers CUBLAS_STATUS_NOT_SUPPORTED for them, as cuBLASLt does where no heuristic applies)."""

    def __init__(self):
        self.objects, self.buffers, self.calls, self.no_algorithm, self.refuse = {}, [], [], set(), False

    def register(self, *arrays):
        for x in arrays:
            if x is not None:
                root = x
                while isinstance(root.base, np.ndarray):
                    root = root.base
                self.buffers.append((root.__array_interface__["data"][0], root.nbytes))

    def _new(self, out, obj):
        key = 0x1000 + len(self.objects)
        self.objects[key] = obj
        out._obj.value = key
        return 0

    def cublasLtCreate(self, h):
        return self._new(h, {"handle": True})

    def cublasLtMatmulDescCreate(self, d, compute, scale):
        assert compute in (68, 77) and scale == 0
        return self._new(d, {"compute": compute})

    def cublasLtMatmulDescSetAttribute(self, d, attr, ref, size):
        assert ctypes.sizeof(ref._obj) == size
        self.objects[d][attr] = ref._obj.value
        return 0

    def cublasLtMatmulDescDestroy(self, d):
        del self.objects[d]
        return 0

    def cublasLtMatrixLayoutCreate(self, lay, dtype, rows, cols, ld):
        assert ld >= rows >= 1 and cols >= 1
        return self._new(lay, {"type": _TYPES[dtype], "rows": rows, "cols": cols, "ld": ld})

    def cublasLtMatrixLayoutDestroy(self, lay):
        del self.objects[lay]
        return 0

    def cublasLtMatmulPreferenceCreate(self, p):
        return self._new(p, {})

    cublasLtMatmulPreferenceSetAttribute = cublasLtMatmulDescSetAttribute

    def cublasLtMatmulPreferenceDestroy(self, p):
        del self.objects[p]
        return 0

    def cublasLtMatmulAlgoGetHeuristic(self, h, d, a, b, c, dd, pref, requested, results, count):
        assert requested == 1 and c == dd and self.objects[h]["handle"]
        desc = self.objects[d]
        found = desc[cublaslt._DESC_EPILOGUE] not in self.no_algorithm
        # what the algorithm was chosen for: the alignments of A, B and D, and of the bias and aux pointers (their
        # values at this point stand for them)
        prefs = self.objects[pref]
        desc["claims"] = {"A": prefs[5], "B": prefs[6], "D": prefs[8], "bias": desc.get(cublaslt._DESC_BIAS_POINTER),
                          "aux": desc.get(cublaslt._DESC_AUX_POINTER)}
        results._obj.state = 0 if found else 15
        results._obj.algo[0] = d   # the descriptor it was chosen for
        count._obj.value = int(found)
        return 0 if found or not self.refuse else 15   # cuBLASLt may say NOT_SUPPORTED rather than find nothing

    def _view(self, ptr, dtype, rows, cols, ld):
        """The column-major ``rows x cols`` matrix at ``ptr`` (a writable view), after checking the range."""
        start, end = ptr, ptr + ((cols - 1) * ld + rows) * dtype.itemsize
        assert any(b <= start and end <= b + n for b, n in self.buffers), "cuBLASLt would read or write outside"
        raw = np.frombuffer((ctypes.c_char * (end - start)).from_address(start), dtype=dtype)
        return np.lib.stride_tricks.as_strided(raw, (rows, cols), (dtype.itemsize, ld * dtype.itemsize))

    def cublasLtMatmul(self, h, d, alpha, A, a_layout, B, b_layout, beta, C, c_layout, D, d_layout, algo, ws,
                       ws_bytes, stream):
        assert algo._obj[0] == d and C == D and c_layout == d_layout   # C is D, read with beta 0
        desc, la, lb, lc = (self.objects[k] for k in (d, a_layout, b_layout, d_layout))
        assert (alpha._obj.value, beta._obj.value) == (1.0, 0.0) and ws and ws_bytes == cublaslt.WORKSPACE_BYTES
        dtype = lc["type"]
        assert la["type"] == lb["type"] == dtype
        claims = desc["claims"]
        for name, ptr in (("A", A), ("B", B), ("D", D), ("bias", desc.get(cublaslt._DESC_BIAS_POINTER)),
                          ("aux", desc.get(cublaslt._DESC_AUX_POINTER))):
            if claims[name]:
                assert ptr % claims[name] == 0, f"{name} at {ptr:#x} is less aligned than the {claims[name]} bytes " \
                                                "the algorithm was chosen for"
        a = self._view(A, dtype, la["rows"], la["cols"], la["ld"]).astype(np.float64)
        b = self._view(B, dtype, lb["rows"], lb["cols"], lb["ld"]).astype(np.float64)
        a = a.T if desc.get(cublaslt._DESC_TRANSA, 0) == 1 else a
        b = b.T if desc.get(cublaslt._DESC_TRANSB, 0) == 1 else b
        m, n = lc["rows"], lc["cols"]
        assert a.shape[0] == m and b.shape[1] == n and a.shape[1] == b.shape[0], "op(A) op(B) does not fit D"
        z = a @ b
        epilogue = desc.get(cublaslt._DESC_EPILOGUE, E["DEFAULT"])
        self.calls.append(epilogue)
        bias_ptr, aux_ptr = desc.get(cublaslt._DESC_BIAS_POINTER), desc.get(cublaslt._DESC_AUX_POINTER)
        if epilogue & 4:
            z = z + self._view(bias_ptr, dtype, m, 1, m)[:, 0].astype(np.float64)[:, None]
        if epilogue & 128:
            assert epilogue & 32, "only gelu's pre-activation is asked for"
            aux_ld = desc[cublaslt._DESC_AUX_LD]
            assert aux_ld % 8 == 0 and aux_ld >= m and aux_ptr % 16 == 0
            self._view(aux_ptr, dtype, m, n, aux_ld)[...] = z.astype(dtype)
        if epilogue & 2:
            z = np.maximum(z, 0)
        if epilogue & 32:
            z = _gelu(z)
        if epilogue & 512:
            self._view(bias_ptr, dtype, n, 1, n)[:, 0] = b.sum(axis=0).astype(dtype)
        assert not epilogue & (8 | 16 | 64 | 256), "an epilogue the binding does not use"
        self._view(D, dtype, m, n, lc["ld"])[...] = z.astype(dtype)
        return 0


def test_the_stand_in_has_the_signatures_the_binding_declares():
    import inspect
    for name, args in cublaslt._SIGNATURES.items():
        assert len(inspect.signature(getattr(FakeCublasLt, name)).parameters) - 1 == len(args), name


def fake_library(patch, dtypes=(), out_align=512):
    """Run the binding against a :class:`FakeCublasLt` and NumPy arrays standing for CuPy's (``patch``: a
    MonkeyPatch), new arrays ``out_align``-byte aligned as CuPy's; ``dtypes`` adds ``(cudaDataType code, dtype)``
    pairs the plans accept (float64, ``1``, for gradient checks)."""
    fake = FakeCublasLt()

    def empty(shape, dtype):
        dtype, size = np.dtype(dtype), int(np.prod(shape))
        buf = np.empty(size * dtype.itemsize + 3 * out_align, np.uint8)
        start = -buf.ctypes.data % (2 * out_align) + out_align   # aligned to out_align, not to twice that
        out = buf[start:start + size * dtype.itemsize].view(dtype).reshape(shape)
        fake.register(out)
        return out

    def allocation(nbytes):
        buf = np.empty(nbytes, np.uint8)
        fake.register(buf)
        return types.SimpleNamespace(ptr=buf.ctypes.data, keep=buf)
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=0),
                                 Memory=allocation)
    patch.setattr(cublaslt, "cupy", types.SimpleNamespace(ndarray=np.ndarray, empty=empty, cuda=cuda,
                                                          empty_like=lambda y: empty(y.shape, y.dtype)))
    patch.setattr(cublaslt, "_address", lambda x: x.__array_interface__["data"][0])
    patch.setattr(cublaslt, "_load", lambda: fake)
    patch.setattr(cublaslt, "_devices", {})
    patch.setattr(cublaslt, "_problems", {})
    patch.setattr(cublaslt, "_declined", {})
    patch.setattr(cublaslt, "_counts", __import__("collections").Counter())
    for code, dtype in dtypes:
        patch.setitem(cublaslt._DATA_TYPES, np.dtype(dtype), code)
    return fake


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act, bias, save", [("identity", True, False), ("identity", False, False),
                                             ("relu", True, False), ("gelu", True, True), ("gelu", False, True),
                                             ("gelu", True, False)])
def test_the_forward_kernel_computes_the_composite(dtype, act, bias, save):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, 32)).astype(dtype)
    w = (rng.standard_normal((24, 32)) / 6).astype(dtype)
    b = rng.standard_normal(24).astype(dtype) if bias else None
    with pytest.MonkeyPatch.context() as patch:
        fake = fake_library(patch)
        fake.register(x, w, b)
        if save and dtype == np.float32:   # declined (the test above): the op runs the bias epilogue and its gelu
            assert not cublaslt.dense_forward_supports(x, w, b, act, save)
            return
        assert cublaslt.dense_forward_supports(x, w, b, act, save)
        y, aux = cublaslt.dense_forward(x, w, b, act, save)
        assert cublaslt.stats() == {"built": 1, "dense_forward": 1}
        cublaslt.dense_forward(x, w, b, act, save)   # the same problem again: nothing new is built
        assert cublaslt.stats() == {"built": 1, "dense_forward": 2}
    z = x.astype(np.float64) @ w.astype(np.float64).T + (0 if b is None else b.astype(np.float64))
    want = {"identity": z, "relu": np.maximum(z, 0), "gelu": _gelu(z)}[act]
    tol = 1e-5 if dtype == np.float32 else 2e-2
    assert y.shape == (3, 5, 24) and y.dtype == dtype
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    if save:
        assert aux.shape == y.shape and aux.dtype == dtype
        np.testing.assert_allclose(aux.astype(np.float64), z, rtol=tol, atol=tol)
    else:
        assert aux is None
    assert fake.calls == [cublaslt.forward_epilogue(act, bias, save)] * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("need_db", [True, False])
def test_the_weight_kernel_gives_the_weight_and_bias_gradients(dtype, need_db):
    rng = np.random.default_rng(8)
    dz, x = rng.standard_normal((40, 16)).astype(dtype), rng.standard_normal((40, 24)).astype(dtype)
    with pytest.MonkeyPatch.context() as patch:
        fake = fake_library(patch)
        fake.register(dz, x)
        assert cublaslt.dense_backward_weight_supports(dz, x, need_db)
        dw, db = cublaslt.dense_backward_weight(dz, x, need_db)
    tol = 1e-5 if dtype == np.float32 else 3e-2
    np.testing.assert_allclose(dw.astype(np.float64), dz.astype(np.float64).T @ x.astype(np.float64), rtol=tol,
                               atol=tol * 8)
    if need_db:
        np.testing.assert_allclose(db.astype(np.float64), dz.astype(np.float64).sum(0), rtol=tol, atol=tol * 8)
    else:
        assert db is None
    assert fake.calls == [E["BGRADB"] if need_db else E["DEFAULT"]]


@pytest.mark.parametrize("refuse", [False, True])
def test_a_problem_without_an_algorithm_is_declined_once_and_remembered(refuse):
    x, w = np.ones((8, 16), np.float32), np.ones((8, 16), np.float32)
    with pytest.MonkeyPatch.context() as patch:
        fake = fake_library(patch)
        fake.register(x, w)
        fake.no_algorithm.add(E["GELU"])
        fake.refuse = refuse
        assert not cublaslt.dense_forward_supports(x, w, None, "gelu", False)
        assert not cublaslt.dense_forward_supports(x, w, None, "gelu", False)
        assert cublaslt.stats() == {"built": 1, "no_algorithm": 1}
        (plan, why), = cublaslt.declined().items()
        assert plan.epilogue == E["GELU"]
        assert why == ("cublasLtMatmulAlgoGetHeuristic gave CUBLAS_STATUS_NOT_SUPPORTED" if refuse else
                       "cublasLtMatmulAlgoGetHeuristic found no algorithm (state 15)")
        assert cublaslt.dense_forward_supports(x, w, None, "relu", False)
        assert fake.calls == []


def test_outputs_less_aligned_than_planned_get_a_plan_of_their_own():
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.MonkeyPatch.context() as patch:
        fake = fake_library(patch, out_align=16)
        fake.register(x, w)
        assert cublaslt.dense_forward_supports(x, w, None, "relu", False)
        y, _ = cublaslt.dense_forward(x, w, None, "relu", False)
        assert cublaslt.stats() == {"built": 2, "dense_forward": 1}
        assert sorted(p.align[2] for p in cublaslt._devices[0].plans) == [16, 256]
    np.testing.assert_allclose(y, np.maximum(x @ w.T, 0), rtol=1e-5, atol=1e-5)


def _at_offset(a, offset, align=256):
    """A copy of ``a`` whose first element lies ``offset`` bytes past an ``align``-byte boundary."""
    buf = np.empty(a.nbytes + 2 * align, np.uint8)
    start = -buf.ctypes.data % align + offset
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_a_problem_is_planned_once_and_other_alignments_and_layouts_apart():
    rng = np.random.default_rng(12)
    x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    planned = []
    original = cublaslt.forward_plan
    with pytest.MonkeyPatch.context() as patch:
        fake = fake_library(patch)
        patch.setattr(cublaslt, "forward_plan", lambda *a: planned.append(1) or original(*a))
        views = {offset: _at_offset(x, offset) for offset in (0, 16, 4)}
        fake.register(w, *views.values())
        for _ in range(2):   # each problem twice: planned on its first call only
            for offset in (0, 16):
                assert cublaslt.dense_forward_supports(views[offset], w, None, "relu", False)
                y, _ = cublaslt.dense_forward(views[offset], w, None, "relu", False)
                np.testing.assert_allclose(y, np.maximum(x @ w.T, 0), rtol=1e-5, atol=1e-5)
        assert len(planned) == 2   # 256- and 16-byte aligned rows: two alignment classes, two plans
        # 4 bytes past a boundary: not the 16-byte class's plan but its own decision, declined
        assert not cublaslt.dense_forward_supports(views[4], w, None, "relu", False)
        with pytest.raises(ValueError, match="not a multiple of 16 bytes"):
            cublaslt.dense_forward(views[4], w, None, "relu", False)
        # the same shape with other strides (a transposed copy's view) is another problem: declined, not reused
        column_major = np.asfortranarray(x)
        fake.register(column_major)
        assert not cublaslt.dense_forward_supports(column_major, w, None, "relu", False)
        assert len(planned) == 4
    assert len(fake.calls) == 4


def test_a_declined_call_to_the_kernel_itself_raises_the_reason():
    x, w = np.ones((8, 5), np.float32), np.ones((8, 5), np.float32)
    with pytest.MonkeyPatch.context() as patch:
        fake_library(patch)
        with pytest.raises(ValueError, match=r"in features \(ld of x and w\) = 5 elements .* supports function"):
            cublaslt.dense_forward(x, w, None, "relu", False)


def test_clear_cache_destroys_the_descriptors():
    x, w = np.ones((8, 16), np.float32), np.ones((8, 16), np.float32)
    with pytest.MonkeyPatch.context() as patch:
        fake = fake_library(patch)
        fake.register(x, w)
        cublaslt.dense_forward(x, w, None, "relu", False)
        live = {k for k, v in fake.objects.items() if "handle" not in v}
        assert len(live) == 5   # a matmul descriptor, three layouts, a preference
        cublaslt.clear_cache()
        assert {k for k, v in fake.objects.items() if "handle" not in v} == set() and cublaslt.stats() == {}
