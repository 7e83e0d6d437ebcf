"""Prometheus alerting rules on a run's train-rollout mismatch, built from the metrics of
``components/metrics.py`` (docs/metrics.md, "Alerts").

Why: a mismatch that grows until RL trains on what its policy would not have sampled shows on the
dashboard only to someone looking. These rules fire on the newest round a run's train step pushed, at
the warning levels verl documents for the same figures and at ten times the decode failures the
syndrome codec's rates aim at. A round's groups stay on the Pushgateway, so an alert on an older round
would fire for as long as they stay: each rule reads the group its run pushed last
(:func:`newest_round`), and resolves when the next round comes in within bounds or the run's metrics
are deleted (``tracefp4 delete-metrics``).

The same groups go to a standalone Prometheus (``manifests/base/prometheus/alerts.yml``, beside its
``prometheus.yml``) and to kube-prometheus-stack as a PrometheusRule; :func:`write` writes both.
"""

from dataclasses import dataclass
from pathlib import Path

import yaml

from tracefp4.components.metrics import GROUPING, METRICS
from tracefp4.components.store import write_atomic
from tracefp4.components.syndrome_rate import TARGET_FAILED_SHARE

MANIFESTS = Path("manifests")
RULES_FILE = Path("base/prometheus/alerts.yml")  # under MANIFESTS; prometheus.yml's rule_files names it
PROMETHEUS_RULE_FILE = Path("overlays/kube-prometheus-stack/prometheusrule.yaml")
RELEASE = "kube-prometheus-stack"  # the chart's ruleSelector matches release: <its release name>
VERL_ROLLOUT_IS = "verl's docs/advance/rollout_is.md"
GROUP = ("job", *GROUPING)  # a pushed group's labels
RUN_COMPONENT = tuple(label for label in GROUP if label != "round")  # a component's groups of one run: its rounds


@dataclass(frozen=True)
class Alert:
    """Fires where the newest round's ``metric`` lies beyond ``threshold``: above it, or below it
    where ``below``. ``what`` names the figure, ``why`` says where the threshold comes from."""

    name: str
    metric: str
    threshold: float
    below: bool
    what: str
    why: str

    @property
    def beyond(self) -> str:
        """The comparison that holds where the alert fires, such as ``tracefp4_train_rollout_kl > 0.1``."""
        return f"{self.metric} {'<' if self.below else '>'} {self.threshold:g}"

    def expr(self) -> str:
        return f"({self.beyond}) and on ({', '.join(GROUP)}) ({newest_round()})"


ALERTS = (
    Alert(
        "Tracefp4ImportanceWeightsDegenerate",
        "tracefp4_importance_weight_ess_ratio",
        0.3,
        below=True,
        what="effective sample size of the truncated importance weights, over the tokens",
        why=f"{VERL_ROLLOUT_IS}: rollout_is_eff_sample_size below 0.3 means high variance",
    ),
    Alert(
        "Tracefp4TrainRolloutKLHigh",
        "tracefp4_train_rollout_kl",
        0.1,
        below=False,
        what="KL(rollout || train) per response token",
        why=f"{VERL_ROLLOUT_IS}: mismatch_kl, the same KL by another estimator, above 0.1 indicates significant "
        "mismatch",
    ),
    Alert(
        "Tracefp4GuidanceDecodeFailures",
        "tracefp4_guidance_decode_failure_ratio",
        10 * TARGET_FAILED_SHARE,
        below=False,
        what="share of the syndrome-coded guidance blocks whose decode failed, rounded to nearest instead",
        why=f"ten times the {TARGET_FAILED_SHARE:g} the syndrome codec chooses its rates for "
        "(components/syndrome_rate.py TARGET_FAILED_SHARE)",
    ),
)


def newest_round() -> str:
    """The Pushgateway's ``push_time_seconds`` of the group each run's component pushed last."""
    by = ", ".join(RUN_COMPONENT)
    return f"push_time_seconds == on ({by}) group_left max by ({by}) (push_time_seconds)"


def rule_groups() -> list[dict]:
    """The rule groups, one rule per :data:`ALERTS` entry."""
    rules = []
    for alert in ALERTS:
        if alert.metric not in METRICS:
            raise KeyError(f"{alert.metric} is not in components/metrics.py METRICS")
        side = "below" if alert.below else "above"
        rules.append(
            {
                "alert": alert.name,
                "expr": alert.expr(),
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": f"run {{{{ $labels.run_id }}}} ({{{{ $labels.pipeline }}}}, method "
                    f"{{{{ $labels.method }}}}) round {{{{ $labels.round }}}}: {alert.what}, {{{{ $value }}}} "
                    f"({side} {alert.threshold:g})",
                    "description": f'{METRICS[alert.metric].help} Threshold: {alert.why}. docs/metrics.md, "Alerts".',
                },
            }
        )
    return [{"name": "tracefp4", "rules": rules}]


def prometheus_rule() -> dict:
    """The rule groups as kube-prometheus-stack's Prometheus Operator takes them."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "tracefp4",
            "namespace": "tracefp4",
            "labels": {"app.kubernetes.io/part-of": "tracefp4", "release": RELEASE},
        },
        "spec": {"groups": rule_groups()},
    }


def write(manifests: str | Path = MANIFESTS) -> list[Path]:
    """Write the standalone Prometheus's rules file and the PrometheusRule under ``manifests``."""
    written = []
    for path, document, note in (
        (RULES_FILE, {"groups": rule_groups()}, "the standalone Prometheus's rules (prometheus.yml rule_files)"),
        (PROMETHEUS_RULE_FILE, prometheus_rule(), f"for kube-prometheus-stack, whose release is named {RELEASE}"),
    ):
        target = Path(manifests) / path
        header = f"# Generated by `tracefp4 alerts` (pipelines/alerts.py): {note}. Do not edit.\n"
        text = header + yaml.safe_dump(document, sort_keys=False, width=120)
        write_atomic(target, lambda f, text=text: f.write(text.encode()))
        written.append(target)
    return written
