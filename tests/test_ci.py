"""What CI must have for the rest of the suite to mean what it says: PyTorch, which .ci/run installs, so that the
tests comparing fluxpy with PyTorch (they skip where it is missing) run there."""
import importlib.util
import os

import pytest


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI only (.ci/run installs PyTorch there)")
def test_ci_has_pytorch_for_the_comparisons():
    assert importlib.util.find_spec("torch") is not None, "CI runs without PyTorch: the comparisons would skip"
