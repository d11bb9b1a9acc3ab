"""Every CUDA source under ``fluxpy/kernels/cuda/`` compiles for sm_90 with NVRTC, without a GPU, in every variant
its module can launch, and spills no register.

NVRTC comes from the ``nvidia-cuda-nvrtc`` pip wheel (the ``test`` extra), loaded by ctypes (``tests/nvrtc.py``).
The text and options are the GPU path's own: ``compiler.source(name)`` and ``compiler.compile_options(defines)``.
Each kernel module lists its variants with ``SOURCE_VARIANTS()`` (``(source name, defines)`` pairs made by the same
functions that pick the defines at run time, or ``(source name, defines, name expressions)`` for templated kernels,
as ``compiler.module``'s ``name_expressions``); a ``.cu`` file that no module lists fails here, and so does a module
that compiles ``.cu`` files (it names one in its text) without a ``SOURCE_VARIANTS``.
"""
import concurrent.futures
import functools
import importlib
import inspect
import os
import re
from pathlib import Path

import nvrtc
import pytest

import fluxpy
from fluxpy.kernels import compiler

ARCH = ("-arch=sm_90", "-Xptxas=-v")

if nvrtc.library() is None:
    pytest.skip("the nvidia-cuda-nvrtc wheel is not installed (pip install -e '.[test]')", allow_module_level=True)


_NAMES_A_SOURCE = re.compile(r"""["']([\w-]+\.cu)["']""")
_PACKAGE = Path(fluxpy.__file__).resolve().parent


def _kernel_modules():
    """``{module name: source text}`` of every fluxpy module that names a ``.cu`` source, holds a ``__global__``
    function or defines ``SOURCE_VARIANTS``."""
    found = {}
    for path in sorted(_PACKAGE.rglob("*.py")):
        text = path.read_text()
        if _NAMES_A_SOURCE.search(text) or "__global__" in text or "def SOURCE_VARIANTS" in text:
            name = ".".join(("fluxpy",) + path.relative_to(_PACKAGE).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = text
    return found


TEXTS = _kernel_modules()
MODULES = {name: importlib.import_module(name) for name in TEXTS}   # they import without CuPy


@functools.cache
def _attributes_of(source, options, kernel):
    result = nvrtc.compile(compiler.source(source), options, source)
    assert result.ok, f"{source} {options} does not compile:\n{result.log[-2000:]}"
    return result.attributes(kernel)


def _attributes(source, defines, kernel):
    """``(registers, local bytes, static shared bytes)`` of ``kernel`` compiled for sm_90: what a module whose
    variants depend on ptxas (layer norm's forms: the first that does not spill) asks of a compile."""
    return _attributes_of(source, compiler.compile_options(defines, ARCH), kernel)


def _formulas():
    """``(formula, hyperparameter names)`` of every exported optimiser rule and some chains: what the optimiser
    kernels are generated from (the rules live above the kernels, so this test names them)."""
    from test_optimise_rules_fused import RULES
    from fluxpy.optimise.rules import formula_of
    return [(formula_of(rule), tuple(rule.hyper())) for rule in RULES]


def _activations():
    """Every exported activation that fuses, relu and gelu first (the kernel modules compile the first two in every
    dtype, the others in float32 and float64): what the batch-norm kernels compile in (the activations live above
    the kernels, so this test names them)."""
    from fluxpy.ops import activations as A
    from fluxpy.ops.bias_act import why_not_fused
    exported = [getattr(A, n) for n in A.__all__ if n not in ("identity", "relu", "gelu")]
    return [A.relu, A.gelu] + [a for a in exported if why_not_fused(a) is None]


def _derivatives():
    """The derivative of each activation of :func:`_activations` as ``fluxpy.ops.bias_act`` passes it to the
    bias_act backward kernel (of the output or of the pre-activation): the maps of its reductions."""
    from fluxpy.ops.bias_act import derivative_from_saved
    return [derivative_from_saved(a)[0] for a in _activations()]


@functools.cache
def _variants():
    """``[(module, source, defines, name expressions)]`` of every module's ``SOURCE_VARIANTS``, each distinct
    variant once; a ``SOURCE_VARIANTS(attributes)`` is given :func:`_attributes`, a ``SOURCE_VARIANTS(formulas)``
    :func:`_formulas`, a ``SOURCE_VARIANTS(activations)`` :func:`_activations`, a ``SOURCE_VARIANTS(derivatives)``
    :func:`_derivatives`."""
    out, seen = [], set()
    for name, module in sorted(MODULES.items()):
        listing = getattr(module, "SOURCE_VARIANTS", lambda: ())
        wants = inspect.signature(listing).parameters
        given = {"attributes": _attributes, "formulas": _formulas(), "activations": _activations(),
                 "derivatives": _derivatives()}
        for source, defines, *names in listing(**{k: v for k, v in given.items() if k in wants}):
            names = tuple(names[0]) if names else ()
            key = (source, compiler.compile_options(defines), names)
            if key not in seen:
                seen.add(key)
                out.append((name, source, dict(defines), names))
    return out


def test_every_module_that_compiles_a_source_lists_its_variants():
    missing = []
    for name, module in MODULES.items():
        if _NAMES_A_SOURCE.search(TEXTS[name]) and not hasattr(module, "SOURCE_VARIANTS"):
            missing.append(name)
    assert not missing, f"modules that compile a cuda/*.cu source without a SOURCE_VARIANTS(): {missing}"


def test_every_source_file_is_compiled_by_some_variant():
    listed = {source for _, source, _, _ in _variants()}
    files = {p.name for p in compiler.SOURCE_DIR.glob("*.cu")}
    assert files, "no CUDA sources found"
    assert not files - listed, f"cuda/ sources no module's SOURCE_VARIANTS lists: {sorted(files - listed)}"
    assert not listed - files, f"SOURCE_VARIANTS name sources that do not exist: {sorted(listed - files)}"



def test_no_python_file_holds_a_kernel():
    holders = [name for name, text in TEXTS.items() if "__global__" in text]
    assert not holders, f"__global__ functions in Python files (they belong in fluxpy/kernels/cuda/): {holders}"


def _compile(variant):
    module, source, defines, names = variant
    result = nvrtc.compile(compiler.source(source), compiler.compile_options(defines, ARCH), source, names)
    return module, source, defines, result


def test_every_variant_compiles_for_sm90_without_spills():
    """One NVRTC compilation per variant (in threads: NVRTC releases nothing global between programs)."""
    failures = []
    workers = max(1, min(8, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for module, source, defines, result in pool.map(_compile, _variants()):
            if not result.ok:
                failures.append(f"{source} {defines} ({module}) does not compile:\n{result.log[-2000:]}")
            elif not result.reported():   # a spill check that saw no ptxas report would pass whatever it compiled
                failures.append(f"{source} {defines} ({module}): ptxas reported nothing (-Xptxas=-v not taken?)")
            elif result.spills():
                failures.append(f"{source} {defines} ({module}) spills registers: {result.spills()}")
    assert len(_variants()) > 50
    assert not failures, f"{len(failures)} of {len(_variants())} variants fail:\n" + "\n\n".join(failures[:10])
