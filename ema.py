"""The exponential moving average of the weights a run trains (--model-ema): timm's ModelEmaV3 with a cheaper
update, and the decay a run uses at its global batch."""
from typing import Any

import torch
from timm.utils import ModelEmaV3


def ema_decay(decay_at_512: float, global_batch: int) -> float:
    """The EMA decay per optimizer step of a run at `global_batch` images per step: --model-ema-decay, given
    for a global batch of 512, to the power global batch / 512, so that the EMA averages over the same number
    of images whatever the batch."""
    return decay_at_512 ** (global_batch / 512.0)


class ModelEma(ModelEmaV3):
    """timm's ModelEmaV3 (the EMA of parameters and buffers, on the model's device or `device`) whose update
    walks the modules' own tensor dicts instead of building two state dicts per step, which costs the host
    several milliseconds a step. The same tensors in the same order as the state dicts (each module's
    parameters, then its persistent buffers), the same foreach lerp: the same numbers. The module lists are
    gathered once per model; the tensors are looked up at every update, so moving a model (`.to()` replaces
    its buffers) is fine. Off the multi-tensor path (an EMA on another device than the model) timm's own
    update runs."""

    def __init__(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        super().__init__(model, *args, **kwargs)
        self._ema_modules = list(self.module.modules())
        self._model_modules: tuple = (None, [])  # (the model, its modules), for the model last updated from

    @staticmethod
    def _state_tensors(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
        """The tensors of the modules' state dict, in its order (module attributes: state_dict() would spend
        milliseconds on names, hooks and detached copies)."""
        tensors = []
        for m in modules:
            tensors += [p for p in m._parameters.values() if p is not None]
            tensors += [b for k, b in m._buffers.items() if b is not None and k not in m._non_persistent_buffers_set]
        return tensors

    def apply_update_(self, model: torch.nn.Module, decay: float) -> None:
        if not self.foreach:
            super().apply_update_(model, decay)
            return
        if self._model_modules[0] is not model:
            self._model_modules = (model, list(model.modules()))
        ema_values = self._state_tensors(self._ema_modules)
        model_values = self._state_tensors(self._model_modules[1])
        lerp_ema, lerp_model = [], []
        for ema_v, model_v in zip(ema_values, model_values):
            if ema_v.is_floating_point():
                lerp_ema.append(ema_v)
                lerp_model.append(model_v)
            else:
                ema_v.copy_(model_v)
        self._foreach_lerp_(lerp_ema, lerp_model, weight=1. - decay)
