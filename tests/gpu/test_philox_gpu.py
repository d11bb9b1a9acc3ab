"""The GPU's Philox generator (``fluxpy.kernels.philox.PhiloxGenerator``, CuPy's default generator in fluxpy)
against its NumPy reference, bit for bit; its position on the device continues from draw to draw, also
inside a CUDA graph replayed several times; ``fluxpy.seed`` makes it again.
Every test needs a GPU (``gpu`` marker; tests/conftest.py skips them elsewhere).
"""
import numpy as np
import pytest

import fluxpy
from fluxpy.kernels.philox import PER_COUNTER, PhiloxGenerator, uniform_numpy
from fluxpy.random import rng_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (4,), (5, 7), (1000003,), (0, 3)])
def test_draws_match_the_reference_and_continue(dtype, shape):
    import cupy as cp
    gen = PhiloxGenerator(2**33 + 5)
    n = int(np.prod(shape))
    per = PER_COUNTER[np.dtype(dtype)]
    first, second = gen.random(shape, dtype=dtype), gen.random(shape, dtype=dtype)
    assert first.shape == shape and first.dtype == dtype
    np.testing.assert_array_equal(cp.asnumpy(first).ravel(), uniform_numpy(gen.key, 0, n, dtype))
    np.testing.assert_array_equal(cp.asnumpy(second).ravel(), uniform_numpy(gen.key, -(-n // per), n, dtype))
    assert int(gen.offset()[0]) == 2 * (-(-n // per))


def test_it_is_cupys_generator_in_fluxpy_and_seed_makes_it_again():
    import cupy as cp
    fluxpy.seed(3)
    gen = rng_for(cp)
    assert isinstance(gen, PhiloxGenerator)
    a = cp.asnumpy(gen.random(10, dtype=np.float32))
    fluxpy.seed(3)
    assert rng_for(cp) is not gen
    np.testing.assert_array_equal(cp.asnumpy(rng_for(cp).random(10, dtype=np.float32)), a)


def test_a_captured_draw_draws_new_numbers_at_every_replay():
    import cupy as cp
    from fluxpy.backend import capture_graph
    gen = PhiloxGenerator(11)
    gen.random(8, dtype=np.float32)   # the kernels and the position exist before the capture
    graph, out = capture_graph(lambda: gen.random(8, dtype=np.float32))
    for k in range(1, 4):   # counters 2, 3 (the capture queued nothing), 4, 5, ...
        graph.launch()
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), uniform_numpy(gen.key, 2 * k, 8, np.float32))
