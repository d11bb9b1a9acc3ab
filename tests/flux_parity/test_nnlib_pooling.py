"""NNlib.jl's ``test/pooling.jl`` known-answer cases (FluxML/NNlib.jl at f71b71c), in fluxpy's NCHW layout.

A Julia array of size ``(W, H, C, N)`` (or ``(L, C, N)``, ``(W, H, D, C, N)``) holds the same bytes, column-major, as
the NumPy array of the reversed shape: :func:`whcn` takes the values in Julia's memory order with the Julia size and
reverses the axes; spatial options reverse too (NNlib's ``(W, H)`` is fluxpy's ``(H, W)``). NNlib's
``∇maxpool(dy, y, x, pdims)`` is fluxpy's ``maxpool_backward(dy, x, y, pdims)``, ``∇meanpool(dy, y, x, pdims)``
``meanpool_backward(dy, pdims)``; both libraries' ``meanpool`` counts the padding (``count_include_pad``).

Not translated: ``lpnormpool`` (fluxpy has none), the ``_direct`` variants and in-place ``maxpool!`` forms (one
implementation here), ``count_include_pad=false`` (fluxpy counts padding, as NNlib's default), complex
``meanpool``, ReverseDiff and Enzyme, integer and BigFloat inputs. Issue 210's ``padding=1`` with a kernel of size
1 along an axis is accepted, as NNlib does: the windows of padding only give NNlib's values (the lowest finite
number for a max, 0 for a mean).
"""
import itertools

import numpy as np
import pytest

import fluxpy
from fluxpy.ops.dims import PoolDims
from fluxpy.ops.pool import maxpool, maxpool_backward, meanpool, meanpool_backward


def whcn(values, size):
    """A Julia array given by its values in memory order (column-major) and its size, as the NumPy array of the same
    bytes: the axes reversed."""
    return np.array(values, dtype=np.float64).reshape(tuple(reversed(size)))


def spatial(a):
    """NNlib's ``ddims``: drop the channel and batch axes (size 1)."""
    return a[0, 0]


# pooling.jl:3-125 (maxpool_answer_dict), 127-249 (meanpool_answer_dict), 430-852 (maxpool_answer_nature)
MAXPOOL_ANSWERS = {
    1: {
        "y": whcn([2, 4], (2,)),
        "y_nostride": whcn([2, 3, 4, 5], (4,)),
        "y_pad": whcn([1, 3, 5], (3,)),
        "dx": whcn([0, 2, 0, 4, 0], (5,)),
        "dx_nostride": whcn([0, 2, 3, 4, 5], (5,)),
        "dx_pad": whcn([1, 0, 3, 0, 5], (5,)),
    },
    2: {
        "y": whcn([7, 9, 17, 19], (2, 2)),
        "y_nostride": whcn([7, 8, 9, 10, 12, 13, 14, 15, 17, 18, 19, 20], (4, 3)),
        "y_pad": whcn([1, 3, 5, 11, 13, 15, 16, 18, 20], (3, 3)),
        "dx": whcn([0, 0, 0, 0, 0, 0, 7, 0, 9, 0, 0, 0, 0, 0, 0, 0, 17, 0, 19, 0], (5, 4)),
        "dx_nostride": whcn([0, 0, 0, 0, 0, 0, 7, 8, 9, 10, 0, 12, 13, 14, 15, 0, 17, 18, 19, 20], (5, 4)),
        "dx_pad": whcn([1, 0, 3, 0, 5, 0, 0, 0, 0, 0, 11, 0, 13, 0, 15, 16, 0, 18, 0, 20], (5, 4)),
    },
    3: {
        "y": whcn([27, 29, 37, 39], (2, 2, 1)),
        "y_nostride": whcn([
            27, 28, 29, 30, 32, 33, 34, 35, 37, 38, 39, 40, 47, 48, 49, 50, 52, 53, 54, 55, 57, 58, 59, 60
        ], (4, 3, 2)),
        "y_pad": whcn([1, 3, 5, 11, 13, 15, 16, 18, 20, 41, 43, 45, 51, 53, 55, 56, 58, 60], (3, 3, 2)),
        "dx": whcn([
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 0, 29, 0, 0, 0,
            0, 0, 0, 0, 37, 0, 39, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        ], (5, 4, 3)),
        "dx_nostride": whcn([
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 28, 29, 30, 0,
            32, 33, 34, 35, 0, 37, 38, 39, 40, 0, 0, 0, 0, 0, 0, 47, 48, 49, 50, 0, 52, 53, 54, 55, 0, 57, 58,
            59, 60
        ], (5, 4, 3)),
        "dx_pad": whcn([
            1, 0, 3, 0, 5, 0, 0, 0, 0, 0, 11, 0, 13, 0, 15, 16, 0, 18, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 41, 0, 43, 0, 45, 0, 0, 0, 0, 0, 51, 0, 53, 0, 55, 56, 0, 58, 0, 60
        ], (5, 4, 3)),
    },
}

MEANPOOL_ANSWERS = {
    1: {
        "y": whcn([1.5, 3.5], (2,)),
        "y_nostride": whcn([1.5, 2.5, 3.5, 4.5], (4,)),
        "y_pad": whcn([0.5, 2.5, 4.5], (3,)),
        "dx": whcn([0.75, 0.75, 1.75, 1.75, 0], (5,)),
        "dx_nostride": whcn([0.75, 2, 3, 4, 2.25], (5,)),
        "dx_pad": whcn([0.25, 1.25, 1.25, 2.25, 2.25], (5,)),
    },
    2: {
        "y": whcn([4, 6, 14, 16], (2, 2)),
        "y_nostride": whcn([4, 5, 6, 7, 9, 10, 11, 12, 14, 15, 16, 17], (4, 3)),
        "y_pad": whcn([0.25, 1.25, 2.25, 4.25, 10, 12, 4, 8.75, 9.75], (3, 3)),
        "dx": whcn([1, 1, 1.5, 1.5, 0, 1, 1, 1.5, 1.5, 0, 3.5, 3.5, 4, 4, 0, 3.5, 3.5, 4, 4, 0], (5, 4)),
        "dx_nostride": whcn([
            1, 2.25, 2.75, 3.25, 1.75, 3.25, 7, 8, 9, 4.75, 5.75, 12, 13, 14, 7.25, 3.5, 7.25, 7.75, 8.25,
            4.25
        ], (5, 4)),
        "dx_pad": whcn([
            0.0625, 0.3125, 0.3125, 0.5625, 0.5625, 1.0625, 2.5, 2.5, 3, 3, 1.0625, 2.5, 2.5, 3, 3, 1, 2.1875,
            2.1875, 2.4375, 2.4375
        ], (5, 4)),
    },
    3: {
        "y": whcn([14, 16, 24, 26], (2, 2, 1)),
        "y_nostride": whcn([
            14, 15, 16, 17, 19, 20, 21, 22, 24, 25, 26, 27, 34, 35, 36, 37, 39, 40, 41, 42, 44, 45, 46, 47
        ], (4, 3, 2)),
        "y_pad": whcn([
            0.125, 0.625, 1.125, 2.125, 5, 6, 2, 4.375, 4.875, 7.75, 16.25, 17.25, 19.25, 40, 42, 11.5, 23.75,
            24.75
        ], (3, 3, 2)),
        "dx": whcn([
            1.75, 1.75, 2, 2, 0, 1.75, 1.75, 2, 2, 0, 3, 3, 3.25, 3.25, 0, 3, 3, 3.25, 3.25, 0, 1.75, 1.75, 2,
            2, 0, 1.75, 1.75, 2, 2, 0, 3, 3, 3.25, 3.25, 0, 3, 3, 3.25, 3.25, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        ], (5, 4, 3)),
        "dx_nostride": whcn([
            1.75, 3.625, 3.875, 4.125, 2.125, 4.125, 8.5, 9, 9.5, 4.875, 5.375, 11, 11.5, 12, 6.125, 3, 6.125,
            6.375, 6.625, 3.375, 6, 12.25, 12.75, 13.25, 6.75, 13.25, 27, 28, 29, 14.75, 15.75, 32, 33, 34,
            17.25, 8.5, 17.25, 17.75, 18.25, 9.25, 4.25, 8.625, 8.875, 9.125, 4.625, 9.125, 18.5, 19, 19.5,
            9.875, 10.375, 21, 21.5, 22, 11.125, 5.5, 11.125, 11.375, 11.625, 5.875
        ], (5, 4, 3)),
        "dx_pad": whcn([
            0.015625, 0.078125, 0.078125, 0.140625, 0.140625, 0.265625, 0.625, 0.625, 0.75, 0.75, 0.265625,
            0.625, 0.625, 0.75, 0.75, 0.25, 0.546875, 0.546875, 0.609375, 0.609375, 0.96875, 2.03125, 2.03125,
            2.15625, 2.15625, 2.40625, 5, 5, 5.25, 5.25, 2.40625, 5, 5, 5.25, 5.25, 1.4375, 2.96875, 2.96875,
            3.09375, 3.09375, 0.96875, 2.03125, 2.03125, 2.15625, 2.15625, 2.40625, 5, 5, 5.25, 5.25, 2.40625,
            5, 5, 5.25, 5.25, 1.4375, 2.96875, 2.96875, 3.09375, 3.09375
        ], (5, 4, 3)),
    },
}

NATURE = {
    "rank1": {
        "k2s1p0": dict(size=(2,), stride=1, pad=0,
            x=whcn([0.0299635, 0.233456, 0.596161, 0.161514, 0.0094027], (5, 1, 1)),
            dx_maxpool=whcn([0, 1, 2, 1, 0], (5, 1, 1)),
            dx_meanpool=whcn([0.5, 1, 1, 1, 0.5], (5, 1, 1)),
        ),
        "k2s1p1": dict(size=(2,), stride=1, pad=1,
            x=whcn([0.0299635, 0.233456, 0.596161, 0.161514, 0.0094027], (5, 1, 1)),
            dx_maxpool=whcn([1, 1, 2, 1, 1], (5, 1, 1)),
            dx_meanpool=whcn([1, 1, 1, 1, 1], (5, 1, 1)),
        ),
        "k3s1p1": dict(size=(3,), stride=1, pad=1,
            x=whcn([0.0299635, 0.233456, 0.596161, 0.161514, 0.0094027], (5, 1, 1)),
            dx_maxpool=whcn([0, 1, 3, 1, 0], (5, 1, 1)),
            dx_meanpool=whcn([0.6666666666, 1, 1, 1, 0.6666666666], (5, 1, 1)),
        ),
        "k3s2p1": dict(size=(3,), stride=2, pad=1,
            x=whcn([0.0299635, 0.233456, 0.596161, 0.161514, 0.0094027], (5, 1, 1)),
            dx_maxpool=whcn([0, 1, 1, 1, 0], (5, 1, 1)),
            dx_meanpool=whcn([0.333333333, 0.666666666, 0.333333333, 0.666666666, 0.333333333], (5, 1, 1)),
        ),
    },
    "rank2": {
        "k2s1p0": dict(size=(2, 2), stride=1, pad=0,
            x=whcn([
                0.0299635, 0.389984, 0.0830242, 0.425287, 0.473724, 0.233456, 0.235158, 0.483759, 0.53451,
                0.571418, 0.596161, 0.579525, 0.914904, 0.0405225, 0.558427, 0.161514, 0.301893, 0.253871,
                0.729861, 0.552183, 0.0094027, 0.561358, 0.820061, 0.403925, 0.561624
            ], (5, 5, 1, 1)),
            dx_maxpool=whcn([0, 1, 0, 0, 0, 0, 0, 1, 1, 2, 2, 0, 4, 0, 0, 0, 0, 0, 2, 0, 0, 1, 2, 0, 0], (5, 5, 1, 1)),
            dx_meanpool=whcn([
                0.25, 0.5, 0.5, 0.5, 0.25, 0.5, 1, 1, 1, 0.5, 0.5, 1, 1, 1, 0.5, 0.5, 1, 1, 1, 0.5, 0.25,
                0.5, 0.5, 0.5, 0.25
            ], (5, 5, 1, 1)),
        ),
        "k2s1p1": dict(size=(2, 2), stride=1, pad=1,
            x=whcn([
                0.0299635, 0.389984, 0.0830242, 0.425287, 0.473724, 0.233456, 0.235158, 0.483759, 0.53451,
                0.571418, 0.596161, 0.579525, 0.914904, 0.0405225, 0.558427, 0.161514, 0.301893, 0.253871,
                0.729861, 0.552183, 0.0094027, 0.561358, 0.820061, 0.403925, 0.561624
            ], (5, 5, 1, 1)),
            dx_maxpool=whcn([1, 3, 0, 1, 2, 1, 0, 1, 1, 4, 4, 0, 4, 0, 1, 1, 0, 0, 2, 0, 1, 2, 4, 0, 3], (5, 5, 1, 1)),
            dx_meanpool=whcn([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], (5, 5, 1, 1)),
        ),
        "k3s1p1": dict(size=(3, 3), stride=1, pad=1,
            x=whcn([
                0.0299635, 0.389984, 0.0830242, 0.425287, 0.473724, 0.233456, 0.235158, 0.483759, 0.53451,
                0.571418, 0.596161, 0.579525, 0.914904, 0.0405225, 0.558427, 0.161514, 0.301893, 0.253871,
                0.729861, 0.552183, 0.0094027, 0.561358, 0.820061, 0.403925, 0.561624
            ], (5, 5, 1, 1)),
            dx_maxpool=whcn([0, 1, 0, 0, 0, 0, 0, 1, 1, 3, 3, 0, 9, 0, 0, 0, 0, 0, 3, 0, 0, 1, 3, 0, 0], (5, 5, 1, 1)),
            dx_meanpool=whcn([
                0.444444, 0.666667, 0.666667, 0.666667, 0.444444, 0.666667, 1, 1, 1, 0.666667, 0.666667,
                1, 1, 1, 0.666667, 0.666667, 1, 1, 1, 0.666667, 0.444444, 0.666667, 0.666667, 0.666667,
                0.444444
            ], (5, 5, 1, 1)),
        ),
        "k3s2p1": dict(size=(3, 3), stride=2, pad=1,
            x=whcn([
                0.0299635, 0.389984, 0.0830242, 0.425287, 0.473724, 0.233456, 0.235158, 0.483759, 0.53451,
                0.571418, 0.596161, 0.579525, 0.914904, 0.0405225, 0.558427, 0.161514, 0.301893, 0.253871,
                0.729861, 0.552183, 0.0094027, 0.561358, 0.820061, 0.403925, 0.561624
            ], (5, 5, 1, 1)),
            dx_maxpool=whcn([0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 2, 0, 0, 1, 1, 0, 0], (5, 5, 1, 1)),
            dx_meanpool=whcn([
                0.111111, 0.222222, 0.111111, 0.222222, 0.111111, 0.222222, 0.444444, 0.222222, 0.444444,
                0.222222, 0.111111, 0.222222, 0.111111, 0.222222, 0.111111, 0.222222, 0.444444, 0.222222,
                0.444444, 0.222222, 0.111111, 0.222222, 0.111111, 0.222222, 0.111111
            ], (5, 5, 1, 1)),
        ),
    },
    "rank3": {
        "k2s1p0": dict(size=(2, 2, 2), stride=1, pad=0,
            x=whcn([
                0.82584, 0.798798, 0.716898, 0.261484, 0.416818, 0.131608, 0.320672, 0.258469, 0.92668,
                0.344556, 0.24453, 0.121916, 0.471931, 0.79681, 0.288568, 0.0685961, 0.73934, 0.164918,
                0.116848, 0.525431, 0.16631, 0.790875, 0.359845, 0.0402844, 0.525109, 0.444085, 0.0653075,
                0.846814, 0.0223458, 0.469671, 0.804886, 0.84876, 0.709245, 0.576722, 0.640221, 0.953795,
                0.325828, 0.405659, 0.28811, 0.1316, 0.715952, 0.770104, 0.129229, 0.94538, 0.719116,
                0.259131, 0.97571, 0.705337
            ], (4, 4, 3, 1, 1)),
            dx_maxpool=whcn([
                1, 1, 1, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 1, 0, 0,
                1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 2, 0
            ], (4, 4, 3, 1, 1)),
            dx_meanpool=whcn([
                0.125, 0.25, 0.25, 0.125, 0.25, 0.5, 0.5, 0.25, 0.25, 0.5, 0.5, 0.25, 0.125, 0.25, 0.25,
                0.125, 0.25, 0.5, 0.5, 0.25, 0.5, 1, 1, 0.5, 0.5, 1, 1, 0.5, 0.25, 0.5, 0.5, 0.25, 0.125,
                0.25, 0.25, 0.125, 0.25, 0.5, 0.5, 0.25, 0.25, 0.5, 0.5, 0.25, 0.125, 0.25, 0.25, 0.125
            ], (4, 4, 3, 1, 1)),
        ),
        "k2s1p1": dict(size=(2, 2, 2), stride=1, pad=1,
            x=whcn([
                0.82584, 0.798798, 0.716898, 0.261484, 0.416818, 0.131608, 0.320672, 0.258469, 0.92668,
                0.344556, 0.24453, 0.121916, 0.471931, 0.79681, 0.288568, 0.0685961, 0.73934, 0.164918,
                0.116848, 0.525431, 0.16631, 0.790875, 0.359845, 0.0402844, 0.525109, 0.444085, 0.0653075,
                0.846814, 0.0223458, 0.469671, 0.804886, 0.84876, 0.709245, 0.576722, 0.640221, 0.953795,
                0.325828, 0.405659, 0.28811, 0.1316, 0.715952, 0.770104, 0.129229, 0.94538, 0.719116,
                0.259131, 0.97571, 0.705337
            ], (4, 4, 3, 1, 1)),
            dx_maxpool=whcn([
                8, 4, 4, 2, 0, 0, 1, 1, 8, 1, 0, 1, 2, 4, 2, 1, 3, 0, 0, 2, 0, 5, 0, 0, 0, 0, 0, 2, 0, 0,
                2, 5, 4, 0, 3, 8, 0, 0, 0, 0, 2, 4, 0, 6, 6, 0, 8, 1
            ], (4, 4, 3, 1, 1)),
            dx_meanpool=whcn([
                1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1
            ], (4, 4, 3, 1, 1)),
        ),
        "k3s1p1": dict(size=(3, 3, 2), stride=1, pad=1,
            x=whcn([
                0.82584, 0.798798, 0.716898, 0.261484, 0.416818, 0.131608, 0.320672, 0.258469, 0.92668,
                0.344556, 0.24453, 0.121916, 0.471931, 0.79681, 0.288568, 0.0685961, 0.73934, 0.164918,
                0.116848, 0.525431, 0.16631, 0.790875, 0.359845, 0.0402844, 0.525109, 0.444085, 0.0653075,
                0.846814, 0.0223458, 0.469671, 0.804886, 0.84876, 0.709245, 0.576722, 0.640221, 0.953795,
                0.325828, 0.405659, 0.28811, 0.1316, 0.715952, 0.770104, 0.129229, 0.94538, 0.719116,
                0.259131, 0.97571, 0.705337
            ], (4, 4, 3, 1, 1)),
            dx_maxpool=whcn([
                4, 3, 3, 0, 0, 0, 1, 0, 12, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 2, 0, 0,
                0, 4, 2, 0, 0, 8, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 12, 0
            ], (4, 4, 3, 1, 1)),
            dx_meanpool=whcn([
                0.444444, 0.666667, 0.666667, 0.444444, 0.666667, 1, 1, 0.666667, 0.666667, 1, 1,
                0.666667, 0.444444, 0.666667, 0.666667, 0.444444, 0.444444, 0.666667, 0.666667, 0.444444,
                0.666667, 1, 1, 0.666667, 0.666667, 1, 1, 0.666667, 0.444444, 0.666667, 0.666667,
                0.444444, 0.444444, 0.666667, 0.666667, 0.444444, 0.666667, 1, 1, 0.666667, 0.666667, 1,
                1, 0.666667, 0.444444, 0.666667, 0.666667, 0.444444
            ], (4, 4, 3, 1, 1)),
        ),
        "k3s2p1": dict(size=(3, 3, 2), stride=2, pad=1,
            x=whcn([
                0.82584, 0.798798, 0.716898, 0.261484, 0.416818, 0.131608, 0.320672, 0.258469, 0.92668,
                0.344556, 0.24453, 0.121916, 0.471931, 0.79681, 0.288568, 0.0685961, 0.73934, 0.164918,
                0.116848, 0.525431, 0.16631, 0.790875, 0.359845, 0.0402844, 0.525109, 0.444085, 0.0653075,
                0.846814, 0.0223458, 0.469671, 0.804886, 0.84876, 0.709245, 0.576722, 0.640221, 0.953795,
                0.325828, 0.405659, 0.28811, 0.1316, 0.715952, 0.770104, 0.129229, 0.94538, 0.719116,
                0.259131, 0.97571, 0.705337
            ], (4, 4, 3, 1, 1)),
            dx_maxpool=whcn([
                1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0,
                0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0
            ], (4, 4, 3, 1, 1)),
            dx_meanpool=whcn([
                0.0555556, 0.111111, 0.0555556, 0.0555556, 0.111111, 0.222222, 0.111111, 0.111111,
                0.0555556, 0.111111, 0.0555556, 0.0555556, 0.0555556, 0.111111, 0.0555556, 0.0555556,
                0.0555556, 0.111111, 0.0555556, 0.0555556, 0.111111, 0.222222, 0.111111, 0.111111,
                0.0555556, 0.111111, 0.0555556, 0.0555556, 0.0555556, 0.111111, 0.0555556, 0.0555556,
                0.0555556, 0.111111, 0.0555556, 0.0555556, 0.111111, 0.222222, 0.111111, 0.111111,
                0.0555556, 0.111111, 0.0555556, 0.0555556, 0.0555556, 0.111111, 0.0555556, 0.0555556
            ], (4, 4, 3, 1, 1)),
        ),
    },
}


POOLS = {"maxpool": (maxpool, MAXPOOL_ANSWERS), "meanpool": (meanpool, MEANPOOL_ANSWERS)}


def _backward(name, dy, x, y, pdims):
    return maxpool_backward(dy, x, y, pdims) if name == "maxpool" else meanpool_backward(dy, pdims)


@pytest.mark.parametrize("name", sorted(POOLS))
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_pool_known_answers(name, rank):
    # pooling.jl:315-361: kernel 1 is the identity; kernel 2; kernel 2 with stride 1; kernel 2 with padding 1;
    # the gradient at dy = y
    pool, answers = POOLS[name]
    x = np.arange(1.0, answers[rank]["dx"].size + 1).reshape((1, 1) + answers[rank]["dx"].shape)
    np.testing.assert_array_equal(pool(x, 1), x)
    for suffix, opts in {"": {}, "_nostride": dict(stride=1), "_pad": dict(pad=1)}.items():
        pdims = PoolDims.from_array(x, 2, **opts)
        y = pool(x, 2, **opts)
        np.testing.assert_allclose(spatial(y), answers[rank]["y" + suffix], rtol=1e-12)
        np.testing.assert_allclose(spatial(_backward(name, y, x, y, pdims)), answers[rank]["dx" + suffix], rtol=1e-12)
        dx = fluxpy.gradient(lambda x: (pool(x, 2, **opts) * y).sum(), x)[0]   # the same through the tape
        np.testing.assert_allclose(spatial(dx), answers[rank]["dx" + suffix], rtol=1e-12)


def test_pooling_check_sizes():
    # pooling.jl:406-413: x rand(10,10,3,10) -> NCHW (10,3,10,10)
    x = np.zeros((10, 3, 10, 10))
    assert maxpool(x, (2, 2)).shape == (10, 3, 5, 5)
    assert maxpool(x, (2, 2), pad=(1, 1), stride=(2, 2)).shape == (10, 3, 6, 6)
    assert meanpool(x, (2, 2)).shape == (10, 3, 5, 5)
    assert meanpool(x, (2, 2), pad=(1, 1), stride=(2, 2)).shape == (10, 3, 6, 6)


def test_issue_133_odd_size():
    # pooling.jl:415-424: x = reshape(1:9, 3, 3, 1, 1), kernel 2, padding 1, stride 2; dy = ones
    x = whcn(range(1, 10), (3, 3, 1, 1))
    pdims = PoolDims.from_array(x, (2, 2), stride=(2, 2), pad=(1, 1))
    y = maxpool(x, (2, 2), stride=(2, 2), pad=(1, 1))
    dx = maxpool_backward(np.ones_like(y), x, y, pdims)
    np.testing.assert_array_equal(dx[0, 0], whcn([1, 0, 1, 0, 0, 0, 1, 0, 1], (3, 3)))


@pytest.mark.parametrize("rank,setting", [(r, s) for r in NATURE for s in NATURE[r]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_more_maxpool_and_meanpool(rank, setting, dtype):
    # pooling.jl:855-878 (issue 205, "true" strided cases): the gradients at dy = ones, against FiniteDifferences
    config = NATURE[rank][setting]
    x = config["x"].astype(dtype)
    opts = dict(stride=config["stride"], pad=config["pad"])
    size = tuple(reversed(config["size"]))                  # NNlib's (W, H, D) kernel is fluxpy's (D, H, W)
    pdims = PoolDims.from_array(x, size, **opts)
    y_max, y_mean = maxpool(x, size, **opts), meanpool(x, size, **opts)
    dy = np.ones_like(y_max)
    np.testing.assert_allclose(maxpool_backward(dy, x, y_max, pdims), config["dx_maxpool"], rtol=1e-5)
    np.testing.assert_allclose(meanpool_backward(dy, pdims), config["dx_meanpool"], rtol=1e-5)
    assert y_max.shape == y_mean.shape and y_max.dtype == dtype


def test_issue_210_asymmetric_padding_keeps_the_dtype():
    # pooling.jl:880-884: x rand(Float32, 5, 2, 1, 3), kernel (2, 1) -> NCHW (3, 1, 2, 5), kernel (1, 2)
    x = np.random.default_rng(0).random((3, 1, 2, 5)).astype(np.float32)
    y = maxpool(x, (1, 2), stride=1, pad=(0, 0, 1, 0))     # NNlib's padding=(1, 0, 0, 0): w_lo = 1
    assert y.dtype == np.float32 and y.shape == (3, 1, 2, 5)
    y = maxpool(x, (1, 2), stride=1, pad=1)                 # NNlib pads the kernel-1 axis too
    assert y.dtype == np.float32 and y.shape == (3, 1, 4, 6)
    lowest = np.float32(-np.finfo(np.float32).max)         # NNlib's nextfloat(typemin(Float32)) in a padding row
    assert (y[:, :, 0] == lowest).all() and (y[:, :, -1] == lowest).all()
    np.testing.assert_array_equal(y[:, :, 1:3], maxpool(np.pad(x, ((0, 0),) * 3 + ((1, 1),), constant_values=-np.inf),
                                                                 (1, 2), stride=1))


def test_issue_229_meanpool_padding_counts():
    # pooling.jl:886-893: meanpool of -1s, kernel 2, padding 1: the padding counts in the mean
    x = -np.ones((1, 1, 4, 4), np.float32)
    valid = whcn([-0.25, -0.5, -0.25, -0.5, -1.0, -0.5, -0.25, -0.5, -0.25], (3, 3, 1, 1))
    np.testing.assert_array_equal(meanpool(x, 2, pad=1), valid)


def test_issue_484_small_pools_and_their_gradients():
    # pooling.jl:922-932: x = Float32[1 2; 3 4]
    x = whcn([1, 3, 2, 4], (2, 2, 1, 1)).astype(np.float32)
    assert maxpool(x, (2, 2)).item() == 4
    np.testing.assert_array_equal(fluxpy.gradient(lambda x: maxpool(x, (2, 2)).sum(), x)[0][0, 0],
                                  whcn([0, 0, 0, 1], (2, 2)))
    assert meanpool(x, (2, 2)).item() == 2.5
    np.testing.assert_array_equal(fluxpy.gradient(lambda x: meanpool(x, (2, 2)).sum(), x)[0], np.full(x.shape, 0.25))
    for xsz, psz in [((1, 1), (1, 1)), ((1, 2), (1, 1)), ((1, 2), (1, 2)), ((2, 1), (1, 1)), ((2, 1), (2, 1)),
                     ((2, 2), (1, 1)), ((2, 2), (1, 2)), ((2, 2), (2, 1))]:   # pooling.jl:903-916, NCHW
        ones = np.ones((1, 1) + tuple(reversed(xsz)), np.float16)
        for pool in (maxpool, meanpool):
            assert pool(ones, tuple(reversed(psz))).dtype == np.float16


def _ref_meanpool(x, k, pad, stride):
    """pooling.jl:937-964's brute-force reference with count_include_pad=true: the window's sum over the kernel size."""
    n = x.ndim - 2
    out = tuple((s + 2 * pad - k) // stride + 1 for s in x.shape[2:])
    y = np.zeros(x.shape[:2] + out)
    for o in itertools.product(*map(range, out)):
        for kidx in itertools.product(range(k), repeat=n):
            idx = tuple(oi * stride - pad + ki for oi, ki in zip(o, kidx))
            if all(0 <= i < s for i, s in zip(idx, x.shape[2:])):
                y[(Ellipsis,) + o] += x[(Ellipsis,) + idx]
    return y / k ** n


@pytest.mark.parametrize("nsd", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_meanpool_count_include_pad(nsd, dtype):
    # pooling.jl:935-990 (issue 218), count_include_pad=true: the known 2x2 case and the brute force on 7^nsd inputs
    x = whcn(range(1, 17), (4, 4, 1, 1))
    excluding = whcn([1, 2.5, 4, 7, 8.5, 10, 13, 14.5, 16], (3, 3))   # NNlib's answer with count_include_pad=false
    counts = np.array([[1, 2, 1], [2, 4, 2], [1, 2, 1]])               # of the 2x2 window inside the image
    np.testing.assert_allclose(meanpool(x, (2, 2), pad=1, stride=2)[0, 0], excluding * counts / 4, rtol=1e-12)
    rng = np.random.default_rng(nsd)
    x = rng.random((2, 2) + (7,) * nsd).astype(dtype)
    for k, pad, stride in ((2, 1, 2), (3, 1, 1), (3, 2, 2)):
        np.testing.assert_allclose(meanpool(x, (k,) * nsd, pad=pad, stride=stride), _ref_meanpool(x, k, pad, stride),
                                   rtol=1e-5 if dtype == np.float32 else 1e-12)
