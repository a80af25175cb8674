"""megascale's RMSNorm against torch's `nn.RMSNorm`, and its hand-written backward against autograd; both
norms with a bfloat16 copy of their gain (FSDP's gather under bfloat16 compute) compute as on its float32
value."""

import pytest
import torch
from torch import nn

from megascale.models.norm import LayerNorm, RMSNorm, _RMSNormFunction


def twin_norms(dim: int, eps: float | None = 1e-5) -> tuple[RMSNorm, nn.RMSNorm]:
    ours, torchs = RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(1)))
        torchs.weight.copy_(ours.weight)
    return ours, torchs


def forward_and_grads(norm: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    leaf = x.detach().clone().requires_grad_()
    out = norm(leaf)
    out.backward(upstream)
    return [out.detach(), leaf.grad, norm.weight.grad]


@pytest.mark.parametrize("eps", [1e-5, None])
@pytest.mark.parametrize("shape", [(2, 9, 32), (2, 4, 9, 16)])  # residual stream; per-head (QK-norm)
def test_matches_torch_rmsnorm(shape, eps):
    generator = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(shape, generator=generator)
    upstream = torch.randn(shape, generator=generator)
    ours, torchs = twin_norms(shape[-1], eps)
    got, want = forward_and_grads(ours, x, upstream), forward_and_grads(torchs, x, upstream)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the same ops in the same order
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)


def test_backward_is_the_gradient_of_the_forward():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-5), (x, weight))


def test_bfloat16_input_takes_torchs_path():
    """A bfloat16 input (QK-norm under autocast) is normalised by torch's rms_norm, in its dtype."""
    ours, torchs = twin_norms(16)
    x = torch.randn(2, 3, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ours(x).dtype == torch.bfloat16
        torch.testing.assert_close(ours(x), torchs(x), rtol=0, atol=0)


def test_same_state_dict_as_torchs():
    ours, torchs = twin_norms(8)
    assert ours.state_dict().keys() == torchs.state_dict().keys()
    torchs.load_state_dict(ours.state_dict())


@pytest.mark.parametrize("norm", [RMSNorm, LayerNorm])
def test_a_bfloat16_gain_is_applied_in_float32(norm):
    """Under bfloat16 autocast, float32 residual stream: the gain's bfloat16 copy gives what its value in
    float32 gives (output and input gradient), and its gradient is that one's, rounded to bfloat16."""
    generator = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(2, 9, 32, generator=generator), torch.randn(2, 9, 32, generator=generator)
    copied, widened = norm(32), norm(32)
    with torch.no_grad():
        gain = torch.randn(32, generator=generator).bfloat16()
        copied.weight = nn.Parameter(gain)
        widened.weight.copy_(gain.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grad_x, grad_gain = forward_and_grads(copied, x, upstream)
        expected_out, expected_grad_x, expected_grad_gain = forward_and_grads(widened, x, upstream)
    assert out.dtype == torch.float32 and grad_gain.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(grad_x, expected_grad_x, rtol=0, atol=0)
    torch.testing.assert_close(grad_gain, expected_grad_gain.bfloat16(), rtol=0, atol=0)
