"""destructure, EMA and Checkpoint on the GPU against the CPU."""
import copy

import numpy as np
import pytest

import fluxpy
from devices import assert_matches_cpu, cupy_module
from fluxpy import EMA, Chain, Checkpoint, Conv, Dense, destructure

pytestmark = pytest.mark.gpu


def _model():
    return fluxpy.f64(Chain(Checkpoint(Chain(Conv((3, 3), 2, 3, fluxpy.relu, pad=1, rng=0),
                                             Conv((3, 3), 3, 2, pad=1, rng=1))), fluxpy.flatten, Dense(50, 2, rng=2)))


def test_checkpoint_and_destructure_on_the_gpu_match_the_cpu():
    cp = cupy_module()
    cpu_model = _model()
    gpu_model = fluxpy.gpu(copy.deepcopy(cpu_model))
    x = np.random.default_rng(0).standard_normal((3, 2, 5, 5))
    flat_cpu, re_cpu = destructure(cpu_model)
    flat_gpu, re_gpu = destructure(gpu_model)
    assert_matches_cpu(flat_gpu, flat_cpu, rtol=0)
    (g_cpu,) = fluxpy.gradient(lambda v: (re_cpu(v)(x) ** 2).sum(), flat_cpu)
    (g_gpu,) = fluxpy.gradient(lambda v: (re_gpu(v)(cp.asarray(x)) ** 2).sum(), flat_gpu)
    assert_matches_cpu(g_gpu, g_cpu, rtol=1e-10, atol=1e-12)


def test_ema_on_the_gpu_matches_the_cpu():
    cp = cupy_module()
    cpu_model = Dense(4, 3, rng=0)
    gpu_model = fluxpy.gpu(copy.deepcopy(cpu_model))
    ema_cpu, ema_gpu = EMA(cpu_model, 0.9), EMA(gpu_model, 0.9)
    rng = np.random.default_rng(1)
    for _ in range(3):
        w = rng.standard_normal((3, 4)).astype(np.float32)
        cpu_model.weight[...] = w
        gpu_model.weight[...] = cp.asarray(w)
        ema_cpu.update(cpu_model)
        ema_gpu.update(gpu_model)
    assert_matches_cpu(ema_gpu.shadow[0], ema_cpu.shadow[0], rtol=1e-6)
    ema_gpu.copy_to(gpu_model)
    assert_matches_cpu(gpu_model.weight, ema_cpu.shadow[0], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vit_patch_embedding_tokens_are_c_order_on_the_gpu(dtype):
    """The ViT's tokens (the residual stream) are C order whichever layout the patch conv wrote (C order in
    float32, channels-last under mixed precision), not a strided view that every layer norm would copy, and equal
    the CPU's."""
    from fluxpy import models
    cp = cupy_module()
    embed = models.PatchEmbedding(4, 3, 16, image=(8, 12), rng=0)
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 12)).astype(np.float32)
    model = embed if dtype == "float32" else fluxpy.mixed_precision(embed, dtype)
    tokens = fluxpy.gpu(model)(cp.asarray(x))
    assert tokens.flags.c_contiguous, (tokens.shape, tokens.strides)
    want = model(x)
    assert_matches_cpu(tokens, want, rtol=1e-5 if dtype == "float32" else 2e-2, atol=1e-5 if dtype == "float32" else 2e-2)
