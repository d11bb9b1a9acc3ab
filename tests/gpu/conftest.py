import pytest


@pytest.fixture(autouse=True)
def _registered():
    """GPU tests run with fluxpy's CUDA kernels registered (a test may unregister them for a while)."""
    from fluxpy.kernels import gpu
    if gpu.register():
        yield
    else:
        pytest.skip("needs CuPy")


@pytest.fixture(scope="module")
def isolated_cudnn_cache(tmp_path_factory):
    """For a module of cuDNN tests: algorithm choices go to a temporary cache (FLUXPY_CACHE), the plan caches are
    emptied before and after, and the kernels are registered."""
    import os
    from fluxpy.kernels import cudnn, gpu
    assert gpu.register()
    old = os.environ.get("FLUXPY_CACHE")
    os.environ["FLUXPY_CACHE"] = str(tmp_path_factory.mktemp("fluxpy_cache"))
    cudnn.clear_cache()
    yield
    cudnn.clear_cache()
    if old is None:
        os.environ.pop("FLUXPY_CACHE", None)
    else:
        os.environ["FLUXPY_CACHE"] = old


@pytest.fixture()
def graph(tmp_path, monkeypatch):
    """The cuDNN graph module, with fluxpy's normal CuPy kernels registered (the graph versions), a temporary disk
    cache (FLUXPY_CACHE) and empty plan caches."""
    import fluxpy
    from devices import cupy_module
    from fluxpy.kernels import cuda_conv, cudnn, gpu
    monkeypatch.setenv("FLUXPY_CACHE", str(tmp_path))
    cudnn.clear_cache()
    assert gpu.register()
    assert fluxpy.kernels.lookup("conv_forward", cupy_module().empty(1)) is cuda_conv.KERNELS["conv_forward"]
    assert cuda_conv.KERNELS["conv_forward"] is cudnn.graph.conv_forward
    yield cudnn.graph
    cudnn.clear_cache()
