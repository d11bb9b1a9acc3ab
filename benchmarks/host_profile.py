"""Host-side cProfile of fluxpy GPU training steps (where Python time goes), top functions by own time.

Run: ``PYTHONPATH=. python3 benchmarks/host_profile.py [--model reference] [--batch 128] [--steps 50]``
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from train_step import fluxpy_case  # noqa: E402
from models import MODELS  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="reference")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    model = MODELS[a.model](rng)
    x = rng.random((a.batch, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, a.batch)
    step, _, _ = fluxpy_case(model, x, labels, "gpu")
    for _ in range(10):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
