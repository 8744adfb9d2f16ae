"""losses.py: the DeiT distillation loss, soft and hard."""
import torch

from losses import DistillationLoss


def test_distillation_loss_soft_and_hard():
    torch.manual_seed(0)
    teacher = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    out = torch.randn(5, 3)
    base = torch.nn.CrossEntropyLoss()
    assert DistillationLoss(base, None, 'none', 0.5, 1.0)(x, out, y) == base(out, y)
    hard = DistillationLoss(base, teacher, 'hard', 0.5, 1.0)(x, out, y)
    want = 0.5 * base(out, y) + 0.5 * torch.nn.functional.cross_entropy(out, teacher(x).argmax(1))
    assert torch.allclose(hard, want)
    soft = DistillationLoss(base, teacher, 'soft', 1.0, 2.0)(x, (out, out), y)
    p_t = torch.softmax(teacher(x) / 2, 1)
    kl = (p_t * (p_t.log() - torch.log_softmax(out / 2, 1))).sum() * 4 / out.numel()
    assert torch.allclose(soft, kl, atol=1e-6)
