"""The zoo's non-transformer models: an MLP on vectors and a small convolutional classifier.

In: `MLPConfig` / `ConvNetConfig` (frozen) -> `MLP` / `ConvNet` module.
`MLP(x_BI) -> logits_BC`; `ConvNet(images_BCHW) -> logits_BK` (K classes).
Invariant: fixed shapes from the config, no data-dependent control flow, so both export with
`torch.export.export(strict=False)` on the meta device. They give the planner graphs without
attention or embeddings: pure GEMM chains (MLP) and convolutions (ConvNet).

Shape legend: B batch, I input features, C channels (or classes for the MLP), H/W image height
and width, K classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """`num_layers` hidden Linear+GELU layers of width `hidden`, then a Linear head."""

    in_features: int = 32
    hidden: int = 64
    num_layers: int = 3
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"MLPConfig: num_layers={self.num_layers} must be >= 1")


class MLP(nn.Module):
    """Feature vectors `[B, I]` -> class logits `[B, num_classes]`."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.in_features] + [config.hidden] * config.num_layers
        self.layers = nn.ModuleList(
            nn.Linear(w_in, w_out) for w_in, w_out in zip(widths[:-1], widths[1:], strict=True)
        )
        self.head = nn.Linear(config.hidden, config.num_classes)

    def forward(self, x_BI: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_BI = F.gelu(layer(x_BI))
        return self.head(x_BI)


@dataclass(frozen=True)
class ConvNetConfig:
    """Conv blocks of `channels[i]` output channels, each halving the image, then a Linear head."""

    in_channels: int = 3
    image_size: int = 32
    channels: tuple[int, ...] = (16, 32)
    kernel_size: int = 3
    num_classes: int = 10

    def __post_init__(self) -> None:
        if not self.channels:
            raise ValueError("ConvNetConfig: channels must name at least one conv block")
        reduction = 2 ** len(self.channels)
        if self.image_size % reduction:
            raise ValueError(
                f"ConvNetConfig: image_size={self.image_size} is not divisible by "
                f"2**len(channels)={reduction} (each block halves it)"
            )
        if self.kernel_size % 2 == 0:
            raise ValueError(f"ConvNetConfig: kernel_size={self.kernel_size} must be odd")

    @property
    def feature_size(self) -> int:
        """Flattened features entering the classifier: last channels * final side squared."""
        side = self.image_size // 2 ** len(self.channels)
        return self.channels[-1] * side * side


class ConvBlock(nn.Module):
    """`maxpool2(relu(conv(x)))`: a same-padded convolution, then halve height and width."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        return self.pool(F.relu(self.conv(x_BCHW)))


class ConvNet(nn.Module):
    """Images `[B, in_channels, image_size, image_size]` -> class logits `[B, num_classes]`."""

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.config = config
        ins = (config.in_channels, *config.channels[:-1])
        self.blocks = nn.ModuleList(
            ConvBlock(c_in, c_out, config.kernel_size)
            for c_in, c_out in zip(ins, config.channels, strict=True)
        )
        self.classifier = nn.Linear(config.feature_size, config.num_classes)

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        x = images_BCHW
        for block in self.blocks:
            x = block(x)
        return self.classifier(x.flatten(1))
