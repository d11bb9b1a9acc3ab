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


# Flux 0.16.11's export and public lists (src/Flux.jl), and the NNlib, Optimisers.jl, MLUtils and OneHotArrays names
# a Flux user reaches for: each must have a row in docs/flux_names.md
FLUX_NAMES = """
Chain Dense Embedding EmbeddingBag Maxout SkipConnection Parallel PairwiseFusion Bilinear Scale RNNCell LSTMCell
GRUCell GRUv3Cell RNN LSTM GRU GRUv3 Recurrence SamePad Conv CrossCor ConvTranspose DepthwiseConv
AdaptiveMaxPool AdaptiveMeanPool GlobalMaxPool GlobalMeanPool MaxPool MeanPool Dropout AlphaDropout LayerNorm
BatchNorm InstanceNorm GroupNorm WeightNorm remove_weight_norms MultiHeadAttention Upsample PixelShuffle fmap
cpu gpu f32 f64 f16 bf16 BFloat16 rand32 randn32 zeros32 ones32 testmode! trainmode! outputsize state loadmodel!
create_bias @layer initialstates normalise activations modules flatten rng_from_array nfan glorot_uniform
glorot_normal kaiming_uniform kaiming_normal truncated_normal lecun_normal orthogonal sparse_init identity_init
Losses Train setup train! trainstep! trainstep_withgradient! freeze! thaw! adjust! update! trainable gradient
withgradient pullback jacobian withjacobian hessian diaghessian binary_focal_loss binarycrossentropy
crossentropy dice_coeff_loss focal_loss hinge_loss huber_loss kldivergence label_smoothing
logitbinarycrossentropy logitcrossentropy mae mse msle poisson_loss siamese_contrastive_loss squared_hinge_loss
tversky_loss onehot onehotbatch onecold DataLoader numobs getobs obsview shuffleobs splitobs kfolds batch
unbatch chunk mapobs Descent Momentum Nesterov RMSProp Adam RAdam AdaMax OAdam AdaGrad AdaDelta AMSGrad NAdam
AdamW AdaBelief Lion WeightDecay SignDecay ClipGrad ClipNorm OptimiserChain AccumGrad Rprop destructure σ hardσ
hardtanh relu leakyrelu relu6 rrelu elu gelu gelu_tanh gelu_erf swish hardswish selu celu softplus softsign logσ
logcosh mish tanhshrink softshrink hardshrink trelu lisht tanh_fast sigmoid_fast softmax logsoftmax logsumexp
glu conv depthwiseconv ∇conv_data ∇conv_filter maxpool meanpool lpnormpool pad_constant pad_zeros pad_reflect
pad_repeat pad_symmetric pad_circular upsample_nearest upsample_bilinear upsample_linear upsample_trilinear
pixel_shuffle batched_mul batched_transpose gather scatter dropout dot_product_attention make_causal_mask
ctc_loss within_gradient imrotate unfold fold
""".split()


def _flux_rows():
    rows = re.findall(r"^\| `([^`]+)` \| (`[^`]+`|\(none\)) \| (.*) \|$", (DOCS / "flux_names.md").read_text(), re.M)
    return {flux: (target.strip("`") if target != "(none)" else None, note) for flux, target, note in rows}


def test_every_flux_name_has_a_row_and_each_fluxpy_name_there_imports():
    import importlib.util
    rows = _flux_rows()
    assert sorted(rows) == sorted(FLUX_NAMES), (set(FLUX_NAMES) ^ set(rows))
    for flux, (target, note) in rows.items():
        if target is None:
            assert note.startswith("not in fluxpy"), flux   # an absent name says so
            continue
        module, _, name = target.rpartition(".")
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        assert found or importlib.util.find_spec(target) is not None, f"{flux}: {target} does not import"
