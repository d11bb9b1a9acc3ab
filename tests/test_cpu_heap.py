"""fluxpy.kernels.cpu_heap: with the option on, a step's large arrays reuse the heap's pages instead of faulting
fresh ones (counted by the kernel's minor page faults); off, glibc's defaults come back."""
import resource
import sys

import numpy as np
import pytest

from fluxpy.kernels import cpu_heap
from fluxpy.options import options

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or cpu_heap._mallopt() is None,
                                reason="the heap thresholds are glibc's")


def _faults_per_round(rounds=10, mb=16):
    """Minor page faults per round of allocating, writing and freeing a few ``mb`` MiB arrays, as a step does."""
    def one_round():
        arrays = [np.empty(mb << 18, np.float32) for _ in range(3)]
        for a in arrays:
            a.fill(1.0)
    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        one_round()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / rounds


def test_kept_memory_is_reused_without_page_faults_and_zero_puts_the_defaults_back():
    pages = 3 * (16 << 20) // resource.getpagesize()
    with options(cpu_heap_keep_mb=256):
        kept = _faults_per_round()
    with options(cpu_heap_keep_mb=0):
        released = _faults_per_round()
    assert kept < 0.05 * pages          # the same pages every round
    assert released > 0.5 * pages or released > 20 * max(kept, 1)   # fresh pages each round (fewer with huge pages)
    assert options.cpu_heap_keep_mb == 256


def test_the_setting_is_taken_by_glibc():
    assert cpu_heap.keep_freed_memory(128) is True
    assert cpu_heap.keep_freed_memory(options.cpu_heap_keep_mb) is True
