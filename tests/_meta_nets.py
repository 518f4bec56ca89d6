"""A small MAML conv net and tasks shared by the meta conv tests (float64, 8x8, 4-way)."""

from __future__ import annotations

import torch
from torch import nn

from torchfn.meta import Task

DT = torch.float64
N_TASKS, N_WAY, SIZE = 3, 4, 8


def conv_net() -> nn.Module:
    """Two conv blocks (3 channels, per-task BatchNorm, ReLU, max-pool) and a linear head."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    c_in = 1
    for _ in range(2):
        layers += [nn.Conv2d(c_in, 3, 3, padding=1), nn.BatchNorm2d(3, track_running_stats=False),
                   nn.ReLU(), nn.MaxPool2d(2)]
        c_in = 3
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(3 * (SIZE // 4) ** 2, N_WAY)).to(DT)


def conv_tasks() -> Task:
    """``N_TASKS`` tasks of 2 support and 2 query images per class."""
    g = torch.Generator().manual_seed(1)
    labels = torch.arange(N_WAY).repeat(N_TASKS, 2)
    return Task(torch.randn(N_TASKS, 2 * N_WAY, 1, SIZE, SIZE, generator=g, dtype=DT), labels,
                torch.randn(N_TASKS, 2 * N_WAY, 1, SIZE, SIZE, generator=g, dtype=DT), labels)
