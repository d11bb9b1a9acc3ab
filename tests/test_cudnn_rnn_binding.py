"""fluxpy.kernels.cudnn.rnn's calls on the CPU, the library stood in for: every call gets as many arguments as its
signature in library.py has, each one its ctypes type takes (``argtype.from_param``), the enums cudnn_adv.h gives,
and a plan finds each layer's blocks in a weight space laid out as cuDNN's (and refuses one whose gates are not
one after the other). cuDNN itself runs in tests/gpu/test_cudnn_rnn_gpu.py."""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from fluxpy.kernels.cudnn import library
from fluxpy.kernels.cudnn import rnn as cudnn_rnn
from fluxpy.ops.rnn import RNNDims

BASE = 1 << 20   # the stand-in weight space's address


class _Library:
    """cuDNN's functions as :data:`library.SIGNATURES` / :data:`library.OPTIONAL_SIGNATURES` declare them: each
    call's arguments are converted by its argtypes (a wrong count or type raises), recorded, and answered."""

    def __init__(self, dims, layout):
        self.dims, self.layout, self.calls, self.last = dims, layout, [], None
        self.descriptors = iter(range(100, 10_000))

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        args, _ = {**library.SIGNATURES, **library.OPTIONAL_SIGNATURES}[name]

        def call(*given):
            assert len(given) == len(args), f"{name}: {len(given)} arguments, its signature has {len(args)}"
            for t, a in zip(args, given):
                t.from_param(a)   # raises where ctypes would refuse the argument
            self.calls.append((name, given))
            answer = getattr(type(self), "_" + name, None)
            return 0 if answer is None else answer(self, *given)
        return call

    @staticmethod
    def _out(ref, value):
        ref._obj.value = value

    def _cudnnCreateDropoutDescriptor(self, p):
        self._out(p, next(self.descriptors))
        return 0

    _cudnnCreateRNNDescriptor = _cudnnCreateRNNDataDescriptor = _cudnnCreateTensorDescriptor = \
        _cudnnCreateDropoutDescriptor

    def _cudnnGetRNNWeightSpaceSize(self, handle, rnn, size):
        self._out(size, self.layout["bytes"])
        return 0

    def _cudnnGetRNNTempSpaceSizes(self, handle, rnn, mode, x, work, reserve):
        self._out(work, 1000 + mode)
        self._out(reserve, 2000 * mode)
        return 0

    def _cudnnGetRNNWeightParams(self, handle, rnn, layer, size, base, lin, mdesc, maddr, bdesc, baddr):
        assert base == BASE and size == self.layout["bytes"]
        matrix = maddr is not None
        offset, count = self.layout["matrix" if matrix else "bias"][(layer, lin)]
        self._out(maddr if matrix else baddr, BASE + offset * self.dims.dtype.itemsize)
        self.last = count
        return 0

    def _cudnnGetTensorNdDescriptor(self, desc, requested, dtype, nb, dims, strides):
        self._out(nb, 3)
        dims[0], dims[1], dims[2] = 1, self.last, 1
        return 0


def _layout(dims, gap=0, swap=False):
    """cuDNN's layout (per pseudo-layer: the W gates, the R gates, then the W and R biases, each gate's block
    after the one before), ``gap`` elements between blocks; ``swap`` puts a layer's last two W gates in the
    other order (a layout fluxpy must refuse)."""
    matrix, bias, at = {}, {}, 0
    g, h = dims.gates, dims.hidden
    for layer in range(dims.num_layers * dims.directions):
        n_in = dims.weight_shapes(layer)[0][1]
        order = list(range(2 * g))
        if swap and layer == 1:
            order[g - 2], order[g - 1] = order[g - 1], order[g - 2]
        starts = {}
        for lin in order:
            n = h * (n_in if lin < g else h)
            starts[lin] = at
            at += n
        for lin in range(2 * g):
            matrix[(layer, lin)] = (starts[lin], h * (n_in if lin < g else h))
        at += gap
        for lin in range(2 * g):
            bias[(layer, lin)] = (at, h)
            at += h
        at += gap
    return {"matrix": matrix, "bias": bias, "bytes": at * dims.dtype.itemsize}


@pytest.fixture
def stand_in(monkeypatch):
    def install(dims, layout):
        lib = _Library(dims, layout)
        monkeypatch.setattr(cudnn_rnn, "fn", lib)
        monkeypatch.setattr(cudnn_rnn, "get_handle", lambda: 7)
        monkeypatch.setattr(cudnn_rnn, "cupy", SimpleNamespace(cuda=SimpleNamespace(
            alloc=lambda n: SimpleNamespace(ptr=BASE if n == layout["bytes"] else 3 << 20))))
        monkeypatch.setattr(cudnn_rnn, "descriptors", SimpleNamespace(
            data_type=lambda dt: {np.dtype(np.float32): 0, np.dtype(np.float16): 2}[np.dtype(dt)],
            compute_type=lambda dt: 0, tensor_descriptor=lambda shape, dt: next(lib.descriptors),
            destroy=lambda kind, d: None))
        return lib
    return install


@pytest.mark.parametrize("mode, layers, bidirectional, bias", [("lstm", 2, True, True), ("gru", 3, False, False),
                                                               ("rnn_relu", 1, True, True)])
def test_a_plan_finds_each_block_and_passes_cudnn_adv_enums(stand_in, mode, layers, bidirectional, bias):
    dims = RNNDims(mode, 3, 5, 4, 6, layers, bidirectional, bias, np.dtype(np.float32))
    layout = _layout(dims, gap=2)
    lib = stand_in(dims, layout)
    p = cudnn_rnn.RNNPlan(dims)
    for layer, got in enumerate(p.offsets):
        want = (layout["matrix"][(layer, 0)][0], layout["matrix"][(layer, dims.gates)][0])
        want += ((layout["bias"][(layer, 0)][0], layout["bias"][(layer, dims.gates)][0]) if bias else (None, None))
        assert got == want, f"pseudo-layer {layer}"
    assert p.work == {0: 1000, 1: 1001} and p.reserve == {0: 0, 1: 2000}
    assert p.weight_elements == layout["bytes"] // 4
    (_, args), = [c for c in lib.calls if c[0] == "cudnnSetRNNDescriptor_v8"]
    cell = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}[mode]
    # algo STANDARD, cell, DOUBLE_BIAS (2) or NO_BIAS (0), direction, LINEAR_INPUT, float, float, FMA math (3),
    # sizes, the dropout descriptor, PADDED_IO_ENABLED
    assert args[1:13] == (0, cell, 2 if bias else 0, int(bidirectional), 0, 0, 0, 3, 4, 6, 6, layers)
    assert args[13] == p.dropout and args[14] == 1
    for _, a in [c for c in lib.calls if c[0] == "cudnnSetRNNDataDescriptor"]:
        assert a[2] == 2 and a[3:5] == (5, 3) and list(a[6]) == [5, 5, 5]   # BATCH_MAJOR_UNPACKED, T, N, lengths
    (_, drop), = [c for c in lib.calls if c[0] == "cudnnSetDropoutDescriptor"]
    assert drop[2] == 0.0 and drop[3] is None and drop[4] == 0


def test_a_plan_refuses_gates_out_of_order(stand_in):
    dims = RNNDims("lstm", 2, 3, 4, 5, 1, True, True, np.dtype(np.float32))
    stand_in(dims, _layout(dims, swap=True))
    with pytest.raises(RuntimeError, match=r"cuDNN's weight layout is not the one fluxpy packs .* pseudo-layer 1, "
                                           r"linLayerID 2"):
        cudnn_rnn.RNNPlan(dims)


def test_the_calls_pass_their_arguments_in_order(stand_in):
    """forward, backward_data and backward_weights: the pointers in the header's order, None as NULL."""
    dims = RNNDims("lstm", 3, 5, 4, 6, 1, False, True, np.dtype(np.float32))
    layout = _layout(dims)
    lib = stand_in(dims, layout)
    p = cudnn_rnn.RNNPlan(dims)
    arrays = {name: SimpleNamespace(data=SimpleNamespace(ptr=addr)) for addr, name in
              enumerate("lengths x hx cx w y hy cy dy dx dhy dhx dcy dcx dw".split(), start=1 << 24)}
    a = arrays
    reserve = cudnn_rnn.forward(p, a["lengths"], a["x"], None, a["cx"], a["w"], a["y"], a["hy"], None, True)
    name, args = lib.calls[-1]
    assert name == "cudnnRNNForward"
    assert args[2] == 1 and args[3] == a["lengths"].data.ptr   # CUDNN_FWD_MODE_TRAINING
    assert args[4:14] == (p.x, a["x"].data.ptr, p.y, a["y"].data.ptr, p.h, 0, a["hy"].data.ptr, p.h, a["cx"].data.ptr,
                          0)
    assert args[14:16] == (layout["bytes"], a["w"].data.ptr) and args[16] == 1001 and args[18:] == (2000, reserve.ptr)
    cudnn_rnn.backward_data(p, a["lengths"], a["y"], a["dy"], a["dx"], a["hx"], a["dhy"], None, None, None, a["dcx"],
                            a["w"], reserve)
    name, args = lib.calls[-1]
    assert name == "cudnnRNNBackwardData_v8"
    ptr = (lambda k: a[k].data.ptr)
    assert args[2:16] == (ptr("lengths"), p.y, ptr("y"), ptr("dy"), p.x, ptr("dx"), p.h, ptr("hx"), ptr("dhy"), 0,
                          p.h, 0, 0, ptr("dcx"))
    assert args[16:] == (layout["bytes"], ptr("w"), 1001, args[19], 2000, reserve.ptr)
    cudnn_rnn.backward_weights(p, a["lengths"], a["x"], a["hx"], a["y"], a["dw"], reserve)
    name, args = lib.calls[-1]
    assert name == "cudnnRNNBackwardWeights_v8"
    assert args[2:] == (0, ptr("lengths"), p.x, ptr("x"), p.h, ptr("hx"), p.y, ptr("y"), layout["bytes"], ptr("dw"),
                        1001, args[13], 2000, reserve.ptr)   # CUDNN_WGRAD_MODE_ADD
    assert ctypes.sizeof(ctypes.c_int32) == 4
