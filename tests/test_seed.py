"""fluxpy.random.seed: one call makes initial weights, dropout masks and DataLoader orders repeat exactly."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fluxpy.data import DataLoader
from fluxpy.io import flat_state
from fluxpy.layers import (Chain, Conv, ConvTranspose, Dense, Dropout, Embedding, glorot_normal, glorot_uniform,
                           kaiming_normal, kaiming_uniform, randn32, trainmode)
from fluxpy.ops.dropout import dropout, dropout_mask
from fluxpy.random import as_rng, default_rng, rng_for, seed

ROOT = Path(__file__).resolve().parents[1]


def build():
    return Chain(Conv((3, 3), 1, 4), Dense(4, 3), Embedding(5, 2), ConvTranspose((2, 2), 2, 3))


def run(n):
    """Everything random a training run draws, after seed(n): weights, dropout masks, batch orders."""
    seed(n)
    model = build()
    x = np.ones((4, 6), np.float32)
    masks = [dropout_mask(x, 0.5), dropout(x, 0.3), trainmode(Dropout(0.5))(x)]
    loader = DataLoader(np.arange(50), batchsize=7, shuffle=True)
    orders = [np.concatenate(list(loader)) for _ in range(2)]
    inits = [f(3, 4) for f in (glorot_uniform, glorot_normal, kaiming_uniform, kaiming_normal, randn32)]
    return flat_state(model), masks, orders, inits


def same(a, b):
    (ma, da, oa, ia), (mb, db, ob, ib) = a, b
    return (ma.keys() == mb.keys() and all(np.array_equal(ma[k], mb[k]) for k in ma)
            and all(np.array_equal(x, y) for x, y in zip(da + oa + ia, db + ob + ib)))


def test_same_seed_same_run():
    first, second = run(0), run(0)
    assert same(first, second)
    models, masks, orders, _ = first
    assert not np.array_equal(orders[0], orders[1])  # a new order each epoch, the same sequence each run
    assert sorted(orders[0].tolist()) == list(range(50))


def test_different_seeds_differ_in_every_part():
    (m0, d0, o0, i0), (m1, d1, o1, i1) = run(0), run(1)
    assert all(not np.array_equal(m0[k], m1[k]) for k in m0 if m0[k].size > 1 and m0[k].any())
    assert all(not np.array_equal(a, b) for a, b in zip(d0 + o0 + i0, d1 + o1 + i1))


def test_reproducible_across_processes():
    """Two separate interpreters, same seed: the same bytes."""
    script = ("import hashlib, numpy as np, fluxpy\n"
              "from fluxpy.random import seed\n"
              "seed(7)\n"
              "m = fluxpy.Chain(fluxpy.Dense(5, 4), fluxpy.Dropout(0.5), fluxpy.Dense(4, 2))\n"
              "h = hashlib.sha256()\n"
              "for a in fluxpy.io.flat_state(m).values(): h.update(a.tobytes())\n"
              "h.update(fluxpy.dropout(np.ones(20), 0.5).tobytes())\n"
              "for b in fluxpy.DataLoader(np.arange(30), batchsize=4, shuffle=True): h.update(b.tobytes())\n"
              "print(h.hexdigest())\n")
    outs = [subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0].strip()) == 64


def test_without_seed_runs_differ():
    script = "import fluxpy; print(fluxpy.Dense(5, 4).weight.tobytes().hex())"
    outs = [subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0] != outs[1]


def test_the_global_stream_is_default_rng_of_the_seed():
    seed(123)
    a = default_rng().standard_normal(5)
    np.testing.assert_array_equal(a, np.random.default_rng(123).standard_normal(5))


def test_a_loader_made_before_seed_follows_it():
    """The generator is reset in place: objects holding it see the reset."""
    loader = DataLoader(np.arange(20), batchsize=5, shuffle=True)
    seed(3)
    first = np.concatenate(list(loader))
    seed(3)
    np.testing.assert_array_equal(np.concatenate(list(loader)), first)


def test_explicit_generators_do_not_touch_the_global_stream():
    seed(5)
    expected = default_rng().random(3)
    seed(5)
    Dense(3, 2, rng=0)
    dropout(np.ones(4), 0.5, rng=np.random.default_rng(1))
    list(DataLoader(np.arange(9), batchsize=2, shuffle=True, rng=2))
    np.testing.assert_array_equal(default_rng().random(3), expected)


def test_explicit_seeds_still_work():
    np.testing.assert_array_equal(Dense(3, 2, rng=4).weight, Dense(3, 2, rng=4).weight)
    np.testing.assert_array_equal(dropout(np.ones(9), 0.5, rng=4), dropout(np.ones(9), 0.5, rng=4))


@pytest.mark.parametrize("bad, error, message", [
    (-1, ValueError, "seed expects an int >= 0, got -1"),
    (1.5, TypeError, "seed expects an int >= 0, got float 1.5"),
    (True, TypeError, "seed expects an int >= 0, got bool True"),
    (None, TypeError, "seed expects an int >= 0, got NoneType None"),
    ("0", TypeError, "seed expects an int >= 0, got str '0'"),
])
def test_seed_rejects(bad, error, message):
    with pytest.raises(error, match=message):
        seed(bad)


def test_seed_accepts_numpy_ints():
    seed(np.int64(9))
    a = default_rng().random()
    seed(9)
    assert default_rng().random() == a


def test_as_rng():
    g = np.random.default_rng(0)
    assert as_rng(g) is g and as_rng(None) is default_rng()
    assert as_rng(np.random.SeedSequence(1)).random() == np.random.default_rng(1).random()
    with pytest.raises(ValueError, match="Dense expects an int seed >= 0, got -3"):
        as_rng(-3, "Dense")
    with pytest.raises(TypeError, match="got RandomState"):
        as_rng(np.random.RandomState(0))
    with pytest.raises(TypeError, match="glorot_uniform expects rng to be a numpy.random.Generator"):
        glorot_uniform(2, 2, rng="abc")


def test_init_dimensions_are_checked():
    with pytest.raises(ValueError, match=r"glorot_uniform expects dimensions that are ints >= 0, got \(2, 2.5\)"):
        glorot_uniform(2, 2.5)
    with pytest.raises(ValueError, match=r"randn32 expects dimensions that are ints >= 0, got \(-1,\)"):
        randn32(-1)
    assert glorot_uniform((np.int64(2), 3), rng=0).shape == (2, 3)


class FakeDeviceModule:
    """Stands in for CuPy: a module whose ``random.default_rng(seed)`` records the seeds it is given."""
    __name__ = "fakecupy"

    def __init__(self):
        self.seeds = []
        outer = self

        class random:
            @staticmethod
            def default_rng(s):
                outer.seeds.append(s)
                return np.random.default_rng(s)
        self.random = random


def test_device_generator_is_seeded_from_seed():
    xp = FakeDeviceModule()
    seed(11)
    g1 = rng_for(xp)
    assert rng_for(xp) is g1  # made once
    seed(11)
    g2 = rng_for(xp)
    assert g2 is not g1 and xp.seeds[0] == xp.seeds[1]  # remade from the same seed
    seed(12)
    rng_for(xp)
    assert xp.seeds[2] != xp.seeds[0]
    assert isinstance(xp.seeds[0], int) and 0 <= xp.seeds[0] < 2 ** 32


def test_device_generator_differs_from_the_host_stream():
    """The GPU's stream is derived from the seed, not the same numbers as the host's (documented)."""
    xp = FakeDeviceModule()
    seed(0)
    host = default_rng().random(4)
    seed(0)
    assert not np.array_equal(rng_for(xp).random(4), host)


def test_device_generator_comes_from_the_kernel_table_and_follows_it():
    """A module's "default_rng" kernel makes its generator; when the table changes, the next draw uses the new one."""
    from fluxpy import kernels
    xp = FakeDeviceModule()
    made = []

    def table_generator(s):
        made.append(s)
        return np.random.default_rng(s + 1)
    before = kernels.snapshot()
    kernels.register("default_rng", "fakecupy", table_generator)
    try:
        seed(3)
        g = rng_for(xp)
        assert rng_for(xp) is g and len(made) == 1 and xp.seeds == []   # the module's own never asked
        seed(3)
        rng_for(xp)
        assert made[1] == made[0]
    finally:
        kernels.restore(before)
    assert rng_for(xp) is not g and xp.seeds == [made[0]]   # back to the module's own, from the same seed


@pytest.mark.gpu
def test_gpu_dropout_masks_repeat_after_seed():
    import cupy

    from fluxpy.functors import gpu
    x = gpu(np.ones((64, 64), np.float32))
    seed(0)
    a = cupy.asnumpy(dropout(x, 0.5))
    seed(0)
    b = cupy.asnumpy(dropout(x, 0.5))
    np.testing.assert_array_equal(a, b)
    seed(1)
    assert not np.array_equal(cupy.asnumpy(dropout(x, 0.5)), a)
    host = cupy.asnumpy(dropout(x, 0.5, rng=np.random.default_rng(0)))  # a NumPy generator: drawn on the host
    assert set(np.unique(host).tolist()) <= {0.0, 2.0}
