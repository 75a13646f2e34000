"""airbench94: the network of the CIFAR-10 speed runs (94% test accuracy in about 3.8 s on an A100).

The architecture follows Keller Jordan's airbench (github.com/KellerJordan/cifar10-airbench:
``make_net`` in ``legacy/airbench94.py``, ``make_net94`` in ``airbench/lib_airbench94.py``): a
2×2 "whitening" convolution of 24 filters with a bias, GELU,
then three conv groups of 64, 256 and 256 channels, each

    conv 3×3 (no bias) → max-pool 2 → BatchNorm → GELU → conv 3×3 (no bias) → BatchNorm → GELU,

then a max over the remaining 3×3 map, a linear layer without bias and the logits multiplied by
1/9. Spatially: 32 → 31 (the unpadded 2×2 stem) → 15 → 7 → 3 → 1. The 3×3 convolutions start as
airbench's do: PyTorch's default initialisation, with the first `in_channels` filters replaced by
the identity (Dirac) so that each conv starts by passing its input through. BatchNorm has
airbench's momentum (0.6 in its convention, 1 - 0.6 = 0.4 in PyTorch's) and eps 1e-12: the
normalisation runs in float32 even under autocast, where 1e-12 is a normal number (float32
reaches 1.2e-38) and only matters for a channel whose batch variance is itself near zero.

What differs from airbench, which trains this network with a hand-tuned loop of its own:

- the whitening conv is an ordinary trainable conv with PyTorch's default initialisation.
  airbench sets its weights from the eigenvectors of the 2×2 patch covariance of 5000 training
  images and freezes them (its bias starts at zero and trains for the first 3 epochs only);
  ``init_whitening`` computes those weights for a caller that wants them;
- BatchNorm scales are trainable; airbench freezes them at 1 and trains only the shifts (with a
  64× learning rate);
- no lookahead EMA of the weights, no test-time augmentation (airbench averages flipped and
  translated views), and float32 weights (airbench keeps every weight but BatchNorm's in fp16);
- the final pooling is a max over the whole map (``amax``), the same as airbench's
  MaxPool2d(3) at 32×32 inputs, and inputs of any size from 9×9 up work. Not
  ``F.adaptive_max_pool2d(x, 1)``, which computes the same: PyTorch's kernels for it take a
  channels-last map one plane per thread block, 0.20 ms forward and 0.16 ms backward at batch
  1024 on an H100 (a twentieth of the step), where the reduction and its gradient's few
  element-wise passes take microseconds. Where a map's maximum is tied, the gradient is split
  evenly among the tied places (the max-pool gives it all to the first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCHNORM_MOMENTUM = 0.4  # PyTorch's convention: airbench's 0.6 is the weight of the old value
BATCHNORM_EPS = 1e-12
SCALING_FACTOR = 1 / 9    # airbench's `scaling_factor` on the logits
WHITEN_KERNEL = 2


def _conv3x3(in_channels: int, out_channels: int) -> nn.Conv2d:
    """A 3×3 same-padded conv without bias whose first `in_channels` filters start as the
    identity, as airbench initialises its convolutions."""
    conv = nn.Conv2d(in_channels, out_channels, 3, padding="same", bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:min(in_channels, out_channels)])
    return conv


class ConvGroup(nn.Module):
    """conv → max-pool 2 → BatchNorm → GELU → conv → BatchNorm → GELU; halves the resolution."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = _conv3x3(in_channels, out_channels)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = nn.BatchNorm2d(out_channels, eps=BATCHNORM_EPS, momentum=BATCHNORM_MOMENTUM)
        self.conv2 = _conv3x3(out_channels, out_channels)
        self.norm2 = nn.BatchNorm2d(out_channels, eps=BATCHNORM_EPS, momentum=BATCHNORM_MOMENTUM)
        self.activ = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activ(self.norm1(self.pool(self.conv1(x))))
        return self.activ(self.norm2(self.conv2(x)))


class AirbenchCIFAR(nn.Module):
    """The whitening stem, three conv groups, a global max, a linear layer and the 1/9 scale."""

    def __init__(self, widths: tuple[int, ...], num_classes: int = 10):
        super().__init__()
        if not widths or any(w < 1 for w in widths):
            raise ValueError(f"widths must be a non-empty tuple of positive channel counts; "
                             f"got {widths}")
        whiten_width = 2 * 3 * WHITEN_KERNEL**2  # each patch direction with both signs: 24
        self.whiten = nn.Conv2d(3, whiten_width, WHITEN_KERNEL, padding=0, bias=True)
        self.activ = nn.GELU()
        channels = (whiten_width, *widths)
        self.groups = nn.Sequential(*[ConvGroup(a, b) for a, b in zip(channels, channels[1:])])
        self.head = nn.Linear(widths[-1], num_classes, bias=False)
        self.scale = SCALING_FACTOR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.groups(self.activ(self.whiten(x)))
        out = out.amax(dim=(2, 3))
        return self.head(out) * self.scale


def airbench_cifar(num_classes: int = 10,
                   widths: tuple[int, ...] = (64, 256, 256)) -> AirbenchCIFAR:
    """airbench94's network for 32×32 images: 1.97 M parameters at the default widths."""
    return AirbenchCIFAR(tuple(widths), num_classes)


@torch.no_grad()
def init_whitening(conv: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    """Sets `conv`'s weights to whiten the k×k patches of `images` [N, C, H, W], as airbench
    initialises its stem.

    With C the patch second-moment matrix (C·k·k square, not mean-centred, as airbench has it)
    and C = V diag(λ) Vᵀ, filter i is v_i / sqrt(λ_i + eps), eigenvalues in descending order,
    and filter C·k·k + i its negative: conv needs 2·C·k·k output channels (24 for RGB and
    2×2). Without the bias, the first half of the outputs then has second moment
    diag(λ / (λ + eps)), the identity up to eps, over the patches; eps keeps the directions of
    near-zero variance from being amplified without bound. The covariance is computed in
    float64 and the weights cast to conv's dtype; the bias and requires_grad are left as they
    are.
    """
    kh, kw = conv.kernel_size
    dim = conv.in_channels * kh * kw
    if conv.out_channels != 2 * dim or conv.groups != 1:
        raise ValueError(f"a whitening conv needs 2 x in_channels x kernel area = {2 * dim} "
                         f"output channels and groups=1; got {conv.out_channels} and "
                         f"groups={conv.groups}")
    if images.dim() != 4 or images.shape[1] != conv.in_channels:
        raise ValueError(f"images must be [N, {conv.in_channels}, H, W]; got "
                         f"{list(images.shape)}")
    # [N, dim, L]: every k×k patch (stride 1, no padding) flattened as (channel, row, column),
    # the order of conv.weight[o].flatten().
    patches = F.unfold(images.double(), (kh, kw))
    count = patches.shape[0] * patches.shape[2]
    moment = torch.einsum("nil,njl->ij", patches, patches) / count  # [dim, dim]
    eigenvalues, eigenvectors = torch.linalg.eigh(moment)           # ascending
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
    filters = (eigenvectors / torch.sqrt(eigenvalues + eps)).T      # [dim, dim], one per row
    weight = torch.cat([filters, -filters]).view_as(conv.weight)
    conv.weight.copy_(weight.to(conv.weight.dtype))
