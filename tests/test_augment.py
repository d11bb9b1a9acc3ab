"""Augmentation (fluxpy/datasets/augment.py): a crop is a shifted copy with zeros where padded, a flip mirrors whole images,
both repeat with the same seed, keep shape and dtype (uint8 and float), never touch their input; normalise."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fluxpy
from fluxpy.datasets.augment import normalise, random_crop, random_flip

DTYPES = [np.uint8, np.float32, np.float64]


def images(n, c, h, w, dtype, seed=0):
    """Distinct nonzero values, so a window of the image is identified by its content."""
    x = np.random.default_rng(seed).permutation(n * c * h * w).reshape(n, c, h, w) + 1
    return (x % 250 + 1).astype(dtype) if dtype == np.uint8 else x.astype(dtype)


def shifted(image, dy, dx):
    """``image`` (C, H, W) moved so that ``out[:, i, j] = image[:, i + dy, j + dx]``, zeros outside."""
    _, h, w = image.shape
    p = max(abs(dy), abs(dx))
    padded = np.pad(image, ((0, 0), (p, p), (p, p)))
    return padded[:, p + dy:p + dy + h, p + dx:p + dx + w]


def crop_offsets(x, y, padding):
    """For each image, the shifts ``(dy, dx)`` in ``-padding .. padding`` that turn ``x[n]`` into ``y[n]``."""
    span = range(-padding, padding + 1)
    return [[(dy, dx) for dy in span for dx in span if np.array_equal(shifted(x[i], dy, dx), y[i])]
            for i in range(len(x))]


shapes = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6))


@given(shape=shapes, padding=st.integers(0, 4), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2 ** 16))
def test_a_crop_is_a_shifted_copy_with_zeros_where_padded(shape, padding, dtype, seed):
    x = images(*shape, dtype, seed)
    before = x.copy()
    y = random_crop(x, padding, rng=seed)
    assert y.shape == x.shape and y.dtype == x.dtype and y is not x
    np.testing.assert_array_equal(x, before)                             # the input is left alone
    assert all(found for found in crop_offsets(x, y, padding)), "an output image is no shift of its input"
    np.testing.assert_array_equal(random_crop(x, padding, rng=seed), y)  # same seed, same crops


def test_crop_offsets_are_per_image_and_cover_the_range():
    x = images(400, 1, 5, 5, np.float32)
    y = random_crop(x, 2, rng=0)
    offsets = [found[0] for found in crop_offsets(x, y, 2)]
    assert set(offsets) == {(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)}
    assert not np.array_equal(random_crop(x, 2, rng=1), y)               # another seed, other crops
    np.testing.assert_array_equal(random_crop(x, 0, rng=0), x)


def test_crop_padding_4_on_cifar_sized_uint8():
    x = np.full((8, 3, 32, 32), 200, np.uint8)
    y = random_crop(x, 4, rng=0)
    zero_rows = (y[:, 0] == 0).all(axis=2).sum(axis=1)                   # rows let in from the padding, per image
    assert y.dtype == np.uint8 and zero_rows.max() <= 4 and set(np.unique(y)) <= {0, 200}


@given(shape=shapes, p=st.sampled_from([0.0, 0.3, 1.0]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
def test_a_flip_mirrors_whole_images(shape, p, dtype, seed):
    x = images(*shape, dtype, seed)
    before = x.copy()
    y = random_flip(x, p, rng=seed)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(x, before)
    flipped = [np.array_equal(y[i], x[i, :, :, ::-1]) for i in range(len(x))]
    kept = [np.array_equal(y[i], x[i]) for i in range(len(x))]
    assert all(f or k for f, k in zip(flipped, kept))
    if p == 0.0:
        assert all(kept)
    if p == 1.0:
        assert all(flipped)
    np.testing.assert_array_equal(random_flip(x, p, rng=seed), y)


def test_flip_frequency_follows_p():
    x = images(2000, 1, 1, 2, np.float32)
    y = random_flip(x, 0.5, rng=0)
    fraction = np.mean(y[:, 0, 0, 0] != x[:, 0, 0, 0])
    assert 0.45 < fraction < 0.55


def test_the_global_generator_repeats_after_seed():
    x = images(16, 3, 8, 8, np.float32)
    fluxpy.seed(3)
    first = random_flip(random_crop(x, 2), 0.5)
    fluxpy.seed(3)
    np.testing.assert_array_equal(random_flip(random_crop(x, 2), 0.5), first)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_normalise_floats_per_channel(dtype):
    x = np.random.default_rng(0).random((4, 3, 5, 5)).astype(dtype)
    mean, std = [0.1, 0.2, 0.3], [0.5, 1.0, 2.0]
    y = normalise(x, mean, std)
    assert y.dtype == dtype
    expected = (x - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    np.testing.assert_allclose(y, expected, rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-6)


def test_normalise_scales_integers_to_unit_pixels():
    x = np.random.default_rng(0).integers(0, 256, (4, 3, 5, 5)).astype(np.uint8)
    from fluxpy.datasets.cifar import CIFAR10_MEAN, CIFAR10_STD
    y = normalise(x, CIFAR10_MEAN, CIFAR10_STD)
    expected = (x / 255 - np.array(CIFAR10_MEAN)[:, None, None]) / np.array(CIFAR10_STD)[:, None, None]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_errors_name_the_function_and_what_it_got():
    x = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(TypeError, match=r"random_crop expects a NumPy or CuPy array of images \(N, C, H, W\), "
                                        r"got list"):
        random_crop([[1.0]])
    with pytest.raises(ValueError, match=r"random_flip expects images of shape \(N, C, H, W\), got ndarray of shape "
                                         r"\(3, 4, 4\) float32"):
        random_flip(x[0])
    with pytest.raises(ValueError, match="random_crop expects padding to be an int >= 0, got 1.5"):
        random_crop(x, 1.5)
    with pytest.raises(ValueError, match=r"random_flip expects p to be a probability in \[0, 1\], got -0.1"):
        random_flip(x, -0.1)
    with pytest.raises(TypeError, match="random_crop expects rng to be a numpy.random.Generator"):
        random_crop(x, 1, rng="seed")
    with pytest.raises(ValueError, match=r"normalise expects one mean and one std per channel \(x.shape\[1\] == 3\), "
                                         "got 1 means and 3 stds"):
        normalise(x, [0.5], [1, 1, 1])
    with pytest.raises(ValueError, match=r"normalise expects every std > 0, got \[1.0, 0.0, 1.0\]"):
        normalise(x, [0, 0, 0], [1, 0, 1])
    with pytest.raises(TypeError, match="outside gradient"):
        fluxpy.gradient(lambda x: random_flip(x).sum(), x)


@pytest.mark.gpu
def test_gpu_gives_the_cpu_result_for_the_same_seed():
    x = images(8, 3, 8, 8, np.uint8)
    on_gpu = fluxpy.gpu(x)
    y = random_flip(random_crop(on_gpu, 2, rng=5), rng=6)
    assert fluxpy.get_array_module(y) is not np
    np.testing.assert_array_equal(fluxpy.cpu(y), random_flip(random_crop(x, 2, rng=5), rng=6))
    np.testing.assert_allclose(fluxpy.cpu(normalise(y, [0.5] * 3, [0.25] * 3)),
                               normalise(fluxpy.cpu(y), [0.5] * 3, [0.25] * 3), rtol=1e-6)
