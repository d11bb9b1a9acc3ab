"""fluxpy.options: reading, setting for the process and for a block (restored on an error too), validation that
changes nothing, the defaults from the environment, and the kernels reading the one table."""
import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.options import Options, options

NAMES = ["allow_tf32", "autotune", "cache_dir", "cpu_heap_keep_mb", "cublas_library", "cudnn_library", "deterministic", "disk_cache",
         "index_checks", "mutation_checks", "search_budget_ms", "value_checks", "workspace_limit"]

# One value each option takes, other than its default (a cache_dir and library paths that need not exist).
OTHER = {"allow_tf32": True, "deterministic": True, "workspace_limit": 1 << 20, "autotune": 0, "search_budget_ms": 0.0,
         "disk_cache": False, "cache_dir": "/tmp/fluxpy-test-options", "index_checks": "wait",
         "value_checks": True, "mutation_checks": False, "cudnn_library": "/opt/no/libcudnn.so.9", "cublas_library": "/opt/no/libcublas.so",
         "cpu_heap_keep_mb": 64}

# Values each option refuses, and the words of what it expects.
BAD = {"allow_tf32": ([1, "yes", None], "True or False"),
       "deterministic": ([0, "on"], "True or False"),
       "workspace_limit": ([-1, 1.5, True, "4GB"], "an int >= 0"),
       "autotune": ([-3, 2.0, False], "an int >= 0"),
       "search_budget_ms": ([-1, "2000", True], "a number of milliseconds >= 0"),
       "disk_cache": ([1, None], "True or False"),
       "cache_dir": (["", None, 3], "a folder"),
       "index_checks": (["Deferred", "later", True, None], "'wait' or 'deferred'"),
       "value_checks": (["yes", 1, 0.5, None], "'auto', True or False"),
       "mutation_checks": (["on", 0, None], "'auto', True or False"),
       "cudnn_library": (["", 9], "a library path"),
       "cublas_library": (["", b"x"], "a library path"),
       "cpu_heap_keep_mb": ([-1, 2048, 1.0, True, "256"], "a number of MiB from 0 to 2047")}


def test_every_option_is_read_as_an_attribute_and_listed_by_get():
    values = options.get()
    assert list(values) == NAMES == sorted(OTHER) == sorted(BAD)
    for name in NAMES:
        assert getattr(options, name) == values[name]
        assert name in dir(options)
    assert fluxpy.options is options
    assert repr(options).startswith("fluxpy.options(allow_tf32=")


def test_the_defaults():
    want = {"allow_tf32": False, "deterministic": False, "workspace_limit": 4 << 30, "autotune": 8,
            "search_budget_ms": 2000.0, "disk_cache": True, "index_checks": "deferred"}
    got = Options({}).get()
    assert {k: got[k] for k in want} == want
    assert got["value_checks"] == "auto" and got["cudnn_library"] is None and got["cublas_library"] is None
    assert got["cpu_heap_keep_mb"] == 256
    assert got["cache_dir"] == os.path.join(os.path.expanduser("~"), ".cache", "fluxpy")


@pytest.mark.parametrize("name", NAMES)
def test_set_changes_the_process_option_and_returns_the_previous_value(name):
    before = options.get()
    old = options.set(**{name: OTHER[name]})
    try:
        assert old == {name: before[name]}
        assert getattr(options, name) == OTHER[name]
        assert options.get() == dict(before, **{name: OTHER[name]})
    finally:
        options.set(**old)
    assert options.get() == before


def test_a_block_sets_options_and_restores_them_after_it():
    before = options.get()
    with options(deterministic=True, autotune=2) as o:
        assert o is options
        assert options.deterministic is True and options.autotune == 2
        with options(autotune=5):   # nested: the inner value, then the outer one again
            assert options.autotune == 5 and options.deterministic is True
        assert options.autotune == 2
    assert options.get() == before


def test_a_block_restores_its_options_when_its_body_raises():
    before = options.get()
    with pytest.raises(RuntimeError, match="inside"):
        with options(index_checks="wait", allow_tf32=True):
            assert options.index_checks == "wait"
            raise RuntimeError("inside")
    assert options.get() == before


def test_a_block_takes_effect_only_when_it_starts():
    block = options(disk_cache=False)
    assert options.disk_cache is True
    with block:
        assert options.disk_cache is False
    assert options.disk_cache is True


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_value_names_the_option_and_changes_nothing(name):
    bads, expects = BAD[name]
    good = next(n for n in NAMES if n != name)   # a good value beside the bad one is not set either
    before = options.get()
    for bad in bads:
        with pytest.raises(ValueError) as info:
            options.set(**{good: OTHER[good], name: bad})
        message = str(info.value)
        assert message.startswith(f"fluxpy.options: {name} expects {expects}") and message.endswith(f"got {bad!r}")
        with pytest.raises(ValueError, match=f"{name} expects"):
            options(**{name: bad})   # a block checks its values when it is made
        assert options.get() == before


def test_an_unknown_name_is_refused_and_changes_nothing():
    before = options.get()
    with pytest.raises(TypeError, match=r"fluxpy.options: no option 'determinstic'; expected one of allow_tf32, "):
        options.set(allow_tf32=True, determinstic=True)
    with pytest.raises(TypeError, match="no option 'tf32'"):
        options(tf32=True)
    with pytest.raises(AttributeError, match="no option 'tf32'; expected one of allow_tf32"):
        _ = options.tf32
    assert not hasattr(options, "tf32")
    assert options.get() == before


def test_options_are_not_assigned_as_attributes():
    with pytest.raises(AttributeError, match=r"set deterministic with options.set\(deterministic=...\)"):
        options.deterministic = True
    assert options.deterministic is False


@given(limit=st.integers(0, 1 << 40), budget=st.floats(0, 1e6), tune=st.integers(0, 64))
def test_numbers_are_kept_as_their_kind(limit, budget, tune):
    with options(workspace_limit=limit, search_budget_ms=int(budget), autotune=tune):
        assert options.workspace_limit == limit and type(options.workspace_limit) is int
        assert options.search_budget_ms == int(budget) and type(options.search_budget_ms) is float
        assert options.autotune == tune


def test_cache_dir_takes_a_path_and_expands_the_home(tmp_path):
    with options(cache_dir=tmp_path):
        assert options.cache_dir == str(tmp_path)
    with options(cache_dir="~/somewhere"):
        assert options.cache_dir == os.path.join(os.path.expanduser("~"), "somewhere")


# ---------------------------------------------------------------------------------------------
# The environment


def test_the_environment_sets_the_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("FLUXPY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FLUXPY_CUDNN_LIBRARY", "/opt/cudnn/libcudnn.so.9")
    monkeypatch.setenv("FLUXPY_CUBLAS_LIBRARY", "/opt/cublas/libcublas.so.13")
    monkeypatch.setenv("FLUXPY_CHECKS", "1")
    monkeypatch.setenv("FLUXPY_CPU_HEAP_KEEP_MB", " 0 ")
    got = Options()
    assert got.cpu_heap_keep_mb == 0
    assert got.cache_dir == str(tmp_path / "cache")
    assert got.cudnn_library == "/opt/cudnn/libcudnn.so.9" and got.cublas_library == "/opt/cublas/libcublas.so.13"
    assert got.value_checks is True
    assert options.value_checks == "auto"   # the process's options were read at import: unchanged


def test_the_cache_folder_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("FLUXPY_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Options().cache_dir == str(tmp_path / "fluxpy")
    monkeypatch.setenv("FLUXPY_CACHE", "")   # empty: unset
    assert Options().cache_dir == str(tmp_path / "fluxpy")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Options().cache_dir == str(tmp_path / "home" / ".cache" / "fluxpy")


@pytest.mark.parametrize("text, mode", [("1", True), ("0", False), ("", "auto"), ("auto", "auto"), (" On ", True),
                                        ("False", False), ("no", False), ("yes", True)])
def test_fluxpy_checks_words(monkeypatch, text, mode):
    monkeypatch.setenv("FLUXPY_CHECKS", text)
    assert Options().value_checks == mode


def test_a_bad_environment_value_names_the_variable_and_the_option(monkeypatch):
    monkeypatch.setenv("FLUXPY_CHECKS", "sometimes")
    with pytest.raises(ValueError, match=r"^FLUXPY_CHECKS \(the option value_checks\) expects 1, 0 or auto, "
                                         r"got 'sometimes'$"):
        Options()


@pytest.mark.parametrize("text", ["lots", "-1", "2048", "1.5"])
def test_a_bad_heap_size_names_the_variable_and_the_option(monkeypatch, text):
    monkeypatch.setenv("FLUXPY_CPU_HEAP_KEEP_MB", text)
    with pytest.raises(ValueError, match=r"^FLUXPY_CPU_HEAP_KEEP_MB \(the option cpu_heap_keep_mb\) expects a "
                                         r"number of MiB from 0 to 2047, got '" + text + "'$"):
        Options()


def test_an_effect_runs_now_and_on_every_set_of_its_option_only():
    options_module = sys.modules["fluxpy.options"]   # the attribute fluxpy.options is the instance
    seen = []
    options.take_effect("search_budget_ms", seen.append)
    try:
        options.set(autotune=3, search_budget_ms=5.0)
        with options(search_budget_ms=1.0):
            pass
        assert seen == [2000.0, 5.0, 1.0, 5.0]
        options.set(autotune=8, search_budget_ms=2000.0)
    finally:
        del options_module._EFFECTS["search_budget_ms"]
    with pytest.raises(TypeError, match="no option 'heap'"):
        options.take_effect("heap", seen.append)


def test_empty_library_variables_mean_none(monkeypatch):
    monkeypatch.setenv("FLUXPY_CUDNN_LIBRARY", "")
    monkeypatch.setenv("FLUXPY_CUBLAS_LIBRARY", "")
    got = Options()
    assert got.cudnn_library is None and got.cublas_library is None


# ---------------------------------------------------------------------------------------------
# The readers


def test_the_kernels_read_the_one_table(tmp_path):
    from fluxpy.kernels.cudnn import diskcache, handle, library
    with options(cache_dir=tmp_path, deterministic=True, workspace_limit=123, cudnn_library="/x/libcudnn.so.9"):
        assert diskcache.cache_dir() == str(tmp_path / "cudnn")
        assert handle.options_key() == (False, True, 123)
        assert library.candidates() == ["/x/libcudnn.so.9"]
    assert handle.options_key() == (options.allow_tf32, options.deterministic, options.workspace_limit)


def test_the_data_folders_follow_cache_dir(tmp_path):
    from fluxpy.datasets import cifar_cache_dir, mnist_cache_dir
    with options(cache_dir=tmp_path):
        assert mnist_cache_dir() == tmp_path / "mnist" and cifar_cache_dir() == tmp_path / "cifar10"


def test_the_module_imports_nothing_of_fluxpy():
    import ast
    from pathlib import Path
    tree = ast.parse((Path(fluxpy.__file__).parent / "options.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    levels = [n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert imported and not any(m.startswith("fluxpy") for m in imported) and not any(levels)
