"""A seeded forward pass through a transformer, to compare a model with and without offload."""

from __future__ import annotations

import torch
from torch import nn


def forward_inputs(model: nn.Module, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    config = model.config
    return dict(
        hidden_states=torch.randn(1, config.in_channels, 3, 8, 8, generator=generator),
        timestep=torch.tensor([600]),
        encoder_hidden_states=torch.randn(1, 10, config.text_dim, generator=generator),
        return_dict=False,
    )


@torch.no_grad()
def run(model: nn.Module, seed: int = 0) -> torch.Tensor:
    return model(**forward_inputs(model, seed))[0]
