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
    """For a module of cuDNN tests: algorithm choices go to a temporary cache (the cache_dir option), the plan caches
    are emptied before and after, and the kernels are registered."""
    from fluxpy.kernels import cudnn, gpu
    from fluxpy.options import options
    assert gpu.register()
    with options(cache_dir=tmp_path_factory.mktemp("fluxpy_cache")):
        cudnn.clear_cache()
        yield
        cudnn.clear_cache()


@pytest.fixture()
def graph(tmp_path):
    """The cuDNN graph module, with fluxpy's normal CuPy kernels registered (the graph versions, behind the depthwise
    dispatch, which passes on every problem but half-precision channels-last depthwise ones), a temporary disk
    cache (the cache_dir option) and empty plan caches; the options a test sets are put back after it."""
    import fluxpy
    from devices import cupy_module
    from fluxpy.kernels import cuda_conv, cuda_depthwise, cudnn, gpu
    from fluxpy.options import options
    before = options.get()
    options.set(cache_dir=tmp_path)
    cudnn.clear_cache()
    assert gpu.register()
    assert fluxpy.kernels.lookup("conv_forward", cupy_module().empty(1)) is cuda_conv.KERNELS["conv_forward"]
    assert cuda_conv.KERNELS["conv_forward"] is cuda_depthwise.conv_forward
    assert cuda_conv.KERNELS["conv_bias_act_forward"] is cudnn.graph.conv_bias_act_forward
    yield cudnn.graph
    cudnn.clear_cache()
    options.set(**before)
