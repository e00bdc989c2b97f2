"""The Local Perceptron's conv-BN branches trained as one dense FC on a CPU (``repmlp.nn.branches_fc``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from repmlp import create_model
from repmlp.nn import branches_fc
from repmlp.nn.branches_fc import branches_fit_fc, dense_conv_index
from repmlp.nn.layers import ConvBN
from repmlp.nn.reparam import conv_to_fc


@settings(max_examples=30, deadline=None)
@given(
    g=st.integers(1, 3),
    og=st.integers(1, 3),
    cg=st.integers(1, 3),
    h=st.integers(1, 6),
    w=st.integers(1, 6),
    kh=st.sampled_from([1, 3, 5, 7, 9, 11, 13]),
    kw=st.sampled_from([1, 3, 5, 7, 9, 11, 13]),
)
def test_dense_index_places_every_kernel_tap_as_the_conv_does(g, og, cg, h, w, kh, kw) -> None:
    """The gathered FC computes the same-padded conv on the map, kernels larger than the map included; where
    the kernel fits, it is :func:`conv_to_fc`'s kernel exactly."""
    torch.manual_seed(0)
    out_ch, s = g * og, h * w
    kernel = torch.randn(out_ch, cg, kh, kw, dtype=torch.float64)
    dense = torch.cat([kernel.new_zeros(1), kernel.flatten()])[dense_conv_index(out_ch, cg, kh, kw, h, w)]
    x = torch.randn(3, g * cg, h, w, dtype=torch.float64)
    rows = x.reshape(3, g, cg * s).transpose(0, 1)
    got = (
        torch.bmm(rows, dense.view(g, og * s, cg * s).transpose(1, 2))
        .transpose(0, 1)
        .reshape(3, out_ch, h, w)
    )
    want = F.conv2d(x, kernel, padding=(kh // 2, kw // 2), groups=g)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if kh <= h and kw <= w:
        assert torch.equal(dense, conv_to_fc(kernel, None, (h, w), g)[0])


class _Spy:
    """Counts :func:`branch_sum_as_fc` calls made by the modules that use it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = branches_fc.branch_sum_as_fc

        def spy(x, branches):
            self.calls += 1
            return real(x, branches)

        monkeypatch.setattr(branches_fc, "branch_sum_as_fc", spy)


@pytest.mark.parametrize(
    ("name", "channels_last"),
    [("repmlp_cifar", False), ("repmlp_cifar_fc3_conv9", False), ("repmlp_cifar_no_global", False),
     ("repmlp_cifar_fc3_conv9", True)],
)  # fmt: skip
def test_narrow_branches_train_as_one_fc_with_the_convs_values(monkeypatch, name, channels_last) -> None:
    """A float64 training step of a narrow study network (2 and 4 channels a group on 8x8 partitions) takes
    the FC form in its RepMLP blocks (row D: the 9x9 conv as well) and gives the conv form's output,
    gradients of every parameter and BatchNorm running statistics; also with channels_last weights and
    input, as ``--preset fmnist`` trains."""
    torch.manual_seed(0)
    fc_model = create_model(name, num_classes=10, in_chans=1, img_size=32, width_multiplier=0.25)
    fc_model = fc_model.double().train()
    layout = torch.channels_last if channels_last else torch.contiguous_format
    fc_model.to(memory_format=layout)
    conv_model = copy.deepcopy(fc_model)
    x = torch.randn(3, 1, 32, 32, dtype=torch.float64).contiguous(memory_format=layout)
    spy = _Spy(monkeypatch)
    fc_out = fc_model(x)
    fc_out.square().sum().backward()
    assert spy.calls == 4  # two blocks in each of the two narrow stages (2 and 4 channels a group)
    monkeypatch.setattr(branches_fc, "FC_MAC_RATIO", 0.0)  # the convs, as before the FC form existed
    conv_out = conv_model(x)
    conv_out.square().sum().backward()
    assert spy.calls == 4
    torch.testing.assert_close(fc_out, conv_out, rtol=1e-10, atol=1e-12)
    for (key, a), b in zip(fc_model.named_parameters(), conv_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11, msg=key)
    for (key, a), b in zip(fc_model.named_buffers(), conv_model.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=key)


def _branches(channels: int, kernels: tuple[int, ...], groups: int = 2) -> list[ConvBN]:
    return [ConvBN(channels, channels, k, groups=groups).train() for k in kernels]


@pytest.mark.parametrize(
    ("case", "fits"),
    [
        ("narrow", True),
        ("eight channels a group", False),  # oneDNN's direct NCHW kernels: the convs stay
        ("dense FC too costly", False),  # one 3x3 branch on 7x7: 49 / 9 > FC_MAC_RATIO
        ("no autograd", False),
        ("BatchNorm in evaluation", False),
        ("channels_last map", False),
        ("strided", False),
    ],
)
def test_the_fc_form_is_taken_only_for_narrow_training_branches(case, fits) -> None:
    branches = _branches(4, (1, 3, 5, 7))
    x = torch.randn(2, 4, 8, 8)
    if case == "eight channels a group":
        branches, x = _branches(16, (1, 3, 5, 7)), torch.randn(2, 16, 8, 8)
    elif case == "dense FC too costly":
        branches, x = _branches(4, (3,)), torch.randn(2, 4, 7, 7)
    elif case == "BatchNorm in evaluation":
        branches[1].eval()
    elif case == "channels_last map":
        x = x.contiguous(memory_format=torch.channels_last)
    elif case == "strided":
        branches[2].conv.stride = (2, 2)
    with torch.set_grad_enabled(case != "no autograd"):
        assert branches_fit_fc(x, branches) is fits
