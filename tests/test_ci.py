"""What CI must have for the rest of the suite to mean what it says: PyTorch and torchvision, which .ci/run installs,
so that the tests comparing fluxpy with PyTorch and the torchvision example (they skip where these are missing) run
there."""
import importlib.util
import os

import pytest


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI only (.ci/run installs PyTorch there)")
def test_ci_has_pytorch_for_the_comparisons():
    for name in ("torch", "torchvision"):
        assert importlib.util.find_spec(name) is not None, f"CI runs without {name}: the comparisons would skip"
