"""RL on rollouts: batches of trajectories as the training path sees them,
per-token log-probabilities, train-rollout alignment metrics, and the GRPO
policy loss with truncated importance sampling on the rollout's logprobs."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .model import CausalAttention, Sites, Transformer, right_pad
from .rollout import Trajectory


@dataclass
class SequenceBatch:
    """Trajectories right-padded into ``tokens [B, S]``. Column t of the
    ``[B, S-1]`` tensors is the prediction of token t+1; ``response`` marks the
    sampled tokens, whose rollout logprobs are in ``rollout_logprobs``."""

    trajectories: list[int]
    tokens: Tensor
    positions: Tensor
    lengths: Tensor
    response: Tensor
    rollout_logprobs: Tensor
    topk_ids: Tensor | None = None  # [B, S-1, K]: the sampler's top-k tokens, when recorded
    topk_logprobs: Tensor | None = None

    @classmethod
    def of(cls, trajectories: list[Trajectory], device="cpu") -> "SequenceBatch":
        tokens, positions, lengths = right_pad([t.tokens for t in trajectories])
        b, s = tokens.shape
        response = torch.zeros(b, s - 1, dtype=torch.bool)
        rollout = torch.zeros(b, s - 1)
        k = len(trajectories[0].topk_ids[0]) if trajectories[0].topk_ids else 0
        topk_ids = torch.zeros(b, s - 1, k, dtype=torch.long)
        topk_lp = torch.zeros(b, s - 1, k)
        for i, t in enumerate(trajectories):
            span = slice(len(t.prompt) - 1, len(t.tokens) - 1)
            response[i, span] = True
            rollout[i, span] = torch.tensor(t.logprobs)
            if k:
                topk_ids[i, span], topk_lp[i, span] = torch.tensor(t.topk_ids), torch.tensor(t.topk_logprobs)
        tensors = [tokens, positions, lengths, response, rollout] + ([topk_ids, topk_lp] if k else [])
        return cls([t.id for t in trajectories], *(x.to(device) for x in tensors))


def token_logprobs(
    model: Transformer, batch: SequenceBatch, sites: Sites | None = None, temperature: float = 1.0, full: bool = False
):
    """``[B, S-1]`` log-probabilities of each next token under the training path
    (with ``full``, also the whole ``[B, S-1, V]`` log-softmax)."""
    logits = model(batch.tokens, batch.positions, CausalAttention(batch.lengths), sites)[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    every = F.log_softmax(logits, -1)
    picked = every.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    return (picked, every) if full else picked


def alignment_metrics(train: Tensor, rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """Train-rollout mismatch over the response tokens (``mask``) of ``[B, T]``
    log-probs, one sequence per row: ours (|logprob diff| mean, max, min; the
    k3 KL; the probability diff) and the same figures under the names users of
    slime and verl know (``train_rollout_logprob_abs_diff``, ``k3_kl``,
    ``log_ppl_abs_diff``, ``chi2_token``, ``rollout_is_eff_sample_size``)."""
    t, r = train.detach()[mask], rollout[mask]
    diff = (t - r).abs()
    log_ratio = (t - r).clamp(-10, 10)
    k3 = (log_ratio.exp() - 1 - log_ratio).mean()  # KL(rollout || train), k3 estimator
    prob = (t.exp() - r.exp()).abs()
    weights = log_ratio.exp()  # per-token importance weight pi_train / pi_rollout
    tokens = mask.sum(1).clamp_min(1)
    log_ppl = lambda lp: -(lp.detach() * mask).sum(1) / tokens  # noqa: E731 - per sequence
    rows = mask.any(1)
    return {
        "logprob_abs_diff_mean": diff.mean().item(),
        "logprob_abs_diff_max": diff.max().item(),
        "logprob_abs_diff_min": diff.min().item(),
        "k3_kl": k3.item(),
        "probs_diff_mean": prob.mean().item(),
        "probs_diff_max": prob.max().item(),
        "train_rollout_logprob_abs_diff": diff.mean().item(),  # slime's name for the mean
        "log_ppl_abs_diff": (log_ppl(train) - log_ppl(rollout)).abs()[rows].mean().item(),  # verl, per sequence
        "chi2_token": (weights.pow(2).mean() - 1).item(),  # verl: E[w^2] - 1
        "rollout_is_eff_sample_size": (weights.sum().pow(2) / (weights.numel() * weights.pow(2).sum())).item(),
    }


def stack_rows(parts: list[Tensor]) -> Tensor:
    """``[B_i, T_i]`` tensors (microbatches of other lengths) right-padded with zeros to one ``[sum B_i, max T_i]``."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([F.pad(p, (0, width - p.shape[1])) for p in parts])


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO: each reward normalized within its group of responses to one prompt."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True, unbiased=False) + eps)).view(-1)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip: float = 0.2,
    tis_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped GRPO loss with truncated importance sampling: each token is
    weighted by ``min(pi_old / pi_rollout, tis_cap)``, correcting for the
    rollout policy (FP4) not being the training policy. Token-mean over ``mask``."""
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages[:, None].expand_as(logprobs)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    tis = (old_logprobs - rollout_logprobs).exp().clamp(max=tis_cap).detach()
    loss = -(tis * surrogate)[mask].mean()
    return loss, {
        "clip_fraction": ((ratio - 1).abs() > clip)[mask].float().mean().item(),
        "tis_weight_mean": tis[mask].mean().item(),
        "tis_truncated_fraction": (tis[mask] >= tis_cap).float().mean().item(),  # slime: tis_clipfrac
    }


def score_centering(every_logprobs: Tensor, batch: SequenceBatch, tis_cap: float) -> Tensor:
    """Score centering (arXiv 2609.20807) with truncated IS, per token ``[B, S-1]``:
    ``C = sum over the sampler's top-k v of stopgrad(m(v) - a p(v)) log p(v)``,
    ``m = clamp(p, 0, cap q)``, ``a = clamp(1, 0, cap rho)``, tail
    ``rho = (1 - sum q) / max(1 - sum p, 1e-6)``; ``p`` the training policy, ``q`` the sampler."""
    if batch.topk_ids is None:
        raise ValueError("score centering needs the sampler's top-k tokens: sample with record_topk > 0")
    log_p = every_logprobs.gather(-1, batch.topk_ids)
    p, q = log_p.exp(), batch.topk_logprobs.exp()
    with torch.no_grad():
        rho = (1 - q.sum(-1)) / (1 - p.sum(-1)).clamp_min(1e-6)
        m = torch.minimum(p, tis_cap * q)
        a = torch.clamp(torch.ones_like(rho), max=tis_cap * rho)
        centered = m - a[..., None] * p
    return (centered * log_p).sum(-1)
