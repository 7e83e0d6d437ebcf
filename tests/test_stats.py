"""Error bars of held-out accuracies: Wilson intervals against published values, the paired bootstrap's
behaviour on paired data with and without a real difference, and the accuracy rows that carry both."""

import random

import pytest

from tracefp4.components.stats import (
    accuracy_row,
    bootstrap_mean,
    paired_bootstrap,
    paired_difference,
    wilson_interval,
)


@pytest.mark.parametrize(
    "successes, n, low, high",
    [  # Wilson score intervals at 95% (z = 1.95996), e.g. Newcombe (1998), Table I; Brown, Cai, DasGupta (2001)
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
        (8, 16, 0.2800, 0.7200),
    ],
)
def test_wilson_matches_published_intervals(successes, n, low, high):
    got = wilson_interval(successes, n)
    assert got == pytest.approx((low, high), abs=6e-5)


def test_wilson_ends_are_exact_and_narrow_with_more_prompts():
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    small, large = wilson_interval(8, 16), wilson_interval(250, 500)
    assert large[1] - large[0] < (small[1] - small[0]) / 4  # 500 prompts: about 4.3x narrower than 16
    assert wilson_interval(8, 16, confidence=0.99)[0] < small[0]


@pytest.mark.parametrize("args", [(1, 0), (-1, 10), (11, 10), (5, 10, 1.0), (5, 10, 0.0)])
def test_wilson_rejects_bad_input(args):
    with pytest.raises(ValueError):
        wilson_interval(*args)


def _paired(n: int, p: float, flip: float, seed: int) -> tuple[list[float], list[float]]:
    """b is a with a share `flip` of the wrong answers turned right: b better by about (1 - p) * flip."""
    rng = random.Random(seed)
    a = [float(rng.random() < p) for _ in range(n)]
    b = [1.0 if x == 0 and rng.random() < flip else x for x in a]
    return a, b


def test_paired_bootstrap_separates_a_real_difference_that_separate_intervals_do_not():
    a, b = _paired(500, 0.4, 0.08, seed=1)
    diff, low, high = paired_bootstrap(b, a)
    assert diff == pytest.approx(sum(b) / 500 - sum(a) / 500)
    assert 0 < low < diff < high  # b is better, and the pairing shows it
    wa, wb = wilson_interval(sum(a), 500), wilson_interval(sum(b), 500)
    assert wb[0] < wa[1]  # while the two unpaired intervals overlap


def test_paired_bootstrap_of_identical_scores_is_zero_and_deterministic():
    a, _ = _paired(200, 0.5, 0.0, seed=2)
    assert paired_bootstrap(a, a) == (0.0, 0.0, 0.0)
    x, y = _paired(200, 0.5, 0.3, seed=3)
    assert paired_bootstrap(x, y, seed=7) == paired_bootstrap(x, y, seed=7)


def test_clustered_bootstrap_counts_runs_not_prompts():
    """Five runs of 200 prompts whose differences disagree from run to run: the
    prompt bootstrap sees 1,000 independent pairs and a tight interval around a
    positive mean; resampling the runs too gives the wide interval five runs
    support. One run of every pair: the same interval as prompts alone."""
    a, b, runs = [], [], []
    for run, flip in enumerate([0.3, 0.0, 0.25, 0.0, 0.2]):
        x, y = _paired(200, 0.4, flip, seed=10 + run)
        a, b, runs = a + y, b + x, runs + [run] * 200
    diff, low, high = paired_bootstrap(a, b)
    c_diff, c_low, c_high = paired_bootstrap(a, b, clusters=runs)
    assert c_diff == diff and 0 < low and c_low < low and high < c_high
    assert (c_high - c_low) > 2 * (high - low)
    assert paired_bootstrap(a, b, clusters=runs, seed=3) == paired_bootstrap(a, b, clusters=runs, seed=3)
    one = paired_bootstrap(a[:200], b[:200], resamples=2000, clusters=[0] * 200)
    assert one == pytest.approx(paired_bootstrap(a[:200], b[:200], resamples=2000), abs=0.01)
    with pytest.raises(ValueError, match="clusters name 3 values, there are 1000"):
        paired_bootstrap(a, b, clusters=[0, 1, 2])
    # one arm's mean, runs resampled too: the interval of the per-prompt values themselves
    mean, low, high = bootstrap_mean(a, clusters=runs)
    assert mean == pytest.approx(sum(a) / len(a)) and low < mean < high
    assert (mean, low, high) == bootstrap_mean(a, clusters=runs) and high - low > bootstrap_mean(a)[2] - bootstrap_mean(
        a
    )[1]


@pytest.mark.parametrize("a, b", [([], []), ([1.0], [1.0, 0.0]), ([[1.0]], [[1.0]])])
def test_paired_bootstrap_rejects_unpaired_input(a, b):
    with pytest.raises(ValueError, match="paired scores"):
        paired_bootstrap(a, b)


def test_accuracy_rows_pair_only_on_the_same_prompts():
    prompts = [f"{i}+{i}=" for i in range(50)]
    a, b = _paired(50, 0.5, 0.5, seed=4)
    row_a = accuracy_row("arithmetic", prompts, a, a, k=1)
    row_b = accuracy_row("arithmetic", prompts, b, b, k=1)
    assert row_a["pass@1"] == sum(a) / 50 and row_a["pass@1_ci95"] == list(wilson_interval(sum(a), 50))
    d = paired_difference(row_b, row_a)
    assert d["prompts"] == 50 and d["difference"] == pytest.approx((sum(b) - sum(a)) / 50) and d["ci95"][0] > 0
    other = accuracy_row("arithmetic", prompts[::-1], b, b, k=1)
    with pytest.raises(ValueError, match="different prompts"):
        paired_difference(other, row_a)
