"""fluxpy.models, the public home of the ResNet builders (their architecture and training are tested in
tests/test_resnet_models.py through benchmarks/models.py, which re-exports them)."""
import sys
from pathlib import Path

import numpy as np
import pytest

import fluxpy
import fluxpy.models as models
from fluxpy import BatchNorm, Conv, CrossCor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_benchmarks_models_re_exports_the_same_builders():
    import models as bench
    for name in ("resnet20", "resnet18", "basic_block", "parameter_count", "RESNETS", "RESNET20_PARAMETERS",
                 "RESNET18_PARAMETERS"):
        assert getattr(bench, name) is getattr(models, name), name


def test_rng_none_draws_from_the_seeded_global_generator():
    fluxpy.seed(7)
    a = models.resnet20()
    fluxpy.seed(7)
    b = models.resnet20()
    assert all(np.array_equal(p, q) for p, q in zip(fluxpy.trainables(a), fluxpy.trainables(b)))
    c = models.resnet20(rng=np.random.default_rng(7))
    assert all(np.array_equal(p, q) for p, q in zip(fluxpy.trainables(a), fluxpy.trainables(c)))


def _convs(model):
    return [leaf for leaf in _walk(model) if isinstance(leaf, Conv)]


def _walk(x):
    """``x`` and every layer inside it: Chain and Parallel hold a tuple of layers, SkipConnection one."""
    yield x
    inner = getattr(x, "layers", ())
    for child in inner if isinstance(inner, tuple) else (inner,):
        yield from _walk(child)


def test_conv_choice_and_classes():
    model = models.resnet20(rng=0, classes=100, conv=Conv)
    convs = _convs(model)
    assert convs and all(type(c) is Conv for c in convs)
    assert all(type(c) is CrossCor for c in _convs(models.resnet20(rng=0)))
    assert model[-1].weight.shape == (100, 64)
    assert models.parameter_count(model) == models.RESNET20_PARAMETERS + 90 * 64 + 90


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(classes=0), ValueError, "resnet20 expects classes to be an int >= 1, got 0"),
    (dict(classes=2.0), ValueError, "resnet20 expects classes to be an int >= 1, got 2.0"),
    (dict(conv=BatchNorm), TypeError, "resnet20 expects conv to be fluxpy's Conv or CrossCor (the class)"),
    (dict(rng=-1), ValueError, "resnet20 expects an int seed >= 0, got -1"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error) as err:
        models.resnet20(**kwargs)
    assert message in str(err.value)


def test_test_mode_predictions_do_not_depend_on_the_batch():
    model = fluxpy.testmode(models.resnet20(rng=0))
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(model(x)[:1], model(x[:1]), rtol=1e-4, atol=1e-5)


def test_the_zoo_is_a_package_with_a_module_per_family():
    assert models.resnet20 is models.resnet.resnet20 and models.basic_block is models.resnet.basic_block
    assert fluxpy.models is models and "models" in fluxpy.__all__
