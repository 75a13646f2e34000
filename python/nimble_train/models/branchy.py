"""A branchy, inception-style network for 32×32 images: the multi-stream showcase.

Every cell runs four small convolution branches side by side and concatenates them (GoogLeNet's
inception module, as NAS cells are built): a 1×1; a 1×1 reduction then a 3×3; a 1×1 reduction
then two 3×3 (a 5×5 receptive field for less compute); a 3×3 max-pool then a 1×1. Each branch
is a chain of small kernels that do not depend on the other branches, so at small batch one
stream leaves the GPU mostly idle while four streams keep it busy.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn_relu(in_channels: int, out_channels: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class BranchyCell(nn.Module):
    """Four parallel branches whose outputs are concatenated into `out_channels` channels.

    The split follows GoogLeNet's proportions: of 128 output channels, 32 come from the 1×1
    branch, 48 from the 3×3, 24 from the double 3×3 and 24 from the pool branch; the 3×3
    branches first reduce to 32 and 16 channels.
    """

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        if out_channels % 16:
            raise ValueError(f"a cell's width must be a multiple of 16; got {out_channels}")
        c = out_channels // 16
        self.branch1 = conv_bn_relu(in_channels, 4 * c, 1)
        self.branch3 = nn.Sequential(conv_bn_relu(in_channels, 4 * c, 1),
                                     conv_bn_relu(4 * c, 6 * c, 3))
        self.branch5 = nn.Sequential(conv_bn_relu(in_channels, 2 * c, 1),
                                     conv_bn_relu(2 * c, 3 * c, 3),
                                     conv_bn_relu(3 * c, 3 * c, 3))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1),
                                         conv_bn_relu(in_channels, 3 * c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x),
                          self.branch_pool(x)], dim=1)


class BranchyCIFAR(nn.Module):
    """A 3×3 stem, then stages of cells at 32×32, 16×16 and 8×8 (max-pooling between)."""

    def __init__(self, widths: tuple[int, ...], cells_per_stage: tuple[int, ...],
                 stem: int = 64, num_classes: int = 10):
        super().__init__()
        if len(widths) != len(cells_per_stage) or not widths:
            raise ValueError("widths and cells_per_stage must be non-empty and of one length; "
                             f"got {widths} and {cells_per_stage}")
        layers: list[nn.Module] = [conv_bn_relu(3, stem, 3)]
        channels = stem
        for stage, (width, cells) in enumerate(zip(widths, cells_per_stage)):
            if stage > 0:
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
            for _ in range(cells):
                layers.append(BranchyCell(channels, width))
                channels = width
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.features(x)
        out = torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1)
        return self.fc(out)


def branchy_cifar(num_classes: int = 10, width: float = 1.0) -> BranchyCIFAR:
    """The branchy CIFAR network: 8 cells (2, 4, 2) of 128, 256 and 512 channels, 57
    convolutions and 1.66 M parameters at width 1; `width` scales every layer (0.25 for
    tests)."""
    def scaled(c: int) -> int:
        return max(16, int(round(c * width / 16)) * 16)
    return BranchyCIFAR(widths=(scaled(128), scaled(256), scaled(512)),
                        cells_per_stage=(2, 4, 2), stem=scaled(64), num_classes=num_classes)
