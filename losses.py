"""Distillation loss of DeiT (the reference imports `losses.py` but does not ship it)."""
import torch
from torch.nn import functional as F


class DistillationLoss(torch.nn.Module):
    """Wraps the base criterion; with a teacher adds a soft (KL, temperature tau) or hard (teacher argmax)
    distillation term on the distillation token output, weighted by alpha."""

    def __init__(self, base_criterion: torch.nn.Module, teacher_model, distillation_type: str,
                 alpha: float, tau: float):
        super().__init__()
        assert distillation_type in ('none', 'soft', 'hard')
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            # a model with a distillation token returns (class_token_out, dist_token_out)
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == 'none':
            return base_loss
        if outputs_kd is None:
            outputs_kd = outputs  # models without a distillation token distil through the class output
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        if self.distillation_type == 'soft':
            T = self.tau
            # sum over classes, mean over the batch, scaled by T^2 (as in DeiT)
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1), F.log_softmax(teacher_outputs / T, dim=1),
                reduction='sum', log_target=True) * (T * T) / outputs_kd.numel()
        else:
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha
