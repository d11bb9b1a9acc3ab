import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))

# Two CPU cores in CI: keep property tests small by default; `HYPOTHESIS_PROFILE=thorough` for more.
settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# --- The GPU suite's budget (issue 35): a default run in minutes, a full one (tests/sweeps.py) ------------------
# The GPU tests' property tests take the "gpu" profile (tests/sweeps.py:examples); "full" is the long run's profile
# for every test, selected by --full, --hypothesis-profile=full or FLUXPY_TEST_PROFILE=full, which also runs the
# cases and tests marked `full`.
settings.register_profile("gpu", max_examples=8, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("full", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full sweeps and the tests marked full (as FLUXPY_TEST_PROFILE=full)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: a long sweep or run, skipped unless --full or FLUXPY_TEST_PROFILE=full")
    full = config.getoption("--full") or config.getoption("hypothesis_profile", default=None) == "full"
    if full:   # read by tests/sweeps.py while the test modules are collected
        os.environ["FLUXPY_TEST_PROFILE"] = "full"


def pytest_report_header(config):
    full = os.environ.get("FLUXPY_TEST_PROFILE", "") == "full"
    return "fluxpy test budget: " + ("full (every sweep case)" if full else "default (covering subsets; --full sweeps)")


def pytest_runtest_setup(item):
    if "full" in item.keywords and os.environ.get("FLUXPY_TEST_PROFILE", "") != "full":
        pytest.skip("a full-sweep case: --full or FLUXPY_TEST_PROFILE=full runs it")
# --- end of the GPU suite's budget --------------------------------------------------------------------------------


def _gpu_reason():
    from fluxpy.backend import gpu_available
    ok, why = gpu_available()
    return None if ok else why


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords:
            if not checked:
                reason, checked = _gpu_reason(), True
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))


@pytest.fixture
def no_tqdm(monkeypatch):
    """Makes ``import tqdm`` fail for the test, as on a machine without it (train's plain progress lines)."""
    import builtins
    real_import = builtins.__import__

    def refuse_tqdm(name, *args, **kw):
        if name.startswith("tqdm"):
            raise ImportError("no tqdm")
        return real_import(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", refuse_tqdm)
