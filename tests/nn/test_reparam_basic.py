import torch
import torch.nn.functional as F

from repmlp import conv_to_fc, conv_to_fc_identity


def test_conv_to_fc_matches_conv2d_and_identity_construction():
    torch.manual_seed(0)
    k = torch.randn(6, 3, 3, 5, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    w, bias = conv_to_fc(k, b, (5, 7), groups=3)
    x = torch.randn(4, 9, 5, 7, dtype=torch.float64)
    ref = F.conv2d(x, k, b, padding=(1, 2), groups=3)
    out = F.conv2d(x.reshape(4, -1, 1, 1), w.reshape(*w.shape, 1, 1), bias, groups=3).reshape_as(ref)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    w2, _ = conv_to_fc_identity(k, b, (5, 7), groups=3)
    torch.testing.assert_close(w, w2, rtol=0, atol=0)
