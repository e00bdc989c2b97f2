"""The training-time block as dense matmuls (repmlp.nn.dense, ``train_form="dense"``): the same function as the
paper's conv-BN branches, in training and evaluation, forward and backward, and the form's selection."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from equivalence import randomize
from repmlp import RepMLPBlock, reparameterize_model
from repmlp.nn.block import TRAIN_FORMS, set_train_form
from repmlp.nn.dense import conv_as_dense_flipped, from_group_columns, to_group_columns
from repmlp.nn.reparam import conv_to_fc

FAST = settings(max_examples=25, deadline=None)


def pair(
    channels: int = 8, out: int = 12, res=(14, 14), part=(7, 7), **kw
) -> tuple[RepMLPBlock, RepMLPBlock]:
    """Two copies of one float64 block: the conv form and the dense form."""
    torch.manual_seed(0)
    conv = randomize(RepMLPBlock(channels, out, res, part, **kw).double(), 1)
    dense = copy.deepcopy(conv)
    set_train_form(conv, "conv")
    set_train_form(dense, "dense")
    return conv, dense


@FAST
@given(
    k=st.sampled_from([(1, 1), (3, 3), (5, 5), (1, 3), (3, 5)]),
    hw=st.sampled_from([(5, 5), (7, 7), (5, 7), (6, 4)]),
    groups=st.sampled_from([1, 2, 4]),
)
def test_dense_kernel_is_the_conv_fc_on_flipped_input(k, hw, groups):
    """conv_as_dense_flipped is repmlp.nn.reparam.conv_to_fc with the input points reversed in both axes."""
    kh, kw = min(k[0], hw[0] - (1 - hw[0] % 2)), min(k[1], hw[1] - (1 - hw[1] % 2))
    h, w = hw
    kernel = torch.randn(8, 8 // groups, kh, kw, dtype=torch.float64)
    fc, _ = conv_to_fc(kernel, None, (h, w), groups)  # (O*h*w, C/g*h*w)
    dense = conv_as_dense_flipped(kernel, (h, w), groups)  # (g, O/g*h*w, C/g*h*w)
    unflipped = dense.reshape(groups, -1, 8 // groups, h, w).flip(3, 4).reshape(fc.shape)
    assert torch.equal(unflipped, fc)


def test_group_columns_round_trip():
    x = torch.randn(2, 12, 10, 14)
    cols = to_group_columns(x, 5, 7, 3)  # (g, C/g*h*w, N*Hp*Wp)
    assert cols.shape == (3, 4 * 35, 2 * 2 * 2)
    back = from_group_columns(cols.reshape(3, 4, 35, 8).reshape(12, 35, 8), 2, 2, 2, 5, 7)
    assert torch.equal(back, x)
    cl = from_group_columns(cols.reshape(12, 35, 8), 2, 2, 2, 5, 7, channels_last=True)
    assert torch.equal(cl, x) and cl.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # four partitions, Global Perceptron, K = 1, 3, 5, 7
        dict(res=(13, 11), part=(5, 7), kernel_sizes=((3, 1), 5), groups=2),  # padded, (kh, kw) pairs
        dict(res=(7, 7), kernel_sizes=(1, 3), groups=4),  # one partition: no Global Perceptron
        dict(global_perceptron=False, kernel_sizes=(3,), groups=2),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_dense_training_step_equals_conv_form(kw, channels_last):
    """Outputs, every gradient and the BatchNorms' running statistics after a training forward agree."""
    conv, dense = pair(**kw)
    res = conv.resolution
    x = torch.randn(3, 8, *res, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    outs, grads = [], []
    for block in (conv, dense):
        block.train()
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        outs.append(y)
        grads.append([xi.grad, *(p.grad for p in block.parameters())])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    assert outs[1].is_contiguous(memory_format=torch.channels_last) == outs[0].is_contiguous(
        memory_format=torch.channels_last
    )
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
    for (name, a), (_, b) in zip(conv.named_buffers(), dense.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=0, msg=name)


def test_dense_form_is_training_only_and_converts_the_same():
    """Evaluation runs the conv form (bitwise the same), and conversion does not depend on the form."""
    conv, dense = pair(kernel_sizes=(1, 3, 5))
    x = torch.randn(2, 8, 14, 14, dtype=torch.float64)
    conv.eval(), dense.eval()
    assert torch.equal(dense(x), conv(x))
    deployed = reparameterize_model(dense)
    torch.testing.assert_close(deployed(x), conv(x), rtol=1e-10, atol=1e-10)


def test_train_form_selection():
    block = RepMLPBlock(8, 8, 14, 7, kernel_sizes=(3,))
    assert block.train_form == "auto" and not block._dense_training  # CPU: the conv form
    assert set_train_form(nn.Sequential(block, nn.ReLU()), "dense") == 1
    assert block._dense_training
    block.float()  # any _apply re-resolves the setting; a pinned form stays
    assert block._dense_training
    block.train_form = "auto"
    assert not block._dense_training
    with pytest.raises(ValueError, match="train_form must be one of"):
        block.train_form = "fast"
    with pytest.raises(ValueError, match=", ".join(TRAIN_FORMS)):
        set_train_form(block, "gpu")


def test_dense_form_traces_with_fx():
    """A train-mode trace of the dense form is a graph that computes what the module computes."""
    conv, dense = pair(kernel_sizes=(1, 3))
    dense.train()
    traced = torch.fx.symbolic_trace(dense)
    assert "from_group_columns_like" in traced.code  # the layout decision stays a leaf
    x = torch.randn(2, 8, 14, 14, dtype=torch.float64)
    torch.manual_seed(0)
    expected = copy.deepcopy(dense)(x)
    torch.testing.assert_close(traced(x), expected)


def test_scripted_block_keeps_both_forms():
    """TorchScript compiles the block (the dense method is left out); evaluation still runs scripted."""
    block = RepMLPBlock(8, 8, 14, 7, kernel_sizes=(1, 3)).eval()
    scripted = torch.jit.script(block)
    x = torch.randn(2, 8, 14, 14)
    torch.testing.assert_close(scripted(x), block(x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_form_is_dense_on_cuda_and_equal():
    conv, dense = pair(kernel_sizes=(1, 3, 5))
    dense.train_form = "auto"
    dense.cuda()
    assert dense._dense_training
    conv.cuda().train(), dense.train()
    x = torch.randn(4, 8, 14, 14, dtype=torch.float64, device="cuda", requires_grad=True)
    torch.testing.assert_close(dense(x), conv(x), rtol=1e-12, atol=1e-12)
    dense.cpu()
    assert not dense._dense_training
