"""The float32 flash attention's planning without a GPU (``fluxpy.kernels.cuda_flash``): which problems it takes and
why not, its shared memory within an sm_90 block's, and the reasons ``dot_product_attention`` gives for running the
composite in float32 (dropout, a bias that needs a gradient, a bias of another dtype, NumPy arrays). The kernels
themselves run in tests/gpu/test_flash_attention_gpu.py; tests/test_kernel_sources.py compiles every variant.
"""
import numpy as np
import pytest

import fluxpy
from fluxpy.kernels import cuda_flash
from fluxpy.ops.attention import dot_product_attention, fused_reason

SM90_SHARED_PER_BLOCK = 232448   # bytes a block may opt into on sm_90


def _arrays(rng, n=2, lq=5, lk=7, heads=2, dqk=8, dv=8, dtype=np.float32):
    return [rng.standard_normal(s).astype(dtype) for s in ((n, lq, heads * dqk), (n, lk, heads * dqk),
                                                            (n, lk, heads * dv))]


@pytest.mark.parametrize("d", [1, 7, 16, 32, 33, 48, 64, 65, 80, 127, 128])
def test_every_head_size_up_to_128_is_taken_and_padded_to_a_compiled_size(d):
    rng = np.random.default_rng(d)
    q, k, v = _arrays(rng, dqk=d, dv=max(1, 129 - d))
    assert cuda_flash.why_not(q, k, v, 2, None) is None
    p = cuda_flash.padded(d)
    assert p in (32, 64, 128) and d <= p and (p == 32 or d > p // 2)


def test_problems_the_kernels_decline_say_why():
    rng = np.random.default_rng(0)
    q, k, v = _arrays(rng)
    assert "float32" in cuda_flash.why_not(q.astype(np.float64), k, v, 2, None)
    big = _arrays(rng, dqk=130, dv=8)
    assert "head sizes from 1 to 128, got 130 and 8" in cuda_flash.why_not(*big, 2, None)
    empty = _arrays(rng, lq=0)
    assert "at least one query" in cuda_flash.why_not(*empty, 2, None)
    strided = np.ones((2, 5, 32), np.float32)[..., ::2]
    assert "contiguous features" in cuda_flash.why_not(strided, k, v, 2, None)
    assert "bias of the scores' shape" in cuda_flash.why_not(q, k, v, 2, np.zeros((5, 7), np.float32))
    assert cuda_flash.why_not(q, k, v, 2, np.zeros((2, 2, 5, 7), np.float32)) is None
    assert "takes CuPy arrays" in cuda_flash.problem_of(q, k, v, 2, False, None)


@pytest.mark.parametrize("kernel", ["flash_forward", "flash_backward_kv", "flash_backward_q"])
def test_every_variant_fits_a_block_of_shared_memory(kernel):
    sizes = [cuda_flash.shared_bytes(kernel, d["DQK"], d["DV"]) for _, d in cuda_flash.SOURCE_VARIANTS()]
    assert len(sizes) == 9 and max(sizes) <= SM90_SHARED_PER_BLOCK, sizes


def _reason(q, **kw):
    y, scores = dot_product_attention(q, q, q, nheads=2, need_scores=False, **kw)
    assert scores is None
    ref, _ = dot_product_attention(q, q, q, nheads=2, **kw)
    if not callable(kw.get("dropout")) and not kw.get("dropout"):   # the same composite ran: the same numbers
        np.testing.assert_array_equal(y, ref)
    return fused_reason()


def test_float32_attention_says_why_it_ran_the_composite():
    q = np.random.default_rng(1).standard_normal((2, 6, 8)).astype(np.float32)
    assert "takes CuPy arrays" in _reason(q)
    assert "float32 flash" in _reason(q, causal=True, mask=np.ones((6, 6), bool))
    assert "no dropout (got p = 0.25)" in _reason(q, dropout=0.25)
    assert "float32 bias, got float64" in _reason(q, bias=np.zeros((6, 6)))

    bias = np.zeros((6, 6), np.float32)
    g = fluxpy.gradient(lambda b: dot_product_attention(q, q, q, nheads=2, bias=b, need_scores=False)[0].sum(),
                        bias)[0]
    assert "no gradient of bias" in fused_reason()
    assert g.shape == bias.shape


def test_half_and_double_precision_keep_the_cudnn_reasons():
    q = np.ones((1, 2, 8))
    dot_product_attention(q, q, q, need_scores=False)
    assert fused_reason().startswith("fused attention takes CuPy arrays")
