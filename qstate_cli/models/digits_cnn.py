"""A small CNN on the handwritten digits that scikit-learn ships (no download).

Data: `sklearn.datasets.load_digits()`: 1797 grey 8x8 images of the digits 0-9 (values
0..16, scaled here to [0, 1]), read from a file inside the scikit-learn package. The
first 1500 (in a seeded shuffle) train, the rest validate.

Model: conv 3x3 (1 -> 16) + ReLU, conv 3x3 (16 -> 32) + ReLU, 2x2 max-pool
([B, 32, 4, 4] = 512 features), linear 512 -> 64 + ReLU, linear 64 -> 10: ~38 k
parameters, thousands of steps per minute on one CPU core.

scikit-learn is optional for qstate: `load()` says how to get it when it is missing.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

N_TRAIN = 1500


@lru_cache(maxsize=1)
def load(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train [N,1,8,8] fp32, y_train int64, x_val, y_val), split by a seeded shuffle."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        from ..errors import QstateError

        raise QstateError("the digits data set ships with scikit-learn, which is not installed: "
                          "pip install scikit-learn") from None
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):  # x: [B, 1, 8, 8] -> logits [B, 10]
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # [B, 32, 4, 4]
        return self.fc2(F.relu(self.fc1(x.flatten(1))))

    def loss(self, x, y) -> torch.Tensor:
        return F.cross_entropy(self(x), y)


def build(seed: int = 0) -> DigitsCNN:
    torch.manual_seed(seed)
    return DigitsCNN()


def batches(batch_size: int, seed: int = 0):
    """Endless seeded mini-batches of the training split (a new permutation per epoch)."""
    x, y, _, _ = load(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    while True:
        perm = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0] - batch_size + 1, batch_size):
            idx = perm[i:i + batch_size]
            yield x[idx], y[idx]


@torch.no_grad()
def accuracy(model: DigitsCNN, seed: int = 0) -> float:
    """Validation accuracy (fraction of the held-out digits classified right)."""
    _, _, xv, yv = load(seed)
    return float((model(xv).argmax(1) == yv).float().mean())
