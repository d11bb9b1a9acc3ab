import pytest


@pytest.fixture(autouse=True)
def _registered():
    """GPU tests run with fluxpy's CUDA kernels registered (a test may unregister them for a while)."""
    from fluxpy.kernels import gpu
    if gpu.register():
        yield
    else:
        pytest.skip("needs CuPy")
