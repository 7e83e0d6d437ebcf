"""The Grafana dashboard: the committed JSON in sync with the code, every run
metric shown and no other, every query filtered to the selected runs."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from tracefp4.components.metrics import METRICS
from tracefp4.pipelines.alerts import ALERTS
from tracefp4.pipelines.cli import main
from tracefp4.pipelines.dashboards import (
    FIRING_ALERTS,
    RUN_VARIABLES,
    dashboard,
    last_in_range,
    panel_queries,
    write,
)

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "manifests/base/grafana/dashboards/tracefp4.json"
CONCRETE = {"pipeline": "tracefp4-tiny", "run_id": "run-1|run-2", "method": ".*", "__range": "3h"}


@pytest.fixture(scope="module")
def board():
    return dashboard()


def _panels(panels):
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _targets(board):
    return [(panel, target) for panel in _panels(board["panels"]) for target in panel.get("targets", [])]


def test_committed_json_is_generated_output(tmp_path):
    fresh = write(tmp_path).read_text()
    assert COMMITTED.exists(), "manifests/base/grafana/dashboards/tracefp4.json missing; run `tracefp4 dashboards`"
    assert COMMITTED.read_text() == fresh, "the committed dashboard is stale; regenerate it with `tracefp4 dashboards`"


def test_dashboard_model(board):
    assert board["schemaVersion"] >= 41
    assert board["uid"] == "tracefp4-run" and board["title"] == "tracefp4: TRACE FP4 RL"
    ids = [p["id"] for p in _panels(board["panels"])]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [
        "Alerts",
        "Rollout throughput",
        "Capture, offload, upload and reload overhead",
        "Guidance storage and compaction",
        "Train-rollout mismatch",
        "Reward and accuracy",
    ]
    for panel in _panels(board["panels"]):
        if panel["type"] != "row":
            assert panel["targets"] and panel["description"], panel["title"]
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_variables(board):
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in RUN_VARIABLES:
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert v["datasource"]["uid"] == "${datasource}"
        metric, label = re.fullmatch(r"label_values\((\w+)(?:\{.*\})?, (\w+)\)", v["query"]).groups()
        assert metric in METRICS and label == name


def test_targets_have_ref_ids_and_the_datasource_variable(board):
    for panel in _panels(board["panels"]):
        ref_ids = [t["refId"] for t in panel.get("targets", [])]
        assert all(ref_ids) and len(ref_ids) == len(set(ref_ids)), panel["title"]
    for panel, target in _targets(board):
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_every_metric_shown_and_no_other(board):
    queried = {m for _, expr in panel_queries(board, CONCRETE) for m in re.findall(r"\btracefp4_\w+", expr)}
    assert queried <= set(METRICS), f"not in components/metrics.py: {sorted(queried - set(METRICS))}"
    assert set(METRICS) <= queried, f"no panel shows {sorted(set(METRICS) - queried)}"


def test_every_selector_filters_to_the_selected_runs(board):
    for title, expr in panel_queries(board, {}):
        selectors = re.findall(r"\b(tracefp4_\w+|ALERTS)(\{[^}]*\})?", expr)
        assert selectors, title
        for metric, matchers in selectors:
            for name in RUN_VARIABLES:
                assert f'{name}=~"${name}"' in matchers, f"{title}: {metric} not filtered on {name}"


def _balanced(expr: str) -> bool:
    """Brackets nest and close outside of string literals, quotes close."""
    stack, pairs = [], {")": "(", "}": "{", "]": "["}
    for token in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if token == '"':
            continue
        if token in "({[":
            stack.append(token)
        elif token in pairs and (not stack or stack.pop() != pairs[token]):
            return False
    return not stack and expr.count('"') % 2 == 0


def test_queries_substitute_variables_and_look_like_promql(board):
    queries = panel_queries(board, CONCRETE)
    assert len(queries) == len(_targets(board))
    for title, expr in queries:
        assert "$" not in expr, f"{title}: unsubstituted variable in {expr}"
        assert _balanced(expr), f"{title}: unbalanced {expr}"
        for matchers in re.findall(r"\{([^}]*)\}", expr):
            for matcher in matchers.split(", "):
                assert re.fullmatch(r'\w+(=~|=|!=|!~)"[^"]*"', matcher), f"{title}: bad matcher {matcher}"
        assert 'run_id=~"run-1|run-2"' in expr and 'pipeline=~"tracefp4-tiny"' in expr


def test_instant_targets_read_the_last_sample_in_the_range(board):
    """An instant panel stays filled once a finished run's groups are deleted from the Pushgateway."""
    instant = [(panel, target) for panel, target in _targets(board) if target.get("instant")]
    assert len(instant) >= 10
    for panel, target in instant:
        selectors = re.findall(r"(\w*\(?)(tracefp4_\w+\{[^}]*\})(\[\$__range\])?", target["expr"])
        assert selectors, panel["title"]
        for before, selector, window in selectors:
            assert before.endswith("last_over_time(") and window, f"{panel['title']}: {selector} is not last_over_time"
    assert last_in_range('a(tracefp4_x{b="1"}) / tracefp4_y{c="2"}') == (
        'a(last_over_time(tracefp4_x{b="1"}[$__range])) / last_over_time(tracefp4_y{c="2"}[$__range])'
    )


def test_per_round_figures_are_plotted_against_the_round(board):
    charts = [p for p in _panels(board["panels"]) if p["type"] == "barchart"]
    assert len(charts) >= 12
    for panel in charts:
        (target,) = panel["targets"]
        assert target["format"] == "table" and target["instant"], panel["title"]
        grouping = next(t["options"] for t in panel["transformations"] if t["id"] == "groupingToMatrix")
        assert grouping["rowField"] == "round" and grouping["columnField"] == "series"
        assert panel["options"]["xField"] == f"{grouping['rowField']}\\{grouping['columnField']}"
        ids = [t["id"] for t in panel["transformations"]]
        assert ids.index("convertFieldType") < ids.index("sortBy") < ids.index("groupingToMatrix")  # rounds as numbers
        for part in target["expr"].split(" or "):  # every figure of the chart keeps round and names its series
            assert part.startswith("label_join(") and "max by (round, method, " in part, panel["title"]
            assert '"series", " "' in part and part.rstrip(")").endswith('"run_id"'), panel["title"]
    # no time series left: every figure is pushed once per component run, so time is not its axis
    assert not [p["title"] for p in _panels(board["panels"]) if p["type"] == "timeseries"]


def test_the_alerts_table_shows_every_alert_with_its_figure(board):
    """One figure per alert of pipelines/alerts.py, its metric's value in the rounds the alert fires for,
    named by the alert (its firing on the real Prometheus: test_alerts.py)."""
    (panel,) = [p for p in _panels(board["panels"]) if p["title"] == FIRING_ALERTS]
    (target,) = panel["targets"]
    assert panel["type"] == "table" and target["format"] == "table" and target["instant"]
    figures = target["expr"].split(" or ")
    assert len(figures) == len(ALERTS)
    for alert, figure in zip(ALERTS, figures, strict=True):
        firing = f'ALERTS{{pipeline=~"$pipeline", run_id=~"$run_id", method=~"$method", alertname="{alert.name}", '
        assert f"last_over_time({alert.metric}{{" in figure and firing in figure
        assert figure.endswith(f'"alertname", "{alert.name}", "", "")')
        assert alert.name in panel["description"]


def test_panel_queries_substitution_forms():
    board = {
        "panels": [
            {
                "type": "row",
                "title": "r",
                "panels": [
                    {
                        "title": "p",
                        "targets": [{"expr": 'm{a=~"$run_id", b=~"${run_id}", c=~"${run_id:regex}", d="$__interval"}'}],
                    }
                ],
            }
        ]
    }
    assert panel_queries(board, {"run_id": "x|y"}) == [("p", 'm{a=~"x|y", b=~"x|y", c=~"x|y", d="$__interval"}')]


def test_cli_writes_the_dashboard(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the default is the repository's folder: run elsewhere, it made a stray manifests/ there
    result = CliRunner().invoke(main, ["dashboards"])
    assert result.exit_code == 2 and "manifests/ is not here: run it from the repository's root" in result.output
    assert not (tmp_path / "manifests").exists()
    (tmp_path / "manifests").mkdir()
    for args, path in [
        ([], "manifests/base/grafana/dashboards/tracefp4.json"),
        (["--output", "out"], "out/tracefp4.json"),
    ]:
        result = CliRunner().invoke(main, ["dashboards", *args])
        assert result.exit_code == 0, result.output
        assert result.output.strip() == path
        assert json.loads((tmp_path / path).read_text())["uid"] == "tracefp4-run"
