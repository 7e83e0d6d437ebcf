"""Error bars for accuracies measured on a finite set of held-out prompts.

A pass@1 of 0.40 on 16 prompts and one on 500 prompts are not the same claim:
the first is compatible with anything from about 0.2 to 0.64. The evaluation
reports each pass@1 with its Wilson score interval (well behaved near 0 and 1
and for small n, unlike the normal approximation), and a difference between
two methods with a paired bootstrap interval over the prompts both answered:
pairing removes the prompt-difficulty variance the two share, so a real
difference shows up with far fewer prompts than two separate intervals need.
"""

import hashlib
import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, not {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a success rate ``successes / n`` (Wilson 1927).
    ``successes`` may be fractional (a mean of 0/1 outcomes times n)."""
    if n <= 0:
        raise ValueError(f"a success rate needs at least one trial, not n={n}")
    if not 0.0 <= successes <= n:
        raise ValueError(f"successes {successes} outside 0..{n}")
    z = _z(confidence)
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact ends: no rounding residue at 0 and 1
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
    clusters: Sequence | None = None,
) -> tuple[float, float, float]:
    """mean(a) - mean(b) over paired per-prompt scores, with the percentile
    bootstrap interval of :func:`bootstrap_mean` over the pairs' differences:
    each prompt keeps its pair."""
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size == 0:
        raise ValueError(f"paired scores need two equal, non-empty 1-D sequences, not {x.shape} and {y.shape}")
    return bootstrap_mean(x - y, confidence, resamples, seed, clusters)


def bootstrap_mean(
    values: Sequence[float],
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
    clusters: Sequence | None = None,
) -> tuple[float, float, float]:
    """The mean of per-prompt ``values`` with its percentile bootstrap interval:
    prompts are resampled with replacement. With ``clusters`` (each value's run,
    say its seed), runs are resampled first and then prompts within each (a
    two-stage bootstrap): two RL runs differ by more than their prompts do, and
    resampling prompts alone would count every prompt of one run as independent
    evidence. Resampling both stages counts the variance within a run twice
    (Davison and Hinkley 1997, section 3.8), which widens the interval; but the
    spread between runs is read off those few runs, so where runs differ by
    much more than their prompts' error the interval can cover less than its
    level. Deterministic for a seed."""
    d = np.asarray(values, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"the values need a non-empty 1-D sequence, not shape {d.shape}")
    if resamples < 1:
        raise ValueError(f"resamples must be positive, not {resamples}")
    if clusters is not None and len(clusters) != d.size:
        raise ValueError(f"clusters name {len(clusters)} values, there are {d.size}")
    _z(confidence)  # checks the level
    rng = np.random.default_rng(seed)
    if clusters is None:
        means = _resampled_sums(d, resamples, rng) / d.size
    else:
        labels = np.asarray([str(c) for c in clusters])
        groups = [d[labels == c] for c in sorted(set(labels))]
        picks = rng.integers(0, len(groups), size=(resamples, len(groups)))  # each resample's runs
        sums = np.zeros(picks.shape)
        for g, run in enumerate(groups):
            slots = np.flatnonzero(picks == g)
            sums.flat[slots] = _resampled_sums(run, slots.size, rng)
        means = sums.sum(axis=1) / np.array([g.size for g in groups])[picks].sum(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(d.mean()), float(low), float(high)


def _resampled_sums(values: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """The sums of ``n`` resamples of ``values`` with replacement. Scores take few
    distinct values (0, 1/k, ..., 1 and their differences), so a resample's sum
    follows from how often it draws each: one multinomial over the distinct
    values instead of a draw per value, the same distribution."""
    levels, counts = np.unique(values, return_counts=True)
    if levels.size * 4 <= values.size:
        return rng.multinomial(values.size, counts / values.size, size=n) @ levels
    chunk = max(1, 4_000_000 // values.size)  # bounded memory for thousands of prompts
    return np.concatenate(
        [
            values[rng.integers(0, values.size, size=(min(chunk, n - i), values.size))].sum(axis=1)
            for i in range(0, n, chunk)
        ]
        or [np.zeros(0)]
    )


def accuracy_row(task: str, prompts: list[str], greedy: list[float], sampled: list[float], k: int) -> dict:
    """One task's accuracy: pass@1 (greedy) with its 95% Wilson interval and
    mean@k, plus the per-prompt scores and a digest of the prompts, so that two
    policies evaluated on the same prompts can be compared pairwise
    (``paired_difference``)."""
    n = len(prompts)
    low, high = wilson_interval(sum(greedy), n)
    return {
        "task": task,
        "pass@1": sum(greedy) / n,
        "pass@1_ci95": [low, high],
        "mean@k": sum(sampled) / n,
        "k": k,
        "prompts": n,
        "prompts_sha256": hashlib.sha256("\0".join(prompts).encode()).hexdigest(),
        "pass@1_per_prompt": greedy,
        "mean@k_per_prompt": sampled,
    }


def paired_difference(a: dict, b: dict, metric: str = "pass@1", seed: int = 0) -> dict:
    """``a``'s metric minus ``b``'s over the prompts both were evaluated on, with
    the 95% paired-bootstrap interval; rows over different prompts are refused."""
    if a.get("prompts_sha256") is None or a.get("prompts_sha256") != b.get("prompts_sha256"):
        raise ValueError(f"cannot pair {a.get('task')!r} rows evaluated on different prompts")
    diff, low, high = paired_bootstrap(a[f"{metric}_per_prompt"], b[f"{metric}_per_prompt"], seed=seed)
    return {"difference": diff, "ci95": [low, high], "prompts": a["prompts"]}
