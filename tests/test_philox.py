"""The Philox4x32-10 generator of the GPU (``fluxpy.kernels.philox``), on the host: Random123's known-answer
vectors, the NumPy reference of the values the kernel draws, and (where nvcc is installed) the CUDA source's
own functions compiled for the host, which must give the reference's numbers bit for bit. The kernel itself
is tested against the reference on the GPU (tests/gpu/test_philox_gpu.py)."""
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy.kernels import compiler
from fluxpy.kernels.philox import philox4x32_10, uniform_numpy

# Random123's kat_vectors for philox4x32_10: (counter, key, output)
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("ctr, key, out", KAT)
def test_known_answers(ctr, key, out):
    got = philox4x32_10(np.array(ctr, np.uint32).reshape(4, 1), key)
    assert tuple(int(w) for w in got[:, 0]) == out


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 300), offset=st.integers(0, 2**40), k0=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_values_are_in_the_unit_interval_on_their_grid_and_continue_counter_by_counter(n, offset, k0, dtype):
    key = (k0, 12345)
    u = uniform_numpy(key, offset, n, dtype)
    assert u.shape == (n,) and u.dtype == dtype
    assert np.all((u >= 0) & (u < 1))
    bits = 24 if dtype == np.float32 else 53
    np.testing.assert_array_equal(u * 2.0 ** bits, np.floor(u * 2.0 ** bits))
    per = 4 if dtype == np.float32 else 2
    split = (n // per // 2) * per   # a draw cut at a counter boundary continues where the first part stopped
    np.testing.assert_array_equal(u, np.concatenate([uniform_numpy(key, offset, split, dtype),
                                                     uniform_numpy(key, offset + split // per, n - split, dtype)]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_draws_look_uniform_and_keys_give_other_streams(dtype):
    u = uniform_numpy((1, 2), 0, 200_000, dtype)
    counts, _ = np.histogram(u, bins=20, range=(0, 1))
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 60   # 19 degrees of freedom: 60 is far past the 0.9999 quantile
    assert abs(u.mean() - 0.5) < 0.005
    assert not np.array_equal(u[:100], uniform_numpy((1, 3), 0, 100, dtype))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile the CUDA source for the host")
@pytest.mark.parametrize("ctype, dtype", [("float", np.float32), ("double", np.float64)])
def test_the_cuda_source_gives_the_reference_numbers(tmp_path, ctype, dtype):
    helpers = compiler.source("philox.cu").split('extern "C"')[0]
    (tmp_path / "check.cu").write_text(f"#include <cstdio>\n#define FX_REAL {ctype}\n{helpers}\n" + r"""
int main() {
  for (unsigned long long c = 4294967294ULL; c < 4294967300ULL; ++c) {   // across the low word's wrap
    unsigned int w[4];
    counter_words(c, 77u, 99u, w);   // the draw of one position, as the kernels make it
    for (int q = 0; q < PER; ++q) printf("%.17g\n", (double)to_uniform(w, q, (T)0));
  }
}
""")
    subprocess.run(["nvcc", "-o", str(tmp_path / "check"), str(tmp_path / "check.cu")], check=True,
                   capture_output=True)
    out = subprocess.run([str(tmp_path / "check")], check=True, capture_output=True, text=True).stdout.split()
    got = np.array([float(v) for v in out])
    np.testing.assert_array_equal(got, uniform_numpy((77, 99), 4294967294, len(got), dtype).astype(np.float64))
