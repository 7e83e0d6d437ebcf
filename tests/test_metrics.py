"""Run metrics: the registry and the metrics file's group semantics, then a
real Pushgateway and Prometheus: the smoke pipeline pushes, and every
dashboard panel's PromQL returns data."""

import json
import logging
import socket
import time
import urllib.request

import pytest

from tracefp4.components.metrics import METRICS, PUBLISH_FAILED, RunMetrics, delete_run, read_file, round_means
from tracefp4.pipelines.dashboards import FIRING_ALERTS, _walk, dashboard, panel_queries
from tracefp4.pipelines.local import run_local
from tracefp4.schemas import get_preset


def _group(round: int, method: str = "trace") -> RunMetrics:
    return RunMetrics(pipeline="p", run_id="r1", method=method, component="rollout", round=round)


WHERE = {"device": "cpu (AMD EPYC 7B13, 2 threads)", "cpu_bf16": "emulated"}  # a speed figure's machine


def test_a_group_replaces_its_own_samples_in_the_file_and_keeps_the_others(tmp_path):
    path = tmp_path / "metrics.prom"
    for round, value in ((0, 1.0), (1, 2.0)):
        m = _group(round)
        m.set("tracefp4_rollout_tokens_per_second", value, rollout_config="fp4_wa_kv", **WHERE)
        m.set("tracefp4_capture_overhead_ratio", 0.03)
        m.publish(path, None, "tracefp4")
    retry = _group(0)  # a retried round 0 that measured only its throughput
    retry.set("tracefp4_rollout_tokens_per_second", 5.0, rollout_config="fp4_wa_kv", **WHERE)
    retry.publish(path, None, "tracefp4")
    samples = {(name, labels["round"]): value for name, labels, value in read_file(path)}
    assert samples == {
        ("tracefp4_rollout_tokens_per_second", "0"): 5.0,
        ("tracefp4_rollout_tokens_per_second", "1"): 2.0,
        ("tracefp4_capture_overhead_ratio", "1"): 0.03,
    }
    labels = next(labels for _, labels, _ in read_file(path))
    assert {"job", "pipeline", "run_id", "method", "component", "round", "rollout_config"} <= set(labels)
    assert not list(tmp_path.glob("*.tmp*"))  # written to a temporary file, then renamed


def test_samples_of_one_metric_with_other_label_names_keep_their_own(tmp_path):
    """A file written by an earlier tracefp4 (this metric with a layer label,
    docs/metrics.md) merged with this run's samples: the family's first label
    names were laid over every later sample, shifting its values one name on
    (run_id lost, method read as 'round')."""
    path = tmp_path / "metrics.prom"
    old = 'tracefp4_code_mismatch_ratio{component="train",job="tracefp4",layer="all",method="trace",'
    path.write_text(old + 'pipeline="p",round="0",run_id="r0"} 0.5\n')
    m = _group(0, "qat")
    m.set("tracefp4_code_mismatch_ratio", 0.25, rollout_config="fp4_wa_kv")
    m.publish(path, None, "tracefp4")
    samples = {labels["run_id"]: (labels, value) for _, labels, value in read_file(path)}
    assert samples["r0"] == ({"component": "train", "job": "tracefp4", "layer": "all", "method": "trace",
                              "pipeline": "p", "round": "0", "run_id": "r0"}, 0.5)  # fmt: skip
    assert samples["r1"][0]["method"] == "qat" and samples["r1"][1] == 0.25 and "layer" not in samples["r1"][0]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_pushgateway_is_logged_and_counted_and_the_file_still_written(tmp_path, caplog):
    m = _group(0)
    m.set("tracefp4_reward", 0.5)
    gateway = f"http://127.0.0.1:{_closed_port()}"
    with caplog.at_level(logging.WARNING, logger="tracefp4.components.metrics"):
        failures = m.publish(tmp_path / "metrics.prom", gateway, "tracefp4")
    assert len(failures) == 1 and gateway in failures[0]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith(PUBLISH_FAILED)] != []
    assert [name for name, _, _ in read_file(tmp_path / "metrics.prom")] == ["tracefp4_reward"]


def test_a_corrupt_metrics_file_is_set_aside_with_a_warning_and_replaced(tmp_path, caplog):
    path = tmp_path / "metrics.prom"
    path.write_bytes(b"tracefp4_reward{ half a line\n\xff\xfe")
    m = _group(1)
    m.set("tracefp4_reward", 0.25)
    with caplog.at_level(logging.WARNING, logger="tracefp4.components.metrics"):
        assert m.publish(path, None, "tracefp4") == []
    assert any("not in the Prometheus text format" in r.getMessage() for r in caplog.records)
    assert [(name, value) for name, _, value in read_file(path)] == [("tracefp4_reward", 0.25)]
    assert path.with_name("metrics.prom.corrupt").read_bytes().startswith(b"tracefp4_reward{ half")  # kept, not lost


def test_unknown_metrics_and_wrong_labels_are_errors_and_none_is_skipped():
    m = _group(0)
    with pytest.raises(KeyError, match="unknown metric 'tracefp4_nope'"):
        m.set("tracefp4_nope", 1.0)
    with pytest.raises(ValueError, match=r"takes labels \('rollout_config', 'device', 'cpu_bf16'\)"):
        m.set("tracefp4_rollout_seconds", 1.0)
    m.set("tracefp4_capture_bytes", None)
    assert not [f for f in m.registry.collect() if f.samples]


def test_every_metric_is_named_in_base_units_with_the_prefix():
    for name in METRICS:
        assert name.startswith("tracefp4_") and not name.endswith(
            ("_total", "_ms", "_milliseconds", "_kb", "_mb", "_percent")
        )
        assert name.endswith(
            (
                "_seconds",
                "_bytes",
                "_ratio",
                "_per_second",
                "_per_element",
                "_tokens",
                "_steps",
                "_reward",
                "_kl",
                "_chi2",
                "_abs_diff",
            )
        ), name


def _groups(gateway: str) -> list[dict]:
    with urllib.request.urlopen(gateway + "/api/v1/metrics", timeout=5) as response:
        return [g["labels"] for g in json.load(response)["data"]]


def test_push_replaces_a_group_and_delete_run_removes_only_that_run(prometheus):
    for run_id in ("keep", "drop"):
        for round in (0, 1):
            m = RunMetrics(pipeline="del", run_id=run_id, method="qat", component="train", round=round)
            m.set("tracefp4_reward", 0.5)
            m.publish(None, prometheus.pushgateway, "tracefp4-test")
    assert delete_run(prometheus.pushgateway, "tracefp4-test", "del", "drop") == 2
    # the Pushgateway answers a DELETE (202 Accepted) before its storage applies it: CI once listed a deleted group
    for _ in range(50):
        left = [(g["run_id"], g["round"]) for g in _groups(prometheus.pushgateway) if g.get("pipeline") == "del"]
        if sorted(left) == [("keep", "0"), ("keep", "1")]:
            break
        time.sleep(0.1)
    assert sorted(left) == [("keep", "0"), ("keep", "1")]


@pytest.fixture(scope="module")
def pushed_run(prometheus, tmp_path_factory):
    """The smoke pipeline with offline compaction (so that every metric has a
    sample), pushing to the Pushgateway and writing its metrics file."""
    config = get_preset("smoke")
    config.name = "metrics-smoke"
    config.guidance.compaction = "offline"
    config.metrics.pushgateway_url = prometheus.pushgateway
    out = tmp_path_factory.mktemp("run")
    run_local(config, out, out / "log")
    return out


def test_every_dashboard_panel_query_returns_data_from_the_pushed_run(prometheus, pushed_run):
    # this run's id only: Debian's Pushgateway keeps (and loads) groups in a persistence file by default
    (run_id,) = {labels["run_id"] for _, labels, _ in read_file(pushed_run / "metrics.prom")}
    scraped = prometheus.wait_for(f'tracefp4_train_steps{{pipeline="metrics-smoke", run_id="{run_id}"}}')
    assert scraped, "Prometheus never scraped the pushed run"
    variables = {"pipeline": "metrics-smoke", "run_id": run_id, "method": "trace", "__range": "1h"}
    # no alert fires for this run: the alerts table is tested firing in test_alerts.py
    queries = [(title, query) for title, query in panel_queries(dashboard(), variables) if title != FIRING_ALERTS]
    assert len(queries) >= len(METRICS) // 2
    # a per-round chart's figures are joined by `or`: each must return data on its own
    parts = [(title, part) for title, query in queries for part in query.split(" or ")]
    empty = [(title, query) for title, query in parts if not prometheus.query(query)]
    assert not empty, f"panels whose queries match nothing: {empty}"
    by_round = [prometheus.query(q) for t, q in queries if t == "Reward (round mean)"][0]
    assert sorted(int(s["metric"]["round"]) for s in by_round) == list(range(get_preset("smoke").rl.rounds)), by_round
    assert {s["metric"]["series"] for s in by_round} == {f"trace {run_id}"}
    # a train step's seconds leave out its wait for guidance: the share is of their sum
    (share,) = [prometheus.query(q) for t, q in queries if t == "Guidance reload share of a train step"]
    seconds = {(name, labels["round"]): value for name, labels, value in read_file(pushed_run / "metrics.prom")}
    for sample in share:
        r = sample["metric"]["round"]
        reload, step = seconds["tracefp4_guidance_reload_seconds", r], seconds["tracefp4_train_step_seconds", r]
        assert float(sample["value"][1]) == pytest.approx(reload / (reload + step)), r


def test_the_metrics_file_holds_what_prometheus_scraped(prometheus, pushed_run):
    samples = read_file(pushed_run / "metrics.prom")
    assert {name for name, _, _ in samples} == set(METRICS)  # the offline trace run measures everything
    components = {labels["component"] for _, labels, _ in samples}
    assert components == {"prepare", "rollout", "compaction", "train", "evaluate"}
    run_ids = {labels["run_id"] for _, labels, _ in samples}
    assert len(run_ids) == 1 and "{{" not in next(iter(run_ids))  # the KFP run ID, not a placeholder
    for name, labels, value in samples:
        matchers = ",".join(f'{k}="{v}"' for k, v in labels.items())
        result = prometheus.wait_for(f"{name}{{{matchers}}}")
        assert len(result) == 1 and float(result[0]["value"][1]) == pytest.approx(value), (name, labels)


def test_kfp_gets_the_round_means_prometheus_gets():
    """The train component logs each figure's mean over the round (not its last step's): over its steps, or
    for a per-token figure over its response tokens (the second step's responses are three times as long)."""
    rows = [
        {"reward_mean": 0.25, "k3_kl": 1e-3, "guidance_coverage": 0.5, "chi2_token": None, "response_length": 10},
        {"reward_mean": 0.75, "k3_kl": 3e-3, "guidance_coverage": 1.0, "chi2_token": None, "response_length": 30},
    ]
    assert round_means(rows) == pytest.approx({"reward_mean": 0.5, "k3_kl": 2.5e-3, "guidance_coverage": 0.75})


def test_the_rounds_decode_failure_ratio_is_its_failed_blocks_of_all_its_blocks(tmp_path):
    """Not the mean of its steps' shares (0.05 here), which the metric's help does not say."""
    from tracefp4.components.metrics import _train

    rows = [
        {"guidance_decode_blocks": 1000, "guidance_decode_failures": 100, "logprob_abs_diff_max": 0.1},
        {"guidance_decode_blocks": 10, "guidance_decode_failures": 0, "logprob_abs_diff_max": 0.1},
    ]
    m = RunMetrics(pipeline="p", run_id="r1", method="trace", component="train", round=0)
    _train(m, rows, get_preset("smoke"))
    m.publish(tmp_path / "metrics.prom", None, "tracefp4")
    ((value,),) = [[v for name, _, v in read_file(tmp_path / "metrics.prom") if name.endswith("decode_failure_ratio")]]
    assert value == pytest.approx(100 / 1010)


def test_a_round_drawn_from_several_tasks_tells_each_ones_training_accuracy(tmp_path):
    """Over the round's responses to each task's prompts (3 of 8 and 6 of 8 here), beside the mix's mean; a round
    of one task has the mix's alone."""
    import torch

    from tracefp4.components.metrics import _train
    from tracefp4.components.steps import solved_by_task
    from tracefp4.components.tasks import Problem

    problems = [Problem(task, "q", "1", {}) for task in ("sums", "sums", "bench", "sums")]
    assert solved_by_task(problems, torch.tensor([1.0, 0.0, 1.0, 0.5])) == {"sums": [1, 3], "bench": [1, 1]}

    def accuracy(*steps):
        rows = [{"accuracy": 0.5, "logprob_abs_diff_max": 0.0, "task_solved": solved} for solved in steps]
        m = RunMetrics(pipeline="p", run_id="r1", method="trace", component="train", round=0)
        _train(m, rows, get_preset("smoke"))
        m.publish(tmp_path / "metrics.prom", None, "tracefp4")
        found = [(labels, v) for name, labels, v in read_file(tmp_path / "metrics.prom") if "accuracy_ratio" in name]
        return {labels["task"]: v for labels, v in found if labels["split"] == "train"}

    assert accuracy({"a": [1, 4], "b": [4, 4]}, {"a": [2, 4], "b": [2, 4]}) == {"all": 0.5, "a": 3 / 8, "b": 6 / 8}
    assert accuracy({"a": [1, 4]}, {"a": [3, 4]}) == {"all": 0.5}


def test_speed_figures_carry_the_machine_they_were_measured_on(tmp_path):
    """A cluster runs the rollout, compaction, train and evaluate steps on nodes of their own: each one's speed
    figures are labelled by its device and CPU bf16 mode (empty on a GPU, and where a history row does not say)."""
    from tracefp4.components.metrics import RECORDERS

    config, cpu = get_preset("smoke"), "cpu (AMD EPYC 7B13, 2 threads)"
    stats = {"rollout_tokens_per_second": 10.0, "rollout_tokens": 20, "rollout_seconds": 2.0}
    stats |= {"capture_overhead_ratio": None, "offload_seconds": None, "upload_seconds": None}
    compaction = {"guidance_bytes": 10, "capture_bytes": 40, "guidance_bits_per_element": 1.5, "compaction_ratio": 0.25}
    compaction |= {"compaction_fidelity": 0.97, "compaction_seconds": 0.1}
    rows = [{"train_seconds": 1.0, "logprob_abs_diff_max": 0.0}]
    evaluation = {"accuracy": [], "discrepancy": [], "throughput": [{"rollout": "bf16", **THROUGHPUT_FIGURES}]}
    published = {
        "rollout": stats | {"rollout_device": cpu, "rollout_cpu_bf16": "emulated"},
        "compaction": compaction | {"compaction_device": cpu, "compaction_cpu_bf16": "native"},
        "train": [rows[0] | {"train_device": "cuda:1 (NVIDIA H100 80GB HBM3)", "train_cpu_bf16": None}],
        "evaluate": evaluation
        | {"hardware": {"device": "cpu", "cpu": "Apple M2", "cpu_bf16": "native", "cpu_threads": 8}},
    }
    for component, figures in published.items():
        m = RunMetrics(pipeline="p", run_id="r1", method="trace", component=component, round=0)
        RECORDERS[component](m, figures, config)
        m.publish(tmp_path / "metrics.prom", None, "tracefp4")
    labels = {
        (labels["component"], name): (labels.get("device"), labels.get("cpu_bf16"))
        for name, labels, _ in read_file(tmp_path / "metrics.prom")
        if name in ("tracefp4_rollout_tokens_per_second", "tracefp4_compaction_seconds", "tracefp4_train_step_seconds")
    }
    assert labels == {
        ("rollout", "tracefp4_rollout_tokens_per_second"): (cpu, "emulated"),
        ("compaction", "tracefp4_compaction_seconds"): (cpu, "native"),
        ("train", "tracefp4_train_step_seconds"): ("cuda:1 (NVIDIA H100 80GB HBM3)", ""),  # a GPU's: none
        ("evaluate", "tracefp4_rollout_tokens_per_second"): ("cpu (Apple M2, 8 threads)", "native"),
    }
    m = RunMetrics(pipeline="p", run_id="r1", method="trace", component="train", round=1)
    RECORDERS["train"](m, rows, config)  # a row from before the machine was recorded
    assert [s.labels for f in m.registry.collect() for s in f.samples if s.name == "tracefp4_train_step_seconds"] == [
        {"device": "", "cpu_bf16": ""}
    ]


def test_a_rounds_train_step_seconds_name_every_machine_its_steps_ran_on():
    """A round resumed on another machine (a distributed trainer, from its checkpoint) has steps of each: the
    pushed seconds are their mean, and were labelled by the last step's machine alone. Each machine's
    cpu_bf16 stands where its device does in the other label (a GPU's none: "-")."""
    from tracefp4.components.metrics import _train

    h100, cpu, amx = "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu (AMD EPYC 7B13, 2 threads)", "cpu (Intel Xeon, 2 threads)"
    cases = [
        ([(4.0, cpu, "native"), (4.0, cpu, "native"), (1.0, h100, None)], f"{cpu}; {h100}", "native; -"),
        (
            [(1.0, h100, None), (4.0, cpu, "emulated"), (4.0, amx, "native")],
            f"{h100}; {cpu}; {amx}",
            "-; emulated; native",
        ),
        ([(1.0, h100, None), (2.0, h100, None)], h100, ""),  # a GPU's alone: none, as one step's label
    ]
    for steps, device, cpu_bf16 in cases:
        rows = [
            {"train_seconds": seconds, "logprob_abs_diff_max": 0.0, "train_device": device, "train_cpu_bf16": bf16}
            for seconds, device, bf16 in steps
        ]
        m = RunMetrics(pipeline="p", run_id="r1", method="trace", component="train", round=0)
        _train(m, rows, get_preset("smoke"))
        samples = [(s.labels, s.value) for f in m.registry.collect() for s in f.samples]
        mean = sum(seconds for seconds, *_ in steps) / len(steps)
        assert [sample for sample in samples if "device" in sample[0]] == [
            ({"device": device, "cpu_bf16": cpu_bf16}, mean)
        ]


THROUGHPUT_FIGURES = {"tokens_per_second": 5.0, "tokens": 10, "seconds": 2.0}


def test_aggregate_and_per_layer_series_never_share_a_name():
    for name, metric in METRICS.items():
        assert ("layer" in metric.labels) == name.startswith("tracefp4_layer_"), name
    m = _group(0)
    with pytest.raises(ValueError, match="takes labels"):
        m.set("tracefp4_code_mismatch_ratio", 0.1, rollout_config="fp4_wa_kv", layer="all")


def test_docs_list_every_metric():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    assert [name for name in METRICS if f"`{name}`" not in text] == []


def test_instant_panels_stay_filled_once_the_run_is_deleted_from_the_pushgateway(prometheus, pushed_run):
    """Last in this module: it deletes the pushed run's groups (as `tracefp4 delete-metrics` does)."""
    (run_id,) = {labels["run_id"] for _, labels, _ in read_file(pushed_run / "metrics.prom")}
    variables = {"pipeline": "metrics-smoke", "run_id": run_id, "method": "trace", "__range": "1h"}
    board = dashboard()
    targets = [t for panel in _walk(board["panels"]) for t in panel.get("targets", [])]
    queries = panel_queries(board, variables)
    instant = [  # but the alerts firing now, of which this run has none (test_alerts.py)
        query for t, (title, query) in zip(targets, queries, strict=True) if t.get("instant") and title != FIRING_ALERTS
    ]
    live = f'tracefp4_train_steps{{run_id="{run_id}"}}'
    assert prometheus.wait_for(live)
    assert delete_run(prometheus.pushgateway, "tracefp4", "metrics-smoke", run_id) == 5
    deadline = time.monotonic() + 20
    while prometheus.query(live) and time.monotonic() < deadline:  # stale after the next scrape
        time.sleep(0.5)
    assert not prometheus.query(live), "the deleted run's series never went stale"
    empty = [query for query in instant if not prometheus.query(query)]
    assert len(instant) >= 10 and not empty, f"instant panels blank after delete-metrics: {empty}"
