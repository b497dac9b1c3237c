import torch

from attnsurg.methods.consumers import distance_offsets, rotation_average


def test_rotation_average_matches_brute_force():
    torch.manual_seed(0)
    d = 8
    A = torch.randn(d, d, dtype=torch.float64)
    Q = A @ A.T
    inv_freq = 1.0 / (100 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    offsets, weights = distance_offsets(16)
    expected = torch.zeros(d, d, dtype=torch.float64)
    for o, w in zip(-offsets, weights):
        c, s = torch.cos(o * inv_freq).repeat(2), torch.sin(o * inv_freq).repeat(2)
        J = torch.zeros(d, d, dtype=torch.float64)
        J[: d // 2, d // 2 :], J[d // 2 :, : d // 2] = -torch.eye(d // 2), torch.eye(d // 2)
        R = torch.diag(c) + torch.diag(s) @ J
        expected += w * R.T @ Q @ R
    expected /= weights.sum()
    assert torch.allclose(rotation_average(Q, inv_freq, -offsets, weights), expected, atol=1e-12)
