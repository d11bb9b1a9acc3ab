"""The structure the code keeps: no import cycles, kernels below everything that uses them, devices
known only to ``backend.py`` and ``kernels/``, one kernel table."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fluxpy"


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module, is_package, level, name):
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module, path, modules):
    """The fluxpy modules that ``module`` imports, at any depth of its code (function-level imports too)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module) if node.level else node.module
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in modules and n != module)
    return out


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _find_cycle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None
    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _without_package_inits(graph):
    """Importing ``a.b`` runs ``a/__init__`` first; that edge is not a dependency of ``a.b`` on ``a``'s contents."""
    return {m: {n for n in deps if not m.startswith(n + ".")} for m, deps in graph.items()}


def test_no_import_cycles():
    cycle = _find_cycle(_without_package_inits(_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernels_import_no_optimiser_layer_training_or_op():
    for m, deps in _graph().items():
        if m.startswith("fluxpy.kernels"):
            bad = [d for d in deps if d.split(".")[1] in ("optimise", "layers", "train", "losses", "ops", "broadcast")]
            assert not bad, f"{m} imports {bad}"


def test_only_backend_and_kernels_know_cupy():
    for m, path in _modules().items():
        if m == "fluxpy.backend" or m.startswith("fluxpy.kernels"):
            continue
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}
        assert "cupy" not in names, f"{m} uses cupy: device code belongs in fluxpy/backend.py or fluxpy/kernels/"


def test_no_device_branches_outside_backend_and_kernels():
    """Ops, layers and training code never ask which array module they run on (``xp is np`` and the like)."""
    for m, path in _modules().items():
        if m == "fluxpy.backend" or m.startswith("fluxpy.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                sides = [node.left, *node.comparators]   # `xp is np`, not `func is np.where`
                names = {n.id for n in sides if isinstance(n, ast.Name)}
                assert not names & {"np", "numpy", "cupy"}, f"{m}:{node.lineno} branches on the array module"


def test_one_registry():
    """Only fluxpy.kernels registers kernels: no module keeps a table of its own keyed by array type."""
    for m, path in _modules().items():
        text = path.read_text()
        for old in ("register_fused", "register_reducer", "register_impl", "register_fused_step", "_FUSED_STEPS",
                    "_REDUCERS", "_IMPLS"):
            assert old not in text, f"{m} still has {old}"


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_imports_first(module):
    """``import fluxpy`` works whatever is imported first (no import-order dependence)."""
    run = subprocess.run([sys.executable, "-c", f"import {module}; import fluxpy; fluxpy.gradient(lambda x: (x * x).sum(), 1.0)"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# The stack: which part of fluxpy may import which (ARCHITECTURE.md draws it)

PACKAGES = ("kernels", "ops", "layers", "optimise", "distributed", "datasets", "models")
"""The sub-packages of fluxpy; every other part is a top-level module."""

LAYERS = (
    ("options", "backend"),                                     # settings; array modules and device moves
    ("layout", "capturing", "collector"),                       # memory layout; what a capture needs; the GC
    ("mutation",),                                              # the fingerprints of arrays a tape read
    ("functors",),                                              # model trees
    ("backward", "autodiff", "dual", "journal", "derivatives"),  # the tape, its backward walk, dual numbers; a
    #                                                             step's undo journal; Jacobians and Hessians
    ("kernels",),                                               # the kernel table and every device's kernels
    ("random",),                                                # seeding and generators (a GPU one from the table)
    ("ops", "broadcast"),                                       # maths and rules (NNlib)
    ("sequences",),                                             # padding and masks of variable-length sequences
    ("layers", "losses", "losses_more", "optimise", "profile", "io", "data", "observations"),  # models, losses,
    #                                                                              optimisers, files, data
    ("step", "precision", "schedules", "models", "datasets", "distributed", "checkpoint", "torch_state",
     "from_torch"),  # above the layers and optimisers
    ("train",),
    ("fluxpy",),                                                # the package's __init__: the public names
)
"""Bottom up: a part may import any part of a lower layer, and within its own layer only along SAME_LAYER."""

SAME_LAYER = {("autodiff", "backward"), ("dual", "autodiff"), ("derivatives", "autodiff"), ("broadcast", "ops"), ("data", "observations"),
              ("from_torch", "torch_state"), ("losses", "losses_more")}
"""The edges allowed inside a layer (``(importer, imported)``)."""


def _part(module):
    """The part of fluxpy a module belongs to: its sub-package, else the module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fluxpy"


def _rank():
    return {part: level for level, parts in enumerate(LAYERS) for part in parts}


def test_every_part_has_a_layer():
    rank = _rank()
    missing = sorted({_part(m) for m in _modules()} - set(rank))
    assert not missing, f"parts of fluxpy missing from LAYERS: {missing}"
    assert set(PACKAGES) <= set(rank)


def test_imports_go_down_the_stack():
    rank, bad = _rank(), []
    for m, deps in _without_package_inits(_graph()).items():
        for d in deps:
            a, b = _part(m), _part(d)
            if a != b and rank[a] <= rank[b] and (a, b) not in SAME_LAYER:
                bad.append(f"{m} -> {d}")
    assert not bad, "imports against the stack (see LAYERS):\n" + "\n".join(sorted(bad))


def _private_imports():
    """``(importer, module, name)`` of every ``from module import _name`` (or a private module) across parts."""
    modules, found = _modules(), []
    for m, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolve(m, is_package, node.level, node.module) if node.level else (node.module or "")
            if not base.startswith("fluxpy"):
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                private |= any(p.startswith("_") and not p.startswith("__") for p in base.split("."))
                if private and _part(base) != _part(m):
                    found.append((m, base, alias.name))
    return found


def test_no_private_name_is_imported_across_parts():
    found = _private_imports()
    assert not found, "private names imported across parts of fluxpy:\n" + "\n".join(
        f"{m}: from {base} import {name}" for m, base, name in found)
