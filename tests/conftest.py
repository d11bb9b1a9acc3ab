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
