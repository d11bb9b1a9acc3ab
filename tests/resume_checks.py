"""What the resume tests (tests/test_checkpoint_resume.py, tests/gpu/test_checkpoint_gpu.py) assert: the weights a
resumed process saved are the uninterrupted run's, bit for bit."""
import numpy as np


def assert_resumed_weights(path, want):
    """The arrays saved (``numpy.savez`` order) in ``path`` equal ``want`` in dtype and bits."""
    with np.load(path) as saved:
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
