"""load_torch_state / to_torch_state: PyTorch state dicts into fluxpy models and back.

Without torch: round trips, the pairing's errors (nothing changes on a refused load), a .safetensors file. With
torch (skipped where it is missing): PyTorch modules with random weights and running statistics, loaded into the
fluxpy twin, give PyTorch's outputs in float64, and to_torch_state's dict loads back into PyTorch.
"""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fluxpy
from fluxpy import load_torch_state, to_torch_state
from fluxpy.layers import (GRU, LSTM, RNN, BatchNorm, Bilinear, Chain, Conv, ConvTranspose, CrossCor, Dense, DepthwiseConv, Embedding,
                           GroupNorm, LayerNorm, flatten)
from fluxpy.ops.activations import relu


def _net(rng, conv=Conv):
    return fluxpy.f64(Chain(conv((3, 3), 2, 4, pad=1, rng=rng), BatchNorm(4, relu), flatten, Dense(4 * 5 * 5, 3)))


def _randomised(model, rng):
    """Every array of ``model`` drawn anew (running variances positive)."""
    for key, value in to_torch_state(model).items():
        fresh = rng.standard_normal(value.shape)
        if key.endswith("running_var"):
            fresh = np.abs(fresh) + 0.5
        value[...] = fresh
    return model


@given(seed=st.integers(0, 2**31), conv=st.sampled_from([Conv, CrossCor]))
@settings(max_examples=10, deadline=None)
def test_a_state_out_and_back_in_gives_the_same_model(seed, conv):
    rng = np.random.default_rng(seed)
    a, b = _net(rng, conv), _net(rng, conv)
    state = {k: rng.standard_normal(v.shape) for k, v in to_torch_state(a).items()}
    state = {k: (np.abs(v) + 0.1 if k.endswith("running_var") else v) for k, v in state.items()}
    load_torch_state(a, state)
    load_torch_state(b, to_torch_state(a))
    x = rng.standard_normal((2, 2, 5, 5))
    np.testing.assert_array_equal(fluxpy.testmode(a)(x), fluxpy.testmode(b)(x))
    for k, v in to_torch_state(b).items():
        np.testing.assert_array_equal(v, state[k])


def test_conv_kernels_are_flipped_and_crosscor_kernels_are_not():
    w = np.arange(18.0).reshape(1, 2, 3, 3)
    conv, cross = Conv((3, 3), 2, 1), CrossCor((3, 3), 2, 1)
    load_torch_state(conv, {"weight": w, "bias": np.zeros(1)})
    load_torch_state(cross, {"weight": w, "bias": np.zeros(1)})
    np.testing.assert_array_equal(conv.weight, w[:, :, ::-1, ::-1].astype(np.float32))
    np.testing.assert_array_equal(cross.weight, w.astype(np.float32))
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(conv(x), cross(x), rtol=1e-5, atol=1e-5)   # the same function


def test_the_load_keeps_each_array_its_dtype_and_identity():
    model = Dense(3, 2)
    weight = model.weight
    load_torch_state(model, {"weight": np.ones((2, 3)), "bias": np.ones(2)})
    assert model.weight is weight and model.weight.dtype == np.float32 and model.weight.sum() == 6


@pytest.mark.parametrize("state,match", [
    ({"0.weight": np.ones((3, 2)), "0.bias": np.ones(3)}, r"has 2 layers with arrays \(Dense, Dense\) but the state has 1 modules \(0\)"),
    ({"0.weight": np.ones((3, 2)), "0.bias": np.ones(3), "1.weight": np.ones((1, 3)), "1.beta": np.ones(1)},
     r"module '1' holds \['beta', 'weight'\] but the layer it pairs with, layers.1"),
    ({"0.weight": np.ones((3, 2)), "0.bias": np.ones(3), "1.weight": np.ones((3, 1)), "1.bias": np.ones(1)},
     r"'1.weight' gives shape \(3, 1\) but layers.1.weight of Dense\(3 => 1\) has shape \(1, 3\)"),
    ({"0.weight": np.ones((3, 2)), "0.bias": np.ones(3), "1.weight": [[1.0, 2.0, 3.0]], "1.bias": np.ones(1)},
     r"expects the state's '1.weight' to be an array or a torch tensor, got list"),
])
def test_a_state_that_does_not_fit_is_refused_before_any_change(state, match):
    model = Chain(Dense(2, 3), Dense(3, 1))
    before = {k: v.copy() for k, v in to_torch_state(model).items()}
    with pytest.raises((ValueError, TypeError), match=match):
        load_torch_state(model, state)
    for k, v in to_torch_state(model).items():
        np.testing.assert_array_equal(v, before[k])


def test_a_layer_without_a_mapping_is_named():
    with pytest.raises(TypeError, match="no PyTorch mapping for Bilinear yet"):
        load_torch_state(Chain(Bilinear((2, 2), 3)), {"b.weight": np.ones((3, 2, 2)), "b.bias": np.ones(3)})
    with pytest.raises(TypeError, match="expects a state dict .* got int"):
        load_torch_state(Dense(2, 2), 3)


def test_a_safetensors_file_loads(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(1)
    model = _randomised(_net(rng), rng)
    save_file(to_torch_state(model), tmp_path / "w.safetensors")
    fresh = _net(rng)
    keys = load_torch_state(fresh, tmp_path / "w.safetensors")
    assert keys["1.running_var"] == "layers.1.running_var" and keys["3.weight"] == "layers.3.weight"
    for k, v in to_torch_state(fresh).items():
        np.testing.assert_array_equal(v, to_torch_state(model)[k])


def test_to_torch_state_takes_the_keys_of_like_by_order():
    model = Chain(Dense(2, 3, relu), Dense(3, 1))
    like = {"fc1.weight": None, "fc1.bias": None, "head.weight": None, "head.bias": None}
    assert list(to_torch_state(model, like)) == list(like)
    with pytest.raises(ValueError, match="has 2 modules with arrays but like has 1 modules"):
        to_torch_state(model, {"a.weight": None})


# ---------------------------------------------------------------------------------------------
# Against PyTorch


def _torch():
    return pytest.importorskip("torch")


def _torch_randomised(torch, module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
                if name.endswith("running_var"):
                    t.abs_().add_(0.5)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_a_pytorch_conv_net_loaded_gives_its_outputs(seed):
    torch = _torch()
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=4),
                        nn.GroupNorm(2, 4), nn.ConvTranspose2d(4, 3, 2, stride=2), nn.Flatten(), nn.LayerNorm(48),
                        nn.Linear(48, 5)).double().eval()
    _torch_randomised(torch, net, seed)
    twin = fluxpy.f64(Chain(CrossCor((3, 3), 2, 4, pad=1), BatchNorm(4, relu), DepthwiseConv((3, 3), 4, 4),
                            GroupNorm(4, 2), ConvTranspose((2, 2), 4, 3, stride=2), flatten, LayerNorm(48),
                            Dense(48, 5)))
    load_torch_state(twin, net.state_dict())
    x = np.random.default_rng(seed).standard_normal((2, 2, 4, 4))
    want = net(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(fluxpy.testmode(twin)(x), want, rtol=1e-10, atol=1e-10)
    state = to_torch_state(twin, net.state_dict())
    _torch_randomised(torch, net, seed + 7)   # other weights, then the twin's written back
    net.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    np.testing.assert_allclose(net(torch.from_numpy(x)).detach().numpy(), want, rtol=1e-12, atol=1e-12)


def test_a_pytorch_embedding_loaded_gives_its_rows():
    torch = _torch()
    emb = _torch_randomised(torch, torch.nn.Embedding(7, 3).double(), 3)
    twin = fluxpy.f64(Embedding(7, 3))
    load_torch_state(twin, emb.state_dict())
    tokens = np.array([[0, 6, 2]])
    np.testing.assert_array_equal(twin(tokens), emb(torch.from_numpy(tokens)).detach().numpy())


# ---------------------------------------------------------------------------------------------
# from_torch


def _compare(torch, net, x, train):
    model = fluxpy.from_torch(net)
    net.train(train)
    model = fluxpy.trainmode(model) if train else fluxpy.testmode(model)
    want = net(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(model(x), want, rtol=1e-9, atol=1e-10)
    return model


@pytest.mark.parametrize("train", [False, True])
def test_from_torch_builds_a_conv_net_that_computes_what_pytorch_computes(train):
    torch = _torch()
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, stride=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(6, 6, 3, padding="same", groups=3, bias=False), nn.GELU(), nn.AvgPool2d(2, padding=1),
                        nn.Sequential(nn.Conv2d(6, 4, 1), nn.LeakyReLU(0.2)), nn.AdaptiveAvgPool2d((2, 2)),
                        nn.Flatten(), nn.Dropout(0.0), nn.Linear(16, 8), nn.LayerNorm(8), nn.ELU(0.7), nn.Tanh(),
                        nn.Linear(8, 3), nn.SiLU()).double()
    _torch_randomised(torch, net, 5)
    x = np.random.default_rng(5).standard_normal((4, 3, 8, 8))
    model = _compare(torch, net, x, train)
    if train:   # the running statistics moved alike (PyTorch's unbiased variance)
        np.testing.assert_allclose(model.layers[1].running_var, net[1].running_var.numpy(), rtol=1e-10)
        np.testing.assert_allclose(model.layers[1].running_mean, net[1].running_mean.numpy(), rtol=1e-10)


def test_from_torch_float32_and_1d_and_transposed_convolutions():
    torch = _torch()
    nn = torch.nn
    net = nn.Sequential(nn.Conv1d(2, 4, 3, stride=2, dilation=1), nn.ReLU(), nn.ConvTranspose1d(4, 2, 3, stride=2,
                        output_padding=1), nn.GroupNorm(2, 2), nn.Flatten(), nn.Linear(2 * 18, 3))
    _torch_randomised(torch, net, 2)
    model = fluxpy.from_torch(net)
    assert model.layers[0].weight.dtype == np.float32
    x = np.random.default_rng(2).standard_normal((3, 2, 17)).astype(np.float32)
    np.testing.assert_allclose(model(x), net.eval()(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_from_torch_names_what_it_cannot_convert():
    torch = _torch()
    nn = torch.nn
    with pytest.raises(TypeError, match=r"no fluxpy twin for LSTM at 1"):
        fluxpy.from_torch(nn.Sequential(nn.Linear(2, 2), nn.LSTM(2, 2)))
    with pytest.raises(TypeError, match=r"Conv2d at 0 \(padding_mode='reflect'"):
        fluxpy.from_torch(nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")))
    with pytest.raises(TypeError, match="from_torch expects a torch.nn.Module, got dict"):
        fluxpy.from_torch({})


def test_recurrent_biases_are_summed_in_and_split_out():
    rng = np.random.default_rng(4)
    lstm = LSTM(2, 3)
    state = {"weight_ih_l0": rng.standard_normal((12, 2)), "weight_hh_l0": rng.standard_normal((12, 3)),
             "bias_ih_l0": rng.standard_normal(12), "bias_hh_l0": rng.standard_normal(12)}
    keys = load_torch_state(lstm, state)
    assert keys["bias_hh_l0"] == keys["bias_ih_l0"] == "cell.bias"
    np.testing.assert_allclose(lstm.cell.bias, (state["bias_ih_l0"] + state["bias_hh_l0"]).astype(np.float32))
    out = to_torch_state(lstm)
    np.testing.assert_array_equal(out["cell.bias_hh_l0"], np.zeros(12, np.float32))
    gru = GRU(2, 3)
    before = gru.cell.weight_ih.copy()
    bad = {"weight_ih_l0": np.ones((9, 2)), "weight_hh_l0": np.ones((9, 3)), "bias_ih_l0": np.ones(9),
           "bias_hh_l0": np.ones(9)}
    with pytest.raises(ValueError, match=r"no recurrent bias of the n gate, but PyTorch's bias_hh_l0\[6:\] is not zero"):
        load_torch_state(gru, bad)
    np.testing.assert_array_equal(gru.cell.weight_ih, before)


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
def test_pytorch_recurrent_layers_loaded_give_their_outputs(kind):
    torch = _torch()
    net = getattr(torch.nn, kind)(3, 4, batch_first=True).double()
    _torch_randomised(torch, net, 8)
    if kind == "GRU":
        with torch.no_grad():
            net.bias_hh_l0[8:] = 0   # fluxpy's GRU (Flux's form) has no recurrent bias of the n gate
    twin = fluxpy.f64({"RNN": RNN(3, 4, fluxpy.tanh), "LSTM": LSTM(3, 4), "GRU": GRU(3, 4)}[kind])
    load_torch_state(twin, net.state_dict())
    x = np.random.default_rng(8).standard_normal((2, 5, 3))
    np.testing.assert_allclose(twin(x), net(torch.from_numpy(x))[0].detach().numpy(), rtol=1e-10, atol=1e-12)


class _OtherArray:
    """Another library's array: a shape, a dtype of its own, the DLPack protocol."""
    shape, dtype = (3,), "other.float32"

    def __dlpack__(self, stream=None):
        raise AssertionError("never read: refused before")


def test_gradient_refuses_another_librarys_array_with_what_to_do():
    for arg in (_OtherArray(), {"w": _OtherArray()}):
        with pytest.raises(TypeError, match=r"gradient: an argument holds a .*_OtherArray \(3,\), another library's "
                                            r"array; .* numpy.from_dlpack\(x\) \(CPU\) or cupy.from_dlpack\(x\)"):
            fluxpy.gradient(lambda a: 0.0, arg)


def test_dlpack_takes_a_pytorch_tensor_without_a_copy_and_gives_it_back():
    torch = _torch()
    t = torch.arange(4.0, dtype=torch.float64)
    x = np.from_dlpack(t)
    x[0] = 7.0
    assert t[0].item() == 7.0   # the same memory
    (g,) = fluxpy.gradient(lambda a: fluxpy.sum(a * a), x)
    np.testing.assert_array_equal(torch.from_dlpack(g).numpy(), 2 * x)


@pytest.mark.parametrize("kind", ["attention", "encoder", "decoder"])
def test_pytorch_attention_and_transformer_layers_loaded_give_their_outputs(kind):
    """PyTorch packs q, k and v into in_proj_weight/in_proj_bias: split into the three projections, and packed
    again by to_torch_state."""
    torch = _torch()
    nn = torch.nn
    net = {"attention": lambda: nn.MultiheadAttention(8, 2, batch_first=True),
           "encoder": lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True,
                                                         activation="gelu"),
           "decoder": lambda: nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True,
                                                         activation="gelu")}[kind]().double().eval()
    _torch_randomised(torch, net, 9)
    twin = fluxpy.f64({"attention": fluxpy.MultiHeadAttention(8, 2, bias=True),
                       "encoder": fluxpy.TransformerEncoderLayer(8, 2, 16, act=fluxpy.gelu_erf),
                       "decoder": fluxpy.TransformerDecoderLayer(8, 2, 16, act=fluxpy.gelu_erf)}[kind])
    keys = load_torch_state(twin, net.state_dict())
    rng = np.random.default_rng(9)
    x, memory = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 3, 8))
    tx, tm = torch.from_numpy(x), torch.from_numpy(memory)
    if kind == "attention":
        assert keys["in_proj_weight"] == "q_proj.weight, k_proj.weight, v_proj.weight"
        got, want = twin(x)[0], net(tx, tx, tx)[0]
    elif kind == "encoder":
        got, want = twin(x), net(tx)
    else:
        causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
        got, want = twin(x, memory), net(tx, tm, tgt_mask=causal, tgt_is_causal=True)   # fluxpy's default: causal
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    back = to_torch_state(twin, net.state_dict())
    assert list(back) == [k for k in net.state_dict() if not k.endswith("num_batches_tracked")]
    for k, v in net.state_dict().items():
        np.testing.assert_allclose(back[k], v.numpy(), rtol=1e-12, err_msg=k)


@pytest.mark.parametrize("norm_first,activation", [(True, "gelu"), (False, "relu")])
def test_from_torch_converts_a_transformer_encoder(norm_first, activation):
    torch = _torch()
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first,
                                       activation=activation)
    net = nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8),
                                                               enable_nested_tensor=False), nn.Linear(8, 3))
    net = _torch_randomised(torch, net.double(), 10).eval()
    x = np.random.default_rng(10).standard_normal((2, 6, 4))
    _compare(torch, net, x, train=False)


def test_the_torchvision_resnet_example_ports_trains_and_hands_back(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("torchvision")
    import sys
    examples = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    sys.modules.pop("torchvision_resnet", None)
    import torchvision_resnet
    with fluxpy.options(cache_dir=str(tmp_path)):   # an empty cache: the MNIST subset fluxpy ships
        acc = torchvision_resnet.main(["--steps", "2", "--test-images", "50", "--device", "cpu"])
    out = capsys.readouterr().out   # main raises where the two disagree (logits, or predictions after training)
    assert 0.0 <= acc <= 1.0
    assert "largest logit difference from PyTorch's" in out and "agree with fluxpy's on" in out
