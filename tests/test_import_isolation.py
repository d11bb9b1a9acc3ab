"""``import fluxpy`` changes no other library's state, and fluxpy's CUDA kernels join the kernel table on first use.

Each test runs in a fresh interpreter where a stand-in module named ``cupy`` (an array type and a ``random``
submodule) is in ``sys.modules`` before fluxpy is imported, so that fluxpy takes it for CuPy. The CUDA kernel
modules are replaced by a stub (``fluxpy.kernels.gpu._modules``) beside the real ``philox``: their code runs only
on a GPU, and what is tested here is when and how they are registered, not what they compute.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = textwrap.dedent("""
    import sys, threading, time, types
    import numpy as np

    cupy = types.ModuleType("cupy")
    cupy.random = types.ModuleType("cupy.random")

    class ndarray:
        pass

    def cupys_own_default_rng(seed):
        return ("cupy's own generator", seed)

    cupy.ndarray = ndarray
    cupy.random.default_rng = cupys_own_default_rng
    sys.modules["cupy"], sys.modules["cupy.random"] = cupy, cupy.random

    def namespaces():
        return {name: dict(vars(m)) for name, m in (("cupy", cupy), ("cupy.random", cupy.random))}

    before, modules_before = namespaces(), set(sys.modules)
    import fluxpy
    from fluxpy import kernels
    from fluxpy.kernels import gpu, philox
    from fluxpy.random import rng_for, seed
""")


def run(body):
    """Run ``PRELUDE + body`` in a fresh interpreter from the repository root; its stdout."""
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_leaves_cupy_alone_and_registers_nothing_for_it():
    out = run("""
        assert fluxpy.backend.cupy is cupy                      # the stand-in is fluxpy's CuPy
        assert namespaces() == before, "import fluxpy changed cupy's or cupy.random's attributes"
        added = sorted(m for m in set(sys.modules) - modules_before if m.split(".")[0] in ("cupy", "cupyx"))
        assert added == [], added
        assert kernels.registered("cupy") == [] and not gpu.is_registered()
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_first_use_registers_once_across_threads_and_rng_for_takes_fluxpys_generator():
    out = run("""
        calls = []

        def kernel(*args):
            return "the CUDA sum"

        def stub_modules():
            calls.append(threading.get_ident())
            time.sleep(0.2)   # other threads arrive while the table is being filled
            return (types.SimpleNamespace(KERNELS={"sum": kernel}), philox)
        gpu._modules = stub_modules

        found = []
        threads = [threading.Thread(target=lambda: found.append(kernels.find("sum", ndarray()))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(calls) == 1, calls                           # registered once
        assert found == [kernel] * 8                             # no thread saw a half-filled table
        assert ("sum", "cupy") in kernels.registered("cupy") and gpu.is_registered()
        assert kernels.lookup("sum", ndarray()) is kernel and len(calls) == 1

        seed(5)
        generator = rng_for(cupy)
        assert isinstance(generator, philox.PhiloxGenerator) and rng_for(cupy) is generator
        seed(5)
        assert rng_for(cupy).key == generator.key                # remade from the same seed
        assert namespaces() == before, "first use changed cupy's or cupy.random's attributes"
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_unregister_keeps_the_table_without_cuda_kernels_until_register():
    out = run("""
        gpu._modules = lambda: (types.SimpleNamespace(KERNELS={"sum": abs}), philox)
        assert kernels.find("sum", ndarray()) is abs
        seed(1)
        assert isinstance(rng_for(cupy), philox.PhiloxGenerator)
        gpu.unregister()
        assert kernels.registered("cupy") == []
        assert kernels.find("sum", ndarray()) is None            # no registration behind unregister's back
        assert rng_for(cupy)[0] == "cupy's own generator"       # the generator follows the table
        assert gpu.register() and kernels.find("sum", ndarray()) is abs
        assert isinstance(rng_for(cupy), philox.PhiloxGenerator)
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_unregister_before_first_use_means_no_cuda_kernels():
    out = run("""
        gpu._modules = lambda: (types.SimpleNamespace(KERNELS={"sum": abs}), philox)
        gpu.unregister()
        assert kernels.find("sum", ndarray()) is None and kernels.registered("cupy") == []
        print("ok")
    """)
    assert out.split() == ["ok"]


def test_a_snapshot_taken_before_first_use_holds_the_cuda_kernels_so_restore_keeps_them():
    out = run("""
        gpu._modules = lambda: (types.SimpleNamespace(KERNELS={"sum": abs}), philox)
        before = kernels.snapshot()
        assert before[("sum", "cupy")][0] is abs and gpu.is_registered()
        kernels.register("sum", "cupy", round)
        assert kernels.find("sum", ndarray()) is round
        kernels.restore(before)
        assert kernels.find("sum", ndarray()) is abs
        print("ok")
    """)
    assert out.split() == ["ok"]
