"""Train-rollout alignment figures against hand-computed values, under our
names and under the names slime and verl users know."""

import math

import pytest
import torch

from tracefp4.components.rl import alignment_metrics, stack_rows


def test_figures_on_two_sequences():
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.0], [0.5, 0.5, 0.5]]).clamp_min(1e-30))
    train = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.25, 0.5, 0.5]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])  # the first row's last token is padding
    m = alignment_metrics(train, rollout, mask, tis_cap=1.5)
    # pi_train / pi_rollout on the five response tokens: [1, 2] and [0.5, 1, 1]
    ln2 = math.log(2)
    assert m["logprob_abs_diff_mean"] == pytest.approx(2 * ln2 / 5)  # ours: a mean over tokens
    assert m["logprob_abs_diff_max"] == pytest.approx(ln2) and m["logprob_abs_diff_min"] == 0
    # slime: per sequence first, ln2 / 2 and ln2 / 3, then over the two sequences
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx((ln2 / 2 + ln2 / 3) / 2)
    # k3: w - 1 - ln w is 0, 1 - ln2, -0.5 + ln2, 0, 0: a sum of 0.5 over 5 tokens
    assert m["k3_kl"] == pytest.approx(0.1)
    assert m["chi2_token"] == pytest.approx((1 + 4 + 0.25 + 1 + 1) / 5 - 1)  # E[w^2] - 1 = 0.45
    # the weights truncated at 1.5 are [1, 1.5, 0.5, 1, 1]: mean 1, E[w^2] 1.1, ESS 1 / 1.1
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 1.1)
    # the truncation changes one token of the first sequence's two, none of the second's: (1/2 + 0) / 2
    assert m["tis_clipfrac"] == pytest.approx(0.25)
    # log-perplexity per sequence: row 0 train -ln2 vs rollout -1.5 ln2; row 1 train -4 ln2 / 3 vs rollout -ln2
    assert m["log_ppl_abs_diff"] == pytest.approx((ln2 / 2 + ln2 / 3) / 2)
    # a cap above every weight truncates nothing: ESS of the raw weights, mean 1.1 and E[w^2] 1.45
    m = alignment_metrics(train, rollout, mask, tis_cap=3.0)
    assert m["tis_clipfrac"] == 0 and m["rollout_is_eff_sample_size"] == pytest.approx(1.1**2 / 1.45)


def test_log_ppl_differs_from_the_mean_abs_diff():
    """Within a sequence, diffs of both signs cancel in the log-perplexity, not in |diff|."""
    rollout = torch.log(torch.tensor([[0.5, 0.5]]))
    train = torch.log(torch.tensor([[0.25, 1.0]]))  # ln-ratios -ln2 and +ln2
    m = alignment_metrics(train, rollout, torch.ones(1, 2, dtype=torch.bool))
    assert m["log_ppl_abs_diff"] == pytest.approx(0, abs=1e-7)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(math.log(2))


def test_identical_paths_are_perfectly_aligned():
    lp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    m = alignment_metrics(lp, lp.clone(), torch.ones(3, 4, dtype=torch.bool))
    assert m["logprob_abs_diff_max"] == m["k3_kl"] == m["chi2_token"] == m["log_ppl_abs_diff"] == 0
    assert m["train_rollout_logprob_abs_diff"] == m["tis_clipfrac"] == 0
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_stack_rows_pads_microbatches_of_other_lengths():
    out = stack_rows([torch.ones(2, 3), torch.full((1, 5), 2.0)])
    assert out.shape == (3, 5) and out[:2, 3:].eq(0).all() and out[2].eq(2).all()


def test_k3_of_a_rollout_that_matches_training_to_a_few_ulps_is_its_small_positive_value():
    """Each token's exp(lr) - 1 - lr is >= 0 (lr^2 / 2 near 0); in float32 it cancelled to noise of either
    sign, 1e-7 where the value is 1e-9 (a report showed a k3 KL of -5e-10)."""
    rollout = torch.log(torch.rand(4, 64, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05)
    train = rollout + torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 1e-4
    lr = (train - rollout).double()  # the float32 difference, exactly
    m = alignment_metrics(train, rollout, torch.ones(4, 64, dtype=torch.bool))
    assert m["k3_kl"] > 0 and m["k3_kl"] == pytest.approx((lr**2 / 2).mean().item(), rel=1e-3)
