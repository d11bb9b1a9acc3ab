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


# PyTorch 2.14's torch.nn.modules.__all__, torch.optim's optimisers and torch.optim.lr_scheduler's schedulers: each
# must have a row in docs/torch_names.md
TORCH_NAMES = """
AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveLogSoftmaxWithLoss AdaptiveMaxPool1d
AdaptiveMaxPool2d AdaptiveMaxPool3d AlphaDropout AvgPool1d AvgPool2d AvgPool3d BCELoss BCEWithLogitsLoss
BatchNorm1d BatchNorm2d BatchNorm3d Bilinear CELU CTCLoss ChannelShuffle CircularPad1d CircularPad2d
CircularPad3d ConstantPad1d ConstantPad2d ConstantPad3d Container Conv1d Conv2d Conv3d ConvTranspose1d
ConvTranspose2d ConvTranspose3d CosineEmbeddingLoss CosineSimilarity CrossEntropyLoss CrossMapLRN2d Dropout
Dropout1d Dropout2d Dropout3d ELU Embedding EmbeddingBag FeatureAlphaDropout Flatten Fold FractionalMaxPool2d
FractionalMaxPool3d GELU GLU GRU GRUCell GaussianNLLLoss GroupNorm Hardshrink Hardsigmoid Hardswish Hardtanh
HingeEmbeddingLoss HuberLoss Identity InstanceNorm1d InstanceNorm2d InstanceNorm3d KLDivLoss L1Loss LPPool1d
LPPool2d LPPool3d LSTM LSTMCell LayerNorm LazyBatchNorm1d LazyBatchNorm2d LazyBatchNorm3d LazyConv1d LazyConv2d
LazyConv3d LazyConvTranspose1d LazyConvTranspose2d LazyConvTranspose3d LazyInstanceNorm1d LazyInstanceNorm2d
LazyInstanceNorm3d LazyLinear LeakyReLU Linear LinearCrossEntropyLoss LinearCrossEntropyOptions
LocalResponseNorm LogSigmoid LogSoftmax MSELoss MarginRankingLoss MaxPool1d MaxPool2d MaxPool3d MaxUnpool1d
MaxUnpool2d MaxUnpool3d Mish Module ModuleDict ModuleList MultiLabelMarginLoss MultiLabelSoftMarginLoss
MultiMarginLoss MultiheadAttention NLLLoss NLLLoss2d PReLU PairwiseDistance ParameterDict ParameterList
PixelShuffle PixelUnshuffle PoissonNLLLoss RMSNorm RNN RNNBase RNNCell RNNCellBase RReLU ReLU ReLU6
ReflectionPad1d ReflectionPad2d ReflectionPad3d ReplicationPad1d ReplicationPad2d ReplicationPad3d SELU
Sequential SiLU Sigmoid SmoothL1Loss SoftMarginLoss Softmax Softmax2d Softmin Softplus Softshrink Softsign
SyncBatchNorm Tanh Tanhshrink Threshold Transformer TransformerDecoder TransformerDecoderLayer
TransformerEncoder TransformerEncoderLayer TripletMarginLoss TripletMarginWithDistanceLoss Unflatten Unfold
Upsample UpsamplingBilinear2d UpsamplingNearest2d ZeroPad1d ZeroPad2d ZeroPad3d Adafactor Adadelta Adagrad Adam
Adamax AdamW ASGD LBFGS Muon NAdam Optimizer RAdam RMSprop Rprop SGD SparseAdam LambdaLR MultiplicativeLR StepLR
MultiStepLR ConstantLR LinearLR ExponentialLR SequentialLR CosineAnnealingLR ChainedScheduler ReduceLROnPlateau
CyclicLR CosineAnnealingWarmRestarts OneCycleLR PolynomialLR LRScheduler
""".split()


def _rows(page):
    rows = re.findall(r"^\| `([^`]+)` \| (`[^`]+`|\(none\)) \| (.*) \|$", (DOCS / page).read_text(), re.M)
    return {name: (target.strip("`") if target != "(none)" else None, note) for name, target, note in rows}


@pytest.mark.parametrize("page,names", [("flux_names.md", FLUX_NAMES), ("torch_names.md", TORCH_NAMES)])
def test_every_name_has_a_row_and_each_fluxpy_name_there_imports(page, names):
    import importlib.util
    rows = _rows(page)
    assert sorted(rows) == sorted(names), (set(names) ^ set(rows))
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
