"""What CI must have for the rest of the suite to mean what it says: PyTorch and torchvision, which .ci/run installs,
so that the tests comparing fluxpy with PyTorch and the torchvision example run there, and oneDNN, which the test
extra installs, so that the CPU's oneDNN tests run (each skips where its library is missing)."""
import importlib.util
import os

import pytest


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI only (.ci/run installs PyTorch there)")
def test_ci_has_pytorch_for_the_comparisons():
    for name in ("torch", "torchvision"):
        assert importlib.util.find_spec(name) is not None, f"CI runs without {name}: the comparisons would skip"


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI only (the test extra installs oneDNN there)")
def test_ci_runs_the_cpu_convolutions_through_onednn_where_the_openmp_runtime_is():
    import ctypes.util
    import sys

    from fluxpy.kernels import onednn
    if not sys.platform.startswith("linux") or ctypes.util.find_library("gomp") is None:
        pytest.skip("oneDNN's wheel needs Linux and libgomp")
    assert onednn.library() is not None, "CI runs without oneDNN: tests/test_onednn.py would skip"
