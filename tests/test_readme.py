"""Every Python block of README.md runs as pasted, alone, in a fresh interpreter.

Each block is written to a file of its own and run by a new Python process in an empty folder, on this tree's
fluxpy. A block whose first line says ``# needs a GPU`` is a ``gpu`` test (skipped where CuPy or a GPU is missing);
``# needs 2 GPUs`` (any number) runs under the launcher, ``python -m fluxpy.distributed.run --nproc 2``, where that
many GPUs with NCCL are.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS = re.compile(r"#\s*needs (a|\d+) GPUs?\b")
TIMEOUT_S = 300


def readme_blocks():
    """``(line, code)`` of every fenced ``python`` block of the README, ``line`` that of its opening fence."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


def gpus_needed(code):
    """0 for a CPU block, else the number of GPUs its first line asks for."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    match = NEEDS.match(first.strip())
    if match is None:
        return 0
    return 1 if match.group(1) == "a" else int(match.group(1))


def _cases():
    cases = []
    for line, code in readme_blocks():
        needed = gpus_needed(code)
        marks = [pytest.mark.gpu] if needed else []
        cases.append(pytest.param(code, needed, id=f"line{line}", marks=marks))
    return cases


def _nccl_gpus():
    from fluxpy.kernels.nccl import device_count, nccl_available
    ok, _ = nccl_available()
    return device_count() if ok else 0


def test_the_readme_has_python_blocks_and_marks_them_as_this_test_reads_them():
    blocks = readme_blocks()
    assert len(blocks) >= 10
    for line, code in blocks:
        late = [text for text in code.lstrip().splitlines()[1:] if NEEDS.search(text)]
        # read only on the first line: anywhere else the block would run (and fail) on a machine without the GPUs
        assert not late, f"README line {line}: '# needs ...' must be the block's first line, got {late}"
    assert gpus_needed("# needs a GPU\nx = 1\n") == 1
    assert gpus_needed("# needs 2 GPUs: run it with the launcher\nx = 1\n") == 2
    assert gpus_needed("import fluxpy  # needs a GPU later\n") == 0


@pytest.mark.parametrize("code, needed", _cases())
def test_readme_block_runs_alone(code, needed, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "NCCL_NVLS_ENABLE": "0"}   # no NVLink multicast: not every machine that runs the suite allows it
    command = [sys.executable, str(script)]
    if needed > 1:
        if _nccl_gpus() < needed:
            pytest.skip(f"needs {needed} GPUs with NCCL")
        command = [sys.executable, "-m", "fluxpy.distributed.run", "--nproc", str(needed), str(script)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"the block failed:\n{code}\n--- output ---\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
