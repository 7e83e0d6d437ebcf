"""The alerting rules: the committed files are generated output, Prometheus takes them beside the
standalone prometheus.yml (promtool), and each rule fires on the newest round a run's train step
pushed and on no older one: under promtool's rule unit tests (Prometheus's own rule engine, on series
as the Pushgateway exposes them) and on the real Pushgateway and Prometheus of ``prometheus_server``."""

import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tracefp4.components.metrics import RunMetrics
from tracefp4.pipelines.alerts import ALERTS, PROMETHEUS_RULE_FILE, RULES_FILE, rule_groups
from tracefp4.pipelines.cli import main
from tracefp4.pipelines.dashboards import FIRING_ALERTS, dashboard, panel_queries

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"


def promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.fail("promtool not on PATH: `make install-dev` installs Debian's prometheus package, which has it")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def test_committed_rules_are_generated_output(tmp_path):
    result = CliRunner().invoke(main, ["alerts", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for path in (RULES_FILE, PROMETHEUS_RULE_FILE):
        assert str(tmp_path / path) in result.output
        assert (tmp_path / path).read_text() == (MANIFESTS / path).read_text(), f"run `tracefp4 alerts` ({path})"


def test_prometheus_takes_the_rules_beside_its_config(tmp_path):
    for name in ("prometheus.yml", "alerts.yml"):
        shutil.copy(MANIFESTS / RULES_FILE.parent / name, tmp_path / name)
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in checked.stdout


def _labels(run_id: str, component: str = "train", round: int = 0) -> dict:
    return {"job": "tracefp4", "pipeline": "p", "run_id": run_id, "method": "trace", "component": component,
            "round": str(round)}  # fmt: skip


def _series(name: str, labels: dict, value: float) -> dict:
    matchers = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{matchers}}}", "values": f"{value:g}x10"}


def _rendered(template: str, labels: dict, value: float) -> str:
    """An annotation as Prometheus fills it in."""
    filled = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    return filled.replace("{{ $value }}", f"{value:g}")


def test_each_rule_fires_on_the_newest_round_of_a_run_alone(tmp_path):
    """Per rule, a run whose older round lay beyond the threshold and its newest within (no alert), and
    one whose newest lies beyond (an alert, of that round), though its rollout pushed a later round."""
    series, tests = [], []
    annotations = {rule["alert"]: rule["annotations"] for rule in rule_groups()[0]["rules"]}
    for alert in ALERTS:
        beyond, within = (alert.threshold / 2, alert.threshold * 3) if alert.below else (alert.threshold * 2, 0.0)
        for run_id, values in ((f"{alert.name}-recovered", (beyond, within)), (f"{alert.name}-now", (within, beyond))):
            for round, value in enumerate(values):
                series.append(_series("push_time_seconds", _labels(run_id, round=round), 100 * (round + 1)))
                series.append(_series(alert.metric, _labels(run_id, round=round), value))
            series.append(_series("push_time_seconds", _labels(run_id, "rollout", 2), 300))
        fired = _labels(f"{alert.name}-now", round=1)
        expected = {k: _rendered(v, fired, beyond) for k, v in annotations[alert.name].items()}
        tests.append(
            {
                "eval_time": "5m",
                "alertname": alert.name,
                "exp_alerts": [{"exp_labels": {**fired, "severity": "warning"}, "exp_annotations": expected}],
            }
        )
    unit = tmp_path / "alerts_test.yml"
    unit.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(MANIFESTS / RULES_FILE)],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": tests}],
            }
        )
    )
    result = promtool("test", "rules", str(unit))
    assert result.returncode == 0, result.stdout + result.stderr


def _firing(prometheus, alert: str, run_id: str) -> list[str]:
    """The rounds ``alert`` fires for, of run ``run_id``."""
    found = prometheus.query(f'ALERTS{{alertname="{alert}", alertstate="firing", run_id="{run_id}"}}')
    return [sample["metric"]["round"] for sample in found]


def _until(condition, deadline: float = 20) -> bool:
    end = time.monotonic() + deadline
    while not (done := condition()) and time.monotonic() < end:
        time.sleep(0.5)
    return done


def test_an_alert_follows_the_rounds_a_run_pushes(prometheus):
    """On the real Pushgateway and Prometheus: a round's KL beyond the bound fires, the next round
    within it resolves the alert, though the older round's group stays on the gateway; the dashboard's
    alerts table shows the alert and its round's KL while it fires, and nothing once it resolves."""
    alert = next(a for a in ALERTS if a.metric == "tracefp4_train_rollout_kl")
    run_id = f"alerts-{uuid.uuid4().hex[:8]}"

    def push(round: int, kl: float) -> None:
        metrics = RunMetrics(pipeline="alerts", run_id=run_id, method="trace", component="train", round=round)
        metrics.set(alert.metric, kl)
        assert not metrics.publish(None, prometheus.pushgateway, "tracefp4")

    variables = {"pipeline": "alerts", "run_id": run_id, "method": ".*", "__range": "1h"}
    (table,) = [query for title, query in panel_queries(dashboard(), variables) if title == FIRING_ALERTS]

    def dashboard_rows() -> list[tuple[str, str, float]]:
        return [(s["metric"]["alertname"], s["metric"]["round"], float(s["value"][1])) for s in prometheus.query(table)]

    push(0, alert.threshold * 2)
    assert _until(lambda: _firing(prometheus, alert.name, run_id) == ["0"])
    assert dashboard_rows() == [(alert.name, "0", alert.threshold * 2)]
    push(1, alert.threshold / 2)
    assert _until(lambda: not _firing(prometheus, alert.name, run_id)), "the alert outlived its round"
    assert dashboard_rows() == []
    assert prometheus.query(f'{alert.metric}{{run_id="{run_id}", round="0"}}')  # the old round's group stays
    push(2, alert.threshold * 3)
    assert _until(lambda: _firing(prometheus, alert.name, run_id) == ["2"])
    assert dashboard_rows() == [(alert.name, "2", alert.threshold * 3)]
