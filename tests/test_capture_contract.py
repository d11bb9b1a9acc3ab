"""The capture contract's table on the CPU: every exported layer class has a case (tests/capture_contract.py), and
every case trains here, in float32 and under ``mixed_precision`` in float16 and bfloat16, so that the GPU test
(tests/gpu/test_capture_contract_gpu.py) checks the capture and not the case."""
import numpy as np
import pytest

import fluxpy
from fluxpy import mixed_precision, trainables
from fluxpy.optimise import Adam, setup
from capture_contract import CASES, exported_layer_classes


def test_every_exported_layer_class_has_a_case():
    exported = exported_layer_classes()
    assert exported - set(CASES) == set(), "exported layers without a capture-contract case"
    assert set(CASES) - exported == set(), "cases of names fluxpy.layers does not export"


def _finite(a):
    return bool(np.all(np.isfinite(np.asarray(a, dtype=np.float64))))


@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_trains_on_the_cpu(name, precision):
    model, x, y, loss = CASES[name].make(seed=1)
    if precision != "float32":
        model = mixed_precision(model, precision)
    before = [np.array(p) for p in trainables(model)]
    assert before, f"{name}: the case has no trainable parameter"
    opt = setup(Adam(1e-2), model)
    step = fluxpy.TrainStep(loss, model, opt)
    losses = [float(step(x, y)) for _ in range(3)]
    assert all(np.isfinite(losses)), (name, precision, losses)
    after = list(trainables(model))
    assert all(_finite(p) for p in after)
    assert any(not np.array_equal(b, np.asarray(a)) for b, a in zip(before, after)), f"{name}: nothing was updated"
