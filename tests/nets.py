"""Small models several test files share (imported as `from nets import ...`: pytest puts
tests/, the folder of tests/conftest.py, on sys.path, tests/gpu/ included).

A model special to one file's point (a branch, a custom module, an untraceable forward) stays
in that file.
"""

import torch
from torch import nn


class Skips(nn.Module):
    """Linears each with a skip past it (so a skip crosses every cut), a LayerNorm and a
    buffer."""

    def __init__(self, width=16, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h)) + h
        return self.head(self.norm(h) * self.scale)


class NormDrop(nn.Module):
    """Dropout, BatchNorm and a skip connection across stages: a step draws random numbers
    and updates buffers. Takes and gives `features` features; its modules are registered in
    the order they run (as the pipeline's parameters come)."""

    def __init__(self, features=8, width=32, p=0.3):
        super().__init__()
        self.a, self.b = nn.Linear(features, width), nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(p)
        self.c = nn.Linear(width, features)

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = self.drop(torch.relu(self.norm(self.b(h)))) + h
        return self.c(g)


class Head(nn.Module):
    """A small body and a wide linear head (named `head`, for scripted costs)."""

    def __init__(self, features=16, width=32, outputs=96):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), nn.ReLU(),
                                  nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        return self.head(self.body(x))
