"""Training precision (``train.precision``): the dtype the trainer's parameters
and forward compute in, and the float32 weights its optimizer steps.

- ``bf16``: bf16 parameters, and a forward in bf16 throughout (residual
  stream, norms, RoPE, attention), as the rollout engine's bf16 policy
  computes; the optimizer steps a float32 master copy of every parameter
  (AdamW's moments in float32 too), gradients are accumulated over
  microbatches in float32 on the master, and after each step the parameters
  are the master rounded to bf16. This is how Megatron's bf16 training with
  its distributed optimizer (fp32 main params and main grads) and FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bfloat16)`` over fp32 sharded
  parameters run.
- ``fp32_master``: float32 parameters are themselves the master weights; the
  forward runs under bf16 autocast, which rounds matmul inputs to bf16 but
  keeps the residual stream, norms and RoPE in float32: numerics no bf16
  rollout engine has, so more FP4 codes flip between training and rollout
  (docs/results.md).

Either way the policy is saved in :attr:`MasterWeights.policy_dtype`: bf16
for ``bf16``, the rollout's dtype for ``fp32_master`` (``model.dtype``: a
bf16 model trained in float32, or built or bootstrapped in float32, is still
a bf16 policy, half the bytes every rollout and evaluation step downloads). The master
weights the saved policy does not hold exactly are trainer state:
:meth:`MasterWeights.state` gives them, to save beside the optimizer's
moments, and :meth:`MasterWeights.load` takes them back.
"""

import logging
from collections.abc import Iterable

import torch
from torch import Tensor

from .choices import PRECISIONS
from .model import Transformer

log = logging.getLogger(__name__)


def policy_dtype(precision: str, rollout_dtype: torch.dtype) -> torch.dtype:
    """The dtype a trainer of ``precision`` saves the policy in (the module's
    docstring says why), whatever dtype the model was built or loaded in."""
    return torch.bfloat16 if precision == "bf16" else rollout_dtype


def saves_masters(policy: torch.dtype) -> bool:
    """Whether a trainer state beside a stepped policy saved in ``policy`` holds
    float32 master weights: a float32 policy is its own master."""
    return policy != torch.float32


class MasterWeights:
    """A model's parameters in the precision's dtype (converted in place) and
    the float32 tensors its optimizer steps, by parameter name."""

    def __init__(self, model: Transformer, precision: str, rollout_dtype: torch.dtype):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown training precision {precision!r}; expected one of {PRECISIONS}")
        self.precision = precision
        self.params = dict(model.named_parameters())  # a tied weight once
        given = next(iter(self.params.values())).dtype
        # what a save writes the policy in, whatever the dtype the model was built, bootstrapped or converted in
        self.policy_dtype = policy_dtype(precision, rollout_dtype)
        # a master made from bf16 parameters lacks the bits below bf16 that a saved master would have
        self.from_bf16 = precision == "bf16" and any(p.dtype == torch.bfloat16 for p in self.params.values())
        # whether the master holds bits the policy saved in policy_dtype does not: made from wider parameters
        # (or rewrapped from converted ones), loaded, or stepped
        self.beyond_policy = given != self.policy_dtype
        if precision == "bf16":  # the master from the model as given: a float32 model loses nothing
            self.master = {name: p.detach().float().clone() for name, p in self.params.items()}
            model.to(torch.bfloat16)
        else:
            model.float()
            self.master = self.params

    def tensors(self) -> list[Tensor]:
        """What the optimizer steps, in parameter order."""
        return list(self.master.values())

    def accumulate(self) -> None:
        """Move the parameters' bf16 gradients of a backward into the master's float32 gradients."""
        if self.master is self.params:
            return
        for name, p in self.params.items():
            if p.grad is None:
                continue
            m = self.master[name]
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def sync(self) -> None:
        """The parameters after an optimizer step: the master rounded to their dtype."""
        self.beyond_policy = True
        if self.master is not self.params:
            for name, p in self.params.items():
                p.copy_(self.master[name])

    def state(self) -> dict[str, Tensor]:
        """The float32 master weights where the policy saved in :attr:`policy_dtype`
        does not hold them exactly: none when it is float32, nor while they are
        the parameters given in that dtype, never stepped (a fresh policy's
        state: 139 GB less at Qwen3.5-35B-A3B, which :meth:`load` rebuilds
        from the policy without loss)."""
        return self.master if self.beyond_policy and saves_masters(self.policy_dtype) else {}

    def check(self, saved: Iterable[str]) -> None:
        """Refuse saved master weights (by name) that are not this model's, all of them."""
        missing = sorted(set(self.master) - set(saved))
        unexpected = sorted(set(saved) - set(self.master))
        if missing or unexpected:
            raise KeyError(
                f"saved master weights do not match the model: missing {missing[:5]}, extra {unexpected[:5]}"
            )

    @torch.no_grad()
    def load(self, saved: dict[str, Tensor], stepped: bool) -> None:
        """Take back saved master weights (all or none). Without them, a ``bf16``
        trainer keeps the master it made from the policy it was given: exact for
        a policy never ``stepped`` by an optimizer (:meth:`state` saves none),
        while a trained bf16 policy has lost the master's bits below bf16."""
        if not saved:
            if self.from_bf16 and stepped:
                log.warning("no float32 master weights saved: the master starts from the bf16 policy")
            return
        self.beyond_policy = True
        self.check(saved)
        for name, m in self.master.items():
            m.copy_(saved[name])
        self.sync()
