"""The Python blocks of the "Coming from" pages in docs/ run as pasted, each alone in a fresh namespace."""
import re
from pathlib import Path

import numpy as np
import pytest

import fluxpy

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["coming_from_pytorch.md", "coming_from_flux.md"]
BLOCKS = [(page, i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), re.S | re.M))]


def test_the_pages_have_python_blocks():
    assert {name for name, _, _ in BLOCKS} == set(PAGES)


@pytest.mark.parametrize("name, i, code", BLOCKS, ids=[f"{name}:{i}" for name, i, _ in BLOCKS])
def test_block_runs(name, i, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes a file writes it here
    ns = {"__name__": "__main__"}
    exec(compile(code, f"{name} block {i}", "exec"), ns)
    weights = fluxpy.trainables(ns["model"])  # each block builds a model: its weights are there and finite
    assert weights and all(np.isfinite(w).all() for w in weights)
