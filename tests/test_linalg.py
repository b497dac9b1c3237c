"""attnsurg.linalg: the shared float64 helpers."""

import torch

from attnsurg.linalg import orthogonal_gaussian


def test_orthogonal_random_features_are_orthogonal_within_a_block_with_gaussian_norms():
    features = orthogonal_gaussian(40, 16, torch.Generator().manual_seed(0))
    assert features.shape == (40, 16) and features.dtype == torch.float64
    for block in (features[:16], features[16:32], features[32:]):
        directions = block / block.norm(dim=1, keepdim=True)
        assert torch.allclose(directions @ directions.T, torch.eye(len(block), dtype=torch.float64), atol=1e-10)
    many = orthogonal_gaussian(4096, 16, torch.Generator().manual_seed(1))
    assert abs(many.pow(2).sum(1).mean().item() / 16 - 1) < 0.05  # E|w|^2 = d, as for a Gaussian w
