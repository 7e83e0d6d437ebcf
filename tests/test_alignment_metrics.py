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
    m = alignment_metrics(train, rollout, mask)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0])  # pi_train / pi_rollout on the five response tokens
    assert m["logprob_abs_diff_mean"] == m["train_rollout_logprob_abs_diff"] == pytest.approx(2 * math.log(2) / 5)
    assert m["logprob_abs_diff_max"] == pytest.approx(math.log(2)) and m["logprob_abs_diff_min"] == 0
    assert m["k3_kl"] == pytest.approx(float((w - 1 - w.log()).mean()))
    assert m["chi2_token"] == pytest.approx(float(w.pow(2).mean() - 1))
    assert m["rollout_is_eff_sample_size"] == pytest.approx(float(w.sum() ** 2 / (5 * w.pow(2).sum())))
    # log-perplexity per sequence: row 0 train -(log .5 + log .5)/2 vs rollout -(log .5 + log .25)/2; row 1 likewise
    ppl = [
        abs(math.log(0.5) - (math.log(0.5) + math.log(0.25)) / 2),
        abs((math.log(0.25) + 2 * math.log(0.5)) / 3 - math.log(0.5)),
    ]
    assert m["log_ppl_abs_diff"] == pytest.approx(sum(ppl) / 2)


def test_identical_paths_are_perfectly_aligned():
    lp = torch.log(torch.rand(3, 4) * 0.9 + 0.05)
    m = alignment_metrics(lp, lp.clone(), torch.ones(3, 4, dtype=torch.bool))
    assert m["logprob_abs_diff_max"] == m["k3_kl"] == m["chi2_token"] == m["log_ppl_abs_diff"] == 0
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.0)


def test_stack_rows_pads_microbatches_of_other_lengths():
    out = stack_rows([torch.ones(2, 3), torch.full((1, 5), 2.0)])
    assert out.shape == (3, 5) and out[:2, 3:].eq(0).all() and out[2].eq(2).all()
