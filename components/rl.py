"""RL on rollouts: batches of trajectories as the training path sees them,
per-token log-probabilities, train-rollout alignment metrics, and the GRPO
policy loss with truncated importance sampling on the rollout's logprobs."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .model import CausalAttention, Sites, Transformer, right_pad
from .rollout import Trajectory


@dataclass
class SequenceBatch:
    """Trajectories right-padded into ``tokens [B, S]``. Column t of the
    ``[B, S-1]`` tensors is the prediction of token t+1; ``response`` marks the
    sampled tokens, whose rollout logprobs are in ``rollout_logprobs``.
    ``response_index`` holds their (row, column) indices, found on the host:
    ``t[response_index]`` is ``t[response]`` without the device read a boolean
    mask costs (its count of selected tokens: a host sync on CUDA)."""

    trajectories: list[int]
    tokens: Tensor
    positions: Tensor
    lengths: Tensor
    response: Tensor
    rollout_logprobs: Tensor
    response_index: tuple[Tensor, Tensor]
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
        index = tuple(i.to(device) for i in response.nonzero(as_tuple=True))
        topk = {"topk_ids": topk_ids.to(device), "topk_logprobs": topk_lp.to(device)} if k else {}
        tensors = (x.to(device) for x in (tokens, positions, lengths, response, rollout))
        return cls([t.id for t in trajectories], *tensors, response_index=index, **topk)


# Positions whose logits a training forward holds at once. At Qwen3.5-35B-A3B's 248,320-token vocabulary one
# 32K-token trajectory's logits take 33 GB in float32, and their log-softmax as much again
LOGITS_CHUNK = 1024


def token_logprobs(
    model: Transformer, batch: SequenceBatch, sites: Sites | None = None, temperature: float = 1.0, topk: bool = False
):
    """``[B, S-1]`` log-probabilities of each next token under the training path
    (with ``topk``, also ``[B, S-1, K]`` those of the sampler's top-k tokens
    ``batch.topk_ids``, which score centering weighs); ``batch`` is a
    :class:`SequenceBatch`, or any with its tokens, positions and lengths
    (bootstrap's SFT batches). The logits exist
    :data:`LOGITS_CHUNK` positions at a time: each chunk's log-probabilities
    are checkpointed, its logits computed again in the backward."""
    if topk and batch.topk_ids is None:
        raise ValueError("score centering needs the sampler's top-k tokens: sample with record_topk > 0")
    topk_ids = batch.topk_ids if topk else None

    def head(hidden: Tensor, lm_head: nn.Module) -> tuple[Tensor, Tensor | None]:
        hidden = hidden[:, :-1]  # the last position predicts nothing here
        chunks = [
            checkpoint(
                _chunk_logprobs,
                hidden[:, start : start + LOGITS_CHUNK],
                lm_head,
                batch.tokens[:, start + 1 : start + 1 + LOGITS_CHUNK],
                None if topk_ids is None else topk_ids[:, start : start + LOGITS_CHUNK],
                temperature,
                use_reentrant=False,
            )
            for start in range(0, max(hidden.shape[1], 1), LOGITS_CHUNK)  # one-token rows: one empty chunk
        ]
        picked = torch.cat([chunk[0] for chunk in chunks], 1)
        return picked, None if topk_ids is None else torch.cat([chunk[1] for chunk in chunks], 1)

    picked, at_topk = model(batch.tokens, batch.positions, CausalAttention(), sites, head=head)
    return (picked, at_topk) if topk else picked


def _chunk_logprobs(
    hidden: Tensor, lm_head: nn.Module, targets: Tensor, topk_ids: Tensor | None, temperature: float
) -> tuple[Tensor, Tensor | None]:
    """The log-probabilities of ``targets [B, C]`` (and of ``topk_ids [B, C, K]``)
    after ``hidden [B, C, hidden]``, at ``temperature`` (0: none)."""
    logits = lm_head(hidden).float()
    if temperature > 0:
        logits = logits / temperature
    every = F.log_softmax(logits, -1)
    picked = every.gather(-1, targets[..., None])[..., 0]
    return picked, None if topk_ids is None else every.gather(-1, topk_ids)


SAFETY_BOUND = 20.0  # verl's clamp of a log importance ratio before exp (rollout_corr_helper.py)


def alignment_metrics(train: Tensor, rollout: Tensor, mask: Tensor, tis_cap: float = 2.0) -> dict[str, float]:
    """Train-rollout mismatch over the response tokens (``mask``) of ``[B, T]``
    log-probs, one sequence per row: ours (|logprob diff| per token: mean, max,
    min; the probability diff) and the figures users of slime and verl know,
    each as its upstream code computes it (the file named beside it), with
    ``tis_cap`` the truncation of the importance weights ``pi_train / pi_rollout``
    as :func:`grpo_loss` applies it."""
    train = train.detach()
    t, r = train[mask], rollout[mask]
    diff = (t - r).abs()
    every_ratio = (train - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # log pi_train / pi_rollout, [B, T]
    log_ratio = every_ratio[mask]
    weights = log_ratio.exp()
    truncated = weights.clamp(max=tis_cap)
    prob = (t.exp() - r.exp()).abs()
    rows = mask.any(1)  # sequences with response tokens (all of them in a step's batch)
    tokens = mask.sum(1)[rows]

    def per_sequence(values: Tensor) -> Tensor:
        """Each sequence's mean of per-token ``values`` (``[B, T]``) over its response tokens."""
        return (values * mask)[rows].sum(1) / tokens

    return {
        "logprob_abs_diff_mean": diff.mean().item(),
        "logprob_abs_diff_max": diff.max().item(),
        "logprob_abs_diff_min": diff.min().item(),
        "probs_diff_mean": prob.mean().item(),
        "probs_diff_max": prob.max().item(),
        # slime (THUDM/slime) slime/backends/megatron_utils/loss.py policy_loss_function:
        # sum_of_sample_mean(|old - rollout|), a mean per sample, then over the samples (its default, without
        # --calculate-per-token-loss)
        "train_rollout_logprob_abs_diff": per_sequence((train - rollout).abs()).mean().item(),
        # verl (volcengine/verl) verl/trainer/ppo/rollout_corr_helper.py compute_offpolicy_metrics:
        # KL(rollout || train) by the k3 estimator, token mean of exp(lr) - lr - 1 with lr = log pi_train -
        # log pi_rollout (clamped to +-SAFETY_BOUND here, as verl clamps it for chi2 and the IS weights: the
        # same unless a ratio passes e^20); in float64, a figure of paths that agree to a few ulps
        "k3_kl": k3_terms(log_ratio.double()).mean().item(),
        # verl, same function: |mean log-prob of the rollout - of training| per sequence, mean over sequences
        "log_ppl_abs_diff": (per_sequence(rollout) - per_sequence(train)).abs().mean().item(),
        # verl, same function: chi^2(train || rollout) per token, E[rho^2] - 1 with rho clamped as above
        "chi2_token": (weights.pow(2).mean() - 1).item(),
        # verl, same file, compute_is_metrics (token level): ESS of the truncated weights over their count,
        # 1 / E[(w / E[w])^2], 1 when every weight is equal
        "rollout_is_eff_sample_size": (1 / (truncated / (truncated.mean() + 1e-8)).pow(2).mean()).item(),
        # slime, slime/backends/megatron_utils/loss.py vanilla_tis_function: the tokens whose weight the
        # truncation changed, a mean per sample, then over the samples (no lower clip here: tis_clip_low 0)
        "tis_clipfrac": per_sequence((every_ratio.exp() > tis_cap).float()).mean().item(),
    }


def k3_terms(log_ratio: Tensor) -> Tensor:
    """Each token's term of the k3 estimate of a KL, ``exp(lr) - 1 - lr`` (>= 0;
    ``lr`` the log-ratio), computed as ``expm1(lr) - lr``: written as it reads,
    it cancels to noise of either sign where ``lr`` is tiny (a report of a run
    whose rollout matched training to 1e-8 showed a k3 KL of -5e-10)."""
    return torch.expm1(log_ratio) - log_ratio


def stack_rows(parts: list[Tensor]) -> Tensor:
    """``[B_i, T_i]`` tensors (microbatches of other lengths) right-padded with zeros to one ``[sum B_i, max T_i]``."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([F.pad(p, (0, width - p.shape[1])) for p in parts])


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO: each reward normalized within its group of responses to one
    prompt, by the group's sample standard deviation, as verl
    (``compute_grpo_outcome_advantage``), slime and TRL divide: advantages of
    the scale their users tune learning rates and KL coefficients for."""
    if group_size < 2:  # one response has no sample standard deviation (NaN), nor anything to compare with
        raise ValueError(f"GRPO compares a prompt's responses: groups of at least 2, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(1, keepdim=True)
    # a group of equal rewards has nothing to compare: exactly 0. Its float32 mean can sit an ulp off the rewards
    # (eight rewards of 0.9), and over a std of about an ulp plus eps that ulp gave every response of the group
    # the same advantage of -0.06, pushing all of them down
    equal = (groups == groups[:, :1]).all(1, keepdim=True)
    return torch.where(equal, 0.0, centered / (groups.std(1, keepdim=True) + eps)).view(-1)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor | tuple[Tensor, Tensor],
    *,
    clip: float = 0.2,
    tis_cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clipped GRPO loss with truncated importance sampling: each token is
    weighted by ``min(pi_old / pi_rollout, tis_cap)``, correcting for the
    rollout policy (FP4) not being the training policy. Token-mean over
    ``mask``: a boolean ``[B, T]`` mask, or its indices
    (:attr:`SequenceBatch.response_index`, which read nothing from the device).
    The figures are detached 0-dim tensors, for the caller to read when it syncs.
    Only the tokens of ``mask`` are computed: a prompt or padding position whose
    ratio overflowed to inf, left out of the mean, still sent a NaN (0 * inf)
    back through ``exp`` into every weight."""
    adv = advantages[:, None].expand_as(logprobs)[mask]
    logprobs, old_logprobs, rollout_logprobs = (t[mask] for t in (logprobs, old_logprobs, rollout_logprobs))
    ratio = (logprobs - old_logprobs).exp()
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    tis = (old_logprobs - rollout_logprobs).exp().clamp(max=tis_cap).detach()
    loss = -(tis * surrogate).mean()
    return loss, {
        # the tokens whose clipped term was taken (no gradient), as verl's pg_clipfrac counts them: a ratio past
        # the band on the side the advantage does not push towards keeps its gradient
        "clip_fraction": (surrogate < ratio * adv).float().mean(),
        "tis_weight_mean": tis.mean(),
    }


def score_centering(log_p: Tensor, batch: SequenceBatch, tis_cap: float) -> Tensor:
    """Score centering (arXiv 2609.20807) with truncated IS, per token ``[B, S-1]``:
    ``C = sum over the sampler's top-k v of stopgrad(m(v) - a p(v)) log p(v)``,
    ``m = clamp(p, 0, cap q)``, ``a = clamp(1, 0, cap rho)``, tail
    ``rho = (1 - sum q) / max(1 - sum p, 1e-6)``; ``p`` the training policy
    (``log_p [B, S-1, K]`` at the sampler's top-k: ``token_logprobs(..., topk=True)``), ``q`` the sampler."""
    p, q = log_p.exp(), batch.topk_logprobs.exp()
    with torch.no_grad():
        # a tail's mass is never negative: a peaked sampler's top-k can sum a rounding above 1
        rho = (1 - q.sum(-1)).clamp_min(0) / (1 - p.sum(-1)).clamp_min(1e-6)
        m = torch.minimum(p, tis_cap * q)
        a = torch.clamp(torch.ones_like(rho), max=tis_cap * rho)
        centered = m - a[..., None] * p
    return (centered * log_p).sum(-1)
