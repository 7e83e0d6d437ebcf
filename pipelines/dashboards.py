"""Grafana dashboards as code, built from the one list of metric names in
``components/metrics.py``: a metric that no panel shows, or a panel naming a
metric nobody pushes, fails a test here instead of showing an empty graph."""

import json
import re
from pathlib import Path

from grafana_foundation_sdk.builders import barchart, bargauge, common, prometheus, stat, table
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, VisibilityMode, VizOrientation
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    VariableOption,
    VariableRefresh,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from tracefp4.components.metrics import METRICS
from tracefp4.components.store import write_atomic
from tracefp4.pipelines.alerts import ALERTS, GROUP

UID = "tracefp4-run"
TITLE = "tracefp4: TRACE FP4 RL"
FIRING_ALERTS = "Alerts firing now"  # the title of the table of alerts that fire (the one panel empty while none do)
MANIFESTS = Path("manifests/base/grafana/dashboards")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# what a run is filtered by; every query carries these matchers
RUN_VARIABLES = ("pipeline", "run_id", "method")
METRIC_NAME = re.compile(r"\btracefp4_\w+")


def sel(metric: str, **matchers: str) -> str:
    """``metric{...}`` filtered to the selected runs, plus exact ``matchers``."""
    if metric not in METRICS:
        raise KeyError(f"{metric} is not in components/metrics.py METRICS")
    return _selector(metric, **matchers)


def _selector(series: str, **matchers: str) -> str:
    labels = [f'{v}=~"${v}"' for v in RUN_VARIABLES] + [f'{k}="{v}"' for k, v in matchers.items()]
    return f"{series}{{{', '.join(labels)}}}"


def _ref_id(i: int) -> str:
    return chr(ord("A") + i)


def _panel(
    builder,
    title: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    w: int = 8,
    h: int = 8,
    instant: bool = False,
    fmt: PromQueryFormat | None = None,
):
    """A panel of Prometheus ``(expr, legend)`` targets, described by its metrics' help.

    An instant query reads each series' last sample in the dashboard's range
    (:func:`last_in_range`), so that a finished run's panels stay filled after
    its groups are deleted from the Pushgateway."""
    names = dict.fromkeys(m for expr, _ in queries for m in METRIC_NAME.findall(expr))
    panel = builder.title(title).description(" ".join(METRICS[m].help for m in names))
    panel = panel.datasource(DATASOURCE).unit(unit).span(w).height(h)
    for i, (expr, legend) in enumerate(queries):
        expr = last_in_range(expr) if instant else expr
        target = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(_ref_id(i)).datasource(DATASOURCE)
        if instant:
            target = target.instant()
        if fmt:
            target = target.format(fmt)
        panel = panel.with_target(target)
    return panel


_SELECTOR = re.compile(r"\b(tracefp4_\w+\{[^}]*\})")


def last_in_range(expr: str) -> str:
    """Every ``tracefp4_...{...}`` selector of ``expr`` as its last sample in the dashboard's time range."""
    return _SELECTOR.sub(r"last_over_time(\1[$__range])", expr)


# one value per series: its last sample (a gauge's value since its round pushed)
_LAST = common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)


def _bars(title, unit, *queries, **kw):
    builder = bargauge.Panel().orientation(VizOrientation.HORIZONTAL).reduce_options(_LAST)
    return _panel(builder, title, unit, list(queries), instant=True, **kw)


def _stat(title, unit, *queries, **kw):
    return _panel(stat.Panel().reduce_options(_LAST), title, unit, list(queries), instant=True, **kw)


def _table(title, unit, columns: dict[str, str], by: str, w: int = 12):
    """One row per ``by`` label set, one column per ``{column: metric expression}``."""
    queries = [(f"max by ({by}) ({expr})", "") for expr in columns.values()]
    values = {f"Value #{_ref_id(i)}" if len(columns) > 1 else "Value": c for i, c in enumerate(columns)}
    builder = table.Panel()
    if len(columns) > 1:
        builder = builder.with_transformation(DataTransformerConfig(id_val="merge", options={}))
    organize = {"excludeByName": {"Time": True}, "renameByName": values}
    builder = builder.with_transformation(DataTransformerConfig(id_val="organize", options=organize))
    return _panel(builder, title, unit, queries, w=w, instant=True, fmt=PromQueryFormat.TABLE)


ROUND_AXIS = "round\\series"  # the x field groupingToMatrix names after its row and column fields


def per_round(selector: str, labels: tuple[str, ...] = (), figure: str = "") -> str:
    """A per-round figure's last value in the range, one series per run, method and ``labels``,
    its name in the label ``series`` (``figure`` first, when given)."""
    by = ("method", *labels, "run_id")
    expr = f"max by (round, {', '.join(by)}) ({selector})"
    if figure:
        expr = f'label_replace({expr}, "figure", "{figure}", "", "")'
        by = ("figure", *by)
    quoted = ", ".join(f'"{label}"' for label in by)
    return f'label_join({expr}, "series", " ", {quoted})'


def _rounds(title, unit, *figures: str, w: int = 8, h: int = 8):
    """A bar chart of per-round figures (:func:`per_round`, joined by ``or``)
    against the round: one instant table query, grouped into a round x series matrix."""
    legend = common.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
    builder = barchart.Panel().x_field(ROUND_AXIS).show_value(VisibilityMode.NEVER)
    builder = builder.legend(legend.placement(LegendPlacement.BOTTOM))
    for id_val, options in (
        ("convertFieldType", {"fields": {}, "conversions": [{"targetField": "round", "destinationType": "number"}]}),
        ("sortBy", {"fields": {}, "sort": [{"field": "round", "desc": False}]}),
        (
            "groupingToMatrix",
            {"columnField": "series", "rowField": "round", "valueField": "Value", "emptyValue": "null"},
        ),
    ):
        builder = builder.with_transformation(DataTransformerConfig(id_val=id_val, options=options))
    query = (" or ".join(figures), "")
    return _panel(builder, title, unit, [query], w=w, h=h, instant=True, fmt=PromQueryFormat.TABLE)


def _firing_alerts(w: int = 24, h: int = 5):
    """A table of the alerts of ``pipelines/alerts.py`` firing now for the selected runs: per alert
    the run and round it fires for, and that round's figure (the alert's metric, named by the alert)."""
    by = ("alertname", "pipeline", "run_id", "method", "round")
    figures = []
    for alert in ALERTS:
        firing = _selector("ALERTS", alertname=alert.name, alertstate="firing")
        figure = f"max by ({', '.join(by[1:])}) ({sel(alert.metric)} and on ({', '.join(GROUP)}) {firing})"
        figures.append(f'label_replace({figure}, "alertname", "{alert.name}", "", "")')
    organize = {
        "excludeByName": {"Time": True},
        "indexByName": {**{label: i for i, label in enumerate(by)}, "Value": len(by)},
        "renameByName": {"alertname": "alert", "Value": "figure"},
    }
    builder = table.Panel().with_transformation(DataTransformerConfig(id_val="organize", options=organize))
    query = (" or ".join(figures), "")
    panel = _panel(builder, FIRING_ALERTS, "none", [query], w=w, h=h, instant=True, fmt=PromQueryFormat.TABLE)
    bounds = "; ".join(f"{a.name}: {a.beyond}" for a in ALERTS)
    return panel.description(
        "The Prometheus alerts on a run's train-rollout mismatch that fire now for the selected runs, each with "
        f"the round it fires for (a run's newest) and that round's figure. {bounds}. docs/metrics.md, \"Alerts\"; "
        "an empty table is a run within every bound."
    )


def _rows() -> list[tuple[str, list]]:
    """(row title, panels): what a run is watched for, one row per question."""
    rollout = {"component": "rollout"}  # evaluate's throughput belongs to no round
    return [
        ("Alerts", [_firing_alerts()]),
        (
            "Rollout throughput",
            [
                _rounds(
                    "Rollout tokens/s by round",
                    "short",
                    per_round(sel("tracefp4_rollout_tokens_per_second", **rollout), ("rollout_config",)),
                ),
                _rounds(
                    "Response tokens by round",
                    "short",
                    per_round(sel("tracefp4_rollout_tokens", **rollout), ("rollout_config",)),
                ),
                _rounds(
                    "Rollout seconds by round",
                    "s",
                    per_round(sel("tracefp4_rollout_seconds", **rollout), ("rollout_config",)),
                ),
                _stat(
                    "Rollout tokens/s over the run",
                    "short",
                    (
                        "sum by (run_id, method, component, rollout_config) (" + sel("tracefp4_rollout_tokens") + ")"
                        " / sum by (run_id, method, component, rollout_config) ("
                        + sel("tracefp4_rollout_seconds")
                        + ")",
                        "{{component}} {{method}} {{rollout_config}}",
                    ),
                    w=24,
                    h=4,
                ),
            ],
        ),
        (
            "Capture, offload, upload and reload overhead",
            [
                _rounds(
                    "Capture overhead (share of rollout time)",
                    "percentunit",
                    per_round(sel("tracefp4_capture_overhead_ratio")),
                ),
                _rounds(
                    "Capture offload and guidance upload seconds",
                    "s",
                    per_round(sel("tracefp4_capture_offload_seconds"), figure="offload"),
                    per_round(sel("tracefp4_guidance_upload_seconds"), figure="upload"),
                ),
                _rounds(
                    "Train step, guidance reload and reward seconds",
                    "s",
                    per_round(sel("tracefp4_train_step_seconds"), figure="step"),
                    per_round(sel("tracefp4_guidance_reload_seconds"), figure="reload"),
                    per_round(sel("tracefp4_reward_step_seconds"), figure="reward"),
                ),
                _bars(
                    "Guidance reload share of a train step",
                    "percentunit",
                    (  # the step's own seconds leave out its wait for guidance: the share is of their sum
                        "max by (run_id, method, round) (" + sel("tracefp4_guidance_reload_seconds") + ")"
                        " / (max by (run_id, method, round) (" + sel("tracefp4_guidance_reload_seconds") + ")"
                        " + max by (run_id, method, round) (" + sel("tracefp4_train_step_seconds") + "))",
                        "{{method}} r{{round}}",
                    ),
                    w=24,
                    h=6,
                ),
            ],
        ),
        (
            "Guidance storage and compaction",
            [
                _rounds(
                    "Guidance and full capture bytes",
                    "bytes",
                    per_round(sel("tracefp4_guidance_bytes"), figure="guidance"),
                    per_round(sel("tracefp4_capture_bytes"), figure="capture"),
                ),
                _stat(
                    "Guidance bits per element",
                    "none",
                    (sel("tracefp4_guidance_bits_per_element"), "{{method}} r{{round}}"),
                ),
                _rounds(
                    "Compaction ratio and fidelity",
                    "percentunit",
                    per_round(sel("tracefp4_compaction_ratio"), figure="bytes kept"),
                    per_round(sel("tracefp4_compaction_fidelity_ratio"), figure="fidelity"),
                ),
                _rounds("Compaction seconds", "s", per_round(sel("tracefp4_compaction_seconds")), w=24, h=6),
            ],
        ),
        (
            "Train-rollout mismatch",
            [
                _rounds(
                    "Log-prob |train - rollout| by stat",
                    "none",
                    per_round(sel("tracefp4_train_rollout_logprob_abs_diff"), ("stat",)),
                ),
                _rounds("KL(rollout || train) per token", "none", per_round(sel("tracefp4_train_rollout_kl"))),
                _rounds(
                    "Log-perplexity |diff| and chi^2 per token (verl's names)",
                    "none",
                    per_round(sel("tracefp4_train_rollout_log_ppl_abs_diff"), figure="log_ppl_abs_diff"),
                    per_round(sel("tracefp4_train_rollout_chi2"), figure="chi2_token"),
                ),
                _rounds(
                    "TIS clip fraction and importance-weight effective sample size",
                    "percentunit",
                    per_round(sel("tracefp4_tis_clip_ratio"), figure="tis_clipfrac"),
                    per_round(sel("tracefp4_importance_weight_ess_ratio"), figure="ESS / tokens"),
                ),
                _rounds(
                    "Guidance coverage and syndrome decode failures",
                    "percentunit",
                    per_round(sel("tracefp4_guidance_coverage_ratio"), figure="coverage"),
                    per_round(sel("tracefp4_guidance_decode_failure_ratio"), figure="decode failures"),
                ),
                _bars(
                    "Code mismatch over all layers, mean relative excess MSE over layers",
                    "percentunit",
                    (sel("tracefp4_code_mismatch_ratio"), "mismatch {{method}} {{rollout_config}}"),
                    (
                        "avg by (run_id, method, rollout_config) ("
                        + sel("tracefp4_layer_relative_excess_mse_ratio")
                        + ")",
                        "excess MSE {{method}} {{rollout_config}}",
                    ),
                    w=12,
                    h=10,
                ),
                _table(
                    "Code mismatch and relative excess MSE by layer",
                    "percentunit",
                    {
                        "code mismatch": sel("tracefp4_layer_code_mismatch_ratio"),
                        "relative excess MSE": sel("tracefp4_layer_relative_excess_mse_ratio"),
                    },
                    by="run_id, method, rollout_config, layer",
                ),
            ],
        ),
        (
            "Reward and accuracy",
            [
                _rounds("Reward (round mean)", "none", per_round(sel("tracefp4_reward"))),
                _rounds(
                    "Training accuracy (split=train)",
                    "percentunit",
                    per_round(sel("tracefp4_accuracy_ratio", split="train"), ("rollout_config", "task", "metric")),
                ),
                _stat(
                    "RL steps trained",
                    "none",
                    ("sum by (run_id, method) (" + sel("tracefp4_train_steps") + ")", "{{method}}"),
                ),
                _table(
                    "Held-out accuracy (split=test)",
                    "percentunit",
                    {"accuracy": sel("tracefp4_accuracy_ratio", split="test")},
                    by="run_id, method, rollout_config, task, metric",
                    w=24,
                ),
            ],
        ),
    ]


def _run_variable(name: str, *, after: tuple[str, ...]):
    """A multi-select of the label's values, narrowed by the variables ``after`` it."""
    narrowed = ", ".join(f'{v}=~"${v}"' for v in after)
    return (
        dash.QueryVariable(name)
        .label(name)
        .datasource(DATASOURCE)
        .query(
            f"label_values(tracefp4_rollout_seconds{{{narrowed}}}, {name})"
            if after
            else f"label_values(tracefp4_rollout_seconds, {name})"
        )
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def dashboard() -> dict:
    """The run dashboard as Grafana's JSON model (a dict)."""
    board = (
        dash.Dashboard(TITLE)
        .uid(UID)
        .tags(["tracefp4"])
        .time("now-24h", "now")
        .refresh("1m")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .description(
            "One TRACE FP4 RL run (or comparison) per selection: "
            "rollout throughput, capture overhead, guidance storage, train-rollout mismatch, reward and accuracy."
        )
        .with_variable(dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for i, name in enumerate(RUN_VARIABLES):
        board = board.with_variable(_run_variable(name, after=RUN_VARIABLES[:i]))
    for title, panels in _rows():
        board = board.with_row(dash.Row(title))
        for panel in panels:
            board = board.with_panel(panel)
    model = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for i, panel in enumerate(_walk(model["panels"]), start=1):
        panel["id"] = i  # Grafana wants unique ids; the SDK leaves panels without one
    return model


def _walk(panels: list[dict]):
    """Every panel, rows' nested panels included, in dashboard order."""
    for panel in panels:
        yield panel
        yield from _walk(panel.get("panels", []))


def write(directory: str | Path = MANIFESTS) -> Path:
    """Write the dashboard as ``tracefp4.json`` (the file the kustomize manifests mount)."""
    path = Path(directory) / "tracefp4.json"
    text = (json.dumps(dashboard(), sort_keys=True, indent=2) + "\n").encode()
    write_atomic(path, lambda f: f.write(text))  # a file kept whole: the old or the new one
    return path


_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)")


def panel_queries(dashboard: dict, variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, ``$var``, ``${var}`` and ``${var:fmt}``
    replaced from ``variables`` (others left as written)."""

    def substitute(match: re.Match) -> str:
        name = match[1] or match[2]
        return variables.get(name, match[0])

    return [
        (panel.get("title", ""), _VARIABLE.sub(substitute, target["expr"]))
        for panel in _walk(dashboard.get("panels", []))
        for target in panel.get("targets", [])
    ]
