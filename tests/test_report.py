"""The run report from run artifacts: fixtures written in the producers' formats (history JSON lines, evaluation
JSON), then the markdown tables' rows, the HTML page's structure and its embedded plots."""

import base64
import json
import random
from html.parser import HTMLParser

import pytest

from tracefp4.components import report
from tracefp4.components.stats import accuracy_row
from tracefp4.schemas.presets import get_preset

TRACE = get_preset("smoke")  # run smoke, method trace, rollout fp4_wa_kv
BF16 = TRACE.model_copy(update={"method": "bf16"})
SECTIONS = (
    "Accuracy: method x task",
    "Rollout configuration ablation",
    "Guidance sensitivity: R-k bits x layers",
    "PTQ baselines vs training",
    "Train-rollout discrepancy",
    "Training, per RL step",
    "Time breakdown per round",
)
RUN_PLOTS = {
    "Train-rollout log-prob |diff|",
    "Reward and accuracy",
    "Relative excess MSE per layer",
    "Codeword-difference histogram",
    "Time breakdown per round",
}


def history(method: str, captures: bool, drift: float = 1.0) -> list[dict]:
    """2 rounds x 2 steps; round-level keys repeated in each row of the round; capture keys null without captures;
    `drift` scales the train-rollout log-prob |diff| of the later steps."""
    rounds = [
        {
            "rollout_seconds": 12.0,
            "rollout_tokens": 4000,
            "rollout_tokens_per_second": 333.0,
            "offload_seconds": 0.4,
            "upload_seconds": 0.2,
            "compaction_seconds": 0.1,
            "guidance_bytes": 12345,
            "capture_bytes": 40000,
            "compaction_fidelity": 0.97,
            "capture_overhead_ratio": 0.03,
        },
        {
            "rollout_seconds": 11.0,
            "rollout_tokens": 4200,
            "rollout_tokens_per_second": 381.8,
            "offload_seconds": 0.5,
            "upload_seconds": 0.25,
            "compaction_seconds": 0.15,
            "guidance_bytes": 12000,
            "capture_bytes": 41000,
            "compaction_fidelity": 0.96,
            "capture_overhead_ratio": 0.04,
        },
    ]
    steps = [  # reward, accuracy, |diff| mean/max/min, k3, coverage, train s, reload s
        (0.31, 0.25, 0.02, 0.9, 0.0, 0.001, 0.98, 3.1, 0.01),
        (0.35, 0.3, 0.025, 0.8, 0.0, 0.0012, 0.97, 2.9, 0.02),
        (0.4, 0.35, 0.03, 0.7, 0.001, 0.0015, 0.99, 3.0, 0.01),
        (0.45, 0.4, 0.028, 0.75, 0.0, 0.0013, 0.99, 3.2, 0.01),
    ]
    rows = []
    for i, (reward, acc, mean, high, low, k3, coverage, train, reload) in enumerate(steps):
        mean, high = (mean * drift, high * drift) if i >= 2 else (mean, high)
        row = {
            "method": method,
            "round": i // 2,
            "step": i + 1,
            "reward_mean": reward,
            "accuracy": acc,
            "loss": 0.1,
            "logprob_abs_diff_mean": mean,
            "logprob_abs_diff_max": high,
            "logprob_abs_diff_min": low,
            "k3_kl": k3,
            "guidance_coverage": coverage,
            "train_seconds": train,
            "reload_seconds": reload,
            **rounds[i // 2],
        }
        if not captures:
            row |= {
                k: None
                for k in (
                    "guidance_coverage",
                    "guidance_bytes",
                    "capture_bytes",
                    "compaction_fidelity",
                    "upload_seconds",
                    "compaction_seconds",
                    "offload_seconds",
                    "capture_overhead_ratio",
                )
            }
            del row["guidance_coverage"]  # missing, not only null
        rows.append(row)
    return rows


def accuracy(method: str, policy: str, rollout: str, arithmetic: tuple, countdown: tuple) -> list[dict]:
    return [
        {
            "method": method,
            "policy": policy,
            "rollout": rollout,
            "task": task,
            "pass@1": p,
            "mean@k": m,
            "k": 2,
            "prompts": 16,
        }
        for task, (p, m) in (("arithmetic", arithmetic), ("countdown", countdown))
    ]


THROUGHPUT = [
    {"rollout": "bf16", "tokens": 1234, "seconds": 2.1, "tokens_per_second": 587.0},
    {"rollout": "fp4_wa_kv", "tokens": 1300, "seconds": 1.3, "tokens_per_second": 1000.0},
]
TRACE_EVALUATION = {
    "method": "trace",
    "accuracy": accuracy("trace", "trained", "bf16", (0.5, 0.45), (0.7, 0.6))
    + accuracy("trace", "trained", "fp4_wa_kv", (0.4, 0.3), (0.6, 0.5)),
    "throughput": THROUGHPUT,
    "discrepancy": [
        {
            "rollout": "fp4_wa_kv",
            "trajectories": 32,
            "code_mismatch": 0.3,
            "code_mismatch_by_layer": {"0": 0.2, "1": 0.31},
            "relative_excess_mse_by_layer": {"0": 1.2, "1": 0.8},
            "codeword_diff_hist": {"1": 1000, "2": 3},
            "logprob_abs_diff_mean": 0.02,
            "logprob_abs_diff_max": 0.5,
            "k3_kl": 0.001,
        }
    ],
    "guidance_sensitivity": [
        {
            "bits": b,
            "layers": n,
            "layer_indices": [1] if n == 1 else [0, 1],
            "bits_per_element": b + 0.25,
            "ratio_to_full": (b + 0.25) / 4.25,
            "fidelity": round(0.85 + 0.03 * b + 0.01 * n, 4),
        }
        for b in (1, 2, 3, 4)
        for n in (1, 2)
    ],
}
BF16_EVALUATION = {
    "method": "bf16",
    "accuracy": accuracy("bf16", "trained", "bf16", (0.55, 0.5), (0.75, 0.7))
    + accuracy("bf16", "trained", "fp4_wa_kv", (0.35, 0.3), (0.45, 0.4))
    + accuracy("bf16", "ptq:nvfp4", "fp4_wa_kv", (0.38, 0.33), (0.5, 0.45))
    + accuracy("bf16", "ptq:four_over_six", "fp4_wa_kv", (0.4, 0.35), (0.52, 0.47))
    + accuracy("bf16", "ptq:h_scale", "fp4_wa_kv", (0.42, 0.37), (0.54, 0.49)),
    "throughput": THROUGHPUT,
    "discrepancy": [
        {
            "rollout": "fp4_wa_kv",
            "trajectories": 32,
            "code_mismatch": None,
            "code_mismatch_by_layer": {},
            "relative_excess_mse_by_layer": {},
            "codeword_diff_hist": {},
            "logprob_abs_diff_mean": 0.05,
            "logprob_abs_diff_max": 1.2,
            "k3_kl": 0.004,
        }
    ],
    "guidance_sensitivity": [],
}


def write(tmp_path, name: str, rows: list[dict], evaluation: dict):
    (tmp_path / f"{name}.history").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / f"{name}.evaluation").write_text(json.dumps(evaluation))
    return tmp_path / f"{name}.history", tmp_path / f"{name}.evaluation"


@pytest.fixture
def trace_files(tmp_path):
    return write(tmp_path, "trace", history("trace", True), TRACE_EVALUATION)


@pytest.fixture
def bf16_files(tmp_path):
    return write(tmp_path, "bf16", history("bf16", False, drift=2.0), BF16_EVALUATION)


def section(text: str, title: str) -> str:
    """The markdown from heading `## title` to the next `## ` heading."""
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def rows(text: str) -> list[list[str]]:
    """Cells of every markdown table row in `text` (header rows included, separators not)."""
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines() if line.startswith("| ")]


class Page(HTMLParser):
    def __init__(self, text: str):
        super().__init__()
        self.images, self.tables, self.captions, self.sources, self.links = [], [], [], [], []
        self.stack, self.text = [], []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in ("meta", "img", "br"):  # void elements have no end tag
            self.stack.append((tag, attrs))
        self.links += [attrs[k] for k in ("src", "href") if k in attrs]
        if tag == "img":
            self.images.append(attrs)
        elif tag == "table":
            self.tables.append({"headers": [], "rows": 0})
        elif tag == "tr" and self.stack[-2][0] == "tbody":
            self.tables[-1]["rows"] += 1
        self.text = []

    def handle_data(self, data):
        self.text.append(data)

    def handle_endtag(self, tag):
        opened, attrs = self.stack.pop()
        assert opened == tag, f"<{opened}> closed by </{tag}>"
        text = "".join(self.text)
        if tag == "th":
            self.tables[-1]["headers"].append(text)
        elif tag == "figcaption":
            self.captions.append(text)
        elif tag == "p" and attrs.get("class") == "source":
            self.sources.append(text)


def png_alts(page: Page) -> set[str]:
    for image in page.images:
        assert image["src"].startswith("data:image/png;base64,")
        assert base64.b64decode(image["src"].split(",", 1)[1], validate=True).startswith(b"\x89PNG\r\n\x1a\n")
    return {image["alt"] for image in page.images}


def test_markdown_has_the_papers_tables_with_the_fixture_numbers(trace_files):
    text = report.markdown(TRACE, *trace_files)
    assert text.startswith("# tracefp4 run `smoke`") and "run `smoke`: method `trace`, rollout `fp4_wa_kv`" in text
    for title in SECTIONS:
        assert (f"## {title}\n" in text) == (title != "PTQ baselines vs training")  # no PTQ rows for a trace run
    accuracy_rows = rows(section(text, "Accuracy: method x task"))
    assert accuracy_rows[0] == [
        "method",
        "policy",
        "rollout",
        "arithmetic pass@1",
        "arithmetic mean@k",
        "countdown pass@1",
        "countdown mean@k",
        "avg pass@1",
        "avg mean@k",
    ]
    assert accuracy_rows[1:] == [  # bf16 rollout first, as in the paper
        ["trace", "trained", "bf16", "0.5", "0.45", "0.7", "0.6", "0.6", "0.525"],
        ["trace", "trained", "fp4_wa_kv", "0.4", "0.3", "0.6", "0.5", "0.5", "0.4"],
    ]
    ablation = rows(section(text, "Rollout configuration ablation"))
    assert ablation[0] == [
        "rollout",
        "arithmetic pass@1",
        "countdown pass@1",
        "avg pass@1",
        "tokens/s",
        "tokens/s vs bf16",
        "code mismatch",
        "logprob \\|diff\\| mean",
        "logprob \\|diff\\| max",
        "k3 KL",
    ]
    assert ablation[1] == ["bf16", "0.5", "0.7", "0.6", "587", "1", "-", "-", "-", "-"]
    assert ablation[2] == ["fp4_wa_kv", "0.4", "0.6", "0.5", "1000", "1.704", "0.3", "0.02", "0.5", "0.001"]
    assert "each config's FP4 in nvfp4 (rollout.fmt)" in section(text, "Rollout configuration ablation")
    sensitivity = rows(section(text, "Guidance sensitivity: R-k bits x layers"))
    assert sensitivity[0] == ["guidance", "L1 fidelity", "L1 bits/element", "L2 fidelity", "L2 bits/element"]
    assert [r[0] for r in sensitivity[1:]] == ["R-1bit", "R-2bit", "R-3bit", "R-4bit"]
    assert sensitivity[1] == ["R-1bit", "0.89", "1.25", "0.9", "1.25"] and sensitivity[4] == [
        "R-4bit",
        "0.98",
        "4.25",
        "0.99",
        "4.25",
    ]
    discrepancy = section(text, "Train-rollout discrepancy")
    assert ["fp4_wa_kv", "32", "0.3", "0.02", "0.5", "0.001"] in rows(discrepancy)
    per_layer = rows(discrepancy.split("**Per layer, `fp4_wa_kv`**", 1)[1].split("**", 1)[0])
    assert per_layer == [["layer", "code mismatch", "relative excess MSE"], ["0", "0.2", "1.2"], ["1", "0.31", "0.8"]]
    histogram = rows(discrepancy.split("**Codeword-difference histogram, `fp4_wa_kv`**", 1)[1])
    assert histogram == [["codeword difference", "count", "share"], ["1", "1000", "0.997"], ["2", "3", "0.002991"]]
    steps = rows(section(text, "Training, per RL step"))
    assert steps[0] == list(report.STEP_COLUMNS) and len(steps) == 5
    assert steps[1] == ["0", "1", "0.31", "0.25", "0.02", "0.9", "0.001", "0.98", "3.1"]
    times = section(text, "Time breakdown per round")
    assert rows(times)[0][:8] == [
        "round",
        "steps",
        "rollout s",
        "upload s",
        "compaction s",
        "train s",
        "reload s",
        "total s",
    ]
    # rollout, upload, compaction per round; train and reload summed over the round's two steps
    assert ["0", "2", "12", "0.2", "0.1", "6", "0.03", "18.33", "0.4", "4000", "333", "0.03"] in rows(times)
    assert ["1", "2", "11", "0.25", "0.15", "6.2", "0.02", "17.62", "0.5", "4200", "381.8", "0.04"] in rows(times)
    assert ["0", "12345", "40000", "0.97", "0.975"] in rows(times)  # guidance data per round, coverage averaged
    assert text.count("Source: run `smoke`: method `trace`") == sum(
        line.startswith("|---|") for line in text.splitlines()
    )  # every table names its run


def test_markdown_of_a_bf16_run_compares_ptq_baselines_and_skips_absent_data(bf16_files):
    text = report.markdown(BF16, *bf16_files)
    assert "## Guidance sensitivity" not in text  # no sensitivity rows
    ptq = rows(section(text, "PTQ baselines vs training"))
    assert ptq[0] == [
        "method",
        "policy",
        "rollout",
        "arithmetic pass@1",
        "countdown pass@1",
        "avg pass@1",
        "avg pass@1 vs trained",
    ]
    assert [r[1] for r in ptq[1:]] == [
        "ptq:nvfp4",
        "ptq:four_over_six",
        "ptq:h_scale",
        "trained",
    ]  # baselines, then training
    assert ptq[3] == ["bf16", "ptq:h_scale", "fp4_wa_kv", "0.42", "0.54", "0.48", "0.08"]
    assert ptq[4] == ["bf16", "trained", "fp4_wa_kv", "0.35", "0.45", "0.4", "0"]
    assert len(rows(section(text, "Accuracy: method x task"))) == 1 + 5  # trained x 2 rollouts + 3 PTQ schemes
    discrepancy = section(text, "Train-rollout discrepancy")
    assert "does not quantize" in discrepancy and "Per layer" not in discrepancy
    assert rows(discrepancy)[1] == [
        "fp4_wa_kv",
        "32",
        "0.05",
        "1.2",
        "0.004",
    ]  # code mismatch: null, its column left out
    times = section(text, "Time breakdown per round")
    assert rows(times)[0] == [
        "round",
        "steps",
        "rollout s",
        "train s",
        "reload s",
        "total s",
        "rollout tokens",
        "rollout tokens/s",
    ]
    assert "Guidance data per round" not in times  # no guidance, no capture: the table is left out
    assert "guidance_coverage" not in rows(section(text, "Training, per RL step"))[0]


def test_html_is_self_contained_with_every_plot_embedded(trace_files):
    page = Page(report.html_report(TRACE, *trace_files))
    assert png_alts(page) == RUN_PLOTS and len(page.images) == len(RUN_PLOTS)
    assert not [link for link in page.links if "http" in link]
    assert len(page.captions) == len(RUN_PLOTS) and all(
        "run smoke: method trace, rollout fp4_wa_kv" in c for c in page.captions
    )
    assert len(page.sources) == len(page.tables) == 9 and all("run smoke: method trace" in s for s in page.sources)
    headers = [t["headers"] for t in page.tables]
    accuracy = next(t for t in page.tables if t["headers"][:3] == ["method", "policy", "rollout"])
    assert accuracy["rows"] == 2 and "avg pass@1" in accuracy["headers"]
    assert ["layer", "code mismatch", "relative excess MSE"] in headers
    assert next(t for t in page.tables if t["headers"] == list(report.STEP_COLUMNS))["rows"] == 4
    assert next(t for t in page.tables if t["headers"][:2] == ["round", "steps"])["rows"] == 2
    caption = next(c for c in page.captions if c.startswith("Train-rollout log-prob |diff|."))
    assert "Series: mean, max, min." in caption


def test_html_leaves_out_plots_without_data(bf16_files, tmp_path):
    page = Page(report.html_report(BF16, *bf16_files))  # training path does not quantize: no per-layer data
    assert png_alts(page) == RUN_PLOTS - {"Relative excess MSE per layer", "Codeword-difference histogram"}
    no_discrepancy = BF16_EVALUATION | {"discrepancy": [], "throughput": []}
    page = Page(report.html_report(BF16, *write(tmp_path, "none", history("bf16", False), no_discrepancy)))
    assert "Relative excess MSE per layer" not in png_alts(page)


def test_an_empty_history_does_not_crash(tmp_path):
    files = write(tmp_path, "empty", [], TRACE_EVALUATION)
    text = report.markdown(TRACE, *files)
    assert (
        "RL steps: 0, rounds: 0;" in text and section(text, "Training, per RL step").strip() == "No RL steps recorded."
    )
    page = Page(report.html_report(TRACE, *files))
    assert png_alts(page) == {"Relative excess MSE per layer", "Codeword-difference histogram"}
    assert report.load(*files) == ([], TRACE_EVALUATION)


def test_a_chained_run_says_its_last_task_submits_the_next(trace_files):
    from tracefp4.schemas import continuation

    settings = {"method": "trace", **continuation("s3://runs/p", "s3://runs/s", 2)}
    chained = TRACE.model_copy(update={"rl": TRACE.rl.model_copy(update={"rounds": 5, "rounds_per_run": 2})})
    text = section(report.markdown(chained, *trace_files, settings), "Continue this run")
    assert "`chain`, submits that run for the 3 rounds left" in text and "first_round: 2" in text
    assert "`chain`" not in report.markdown(TRACE, *trace_files, settings)


def test_the_report_says_the_settings_it_ran_with_as_a_config_file_that_asks_for_them(tmp_path, trace_files):
    """Two reports of one preset read alike, whatever `--set` changed: the settings that differ from the
    schema's defaults, as a file `--config` reads back to the same config (a task list whole)."""
    from tracefp4.schemas import load_config

    sets = {"rl.learning_rate": 0.002, "tasks.0.train_size": 40, "store.uri": f"file://{tmp_path}/store"}
    config = load_config(None, preset="smoke", overrides=sets)
    text = section(report.markdown(config, *trace_files), "Settings")
    settings = tmp_path / "settings.yaml"
    settings.write_text(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert load_config(settings) == config
    assert "learning_rate: 0.002" in text and "train_size: 40" in text and "model_copy" not in text
    assert "learning_rate" not in section(report.markdown(TRACE, *trace_files), "Settings")  # the default's
    comparison = report.comparison(config, [TRACE_EVALUATION], [])
    assert "\nmethod: " not in section(comparison, "Settings") and "learning_rate: 0.002" in comparison


def test_a_run_whose_policies_solve_nothing_says_its_accuracies_say_nothing(tmp_path, trace_files):
    unsolved = {**TRACE_EVALUATION, "accuracy": accuracy("trace", "trained", "bf16", (0.0, 0.0), (0.0, 0.0))}
    text = section(report.markdown(TRACE, *write(tmp_path, "none", [], unsolved)), "Accuracy: method x task")
    assert "No policy solved a test prompt: the accuracies and their comparisons say nothing" in text
    assert "No policy solved" not in report.markdown(TRACE, *trace_files)


def test_a_continuations_report_says_what_it_goes_on_from(trace_files):
    model = TRACE.model.model_copy(update={"preset": None, "checkpoint": "s3://runs/p", "trainer_state": "s3://runs/s"})
    later = TRACE.model_copy(update={"model": model, "rl": TRACE.rl.model_copy(update={"first_round": 2})})
    head = report.markdown(later, *trace_files).split("## ")[0]
    assert (
        "A continuation: rounds from 2 (counted from the first run's first), going on from the policy `s3://runs/p`"
        in (head)
    )
    assert "A continuation" not in report.markdown(TRACE, *trace_files)


def test_a_run_that_leaves_out_its_initial_policy_says_so(tmp_path):
    later = TRACE.model_copy(update={"evaluation": TRACE.evaluation.model_copy(update={"initial": False})})
    files = write(tmp_path, "later", [], TRACE_EVALUATION)  # trained rows alone
    assert {r["policy"] for r in TRACE_EVALUATION["accuracy"]} == {"trained"}
    text = section(report.markdown(later, *files), "RL gain: trained vs initial policy")
    assert "Not measured here: this run leaves out the policy it started from" in text
    assert "RL gain" not in report.markdown(TRACE, *files)  # nothing to pair, and nothing left out


def test_comparison_has_one_row_per_method_policy_and_one_line_per_method(trace_files, bf16_files):
    histories = [report.load(*trace_files)[0], report.load(*bf16_files)[0]]
    evaluations = [TRACE_EVALUATION, BF16_EVALUATION]
    text = report.comparison(TRACE, evaluations, histories)
    assert text.startswith("# tracefp4 comparison `smoke`")
    assert "- run `smoke`: method `trace`," in text and "- run `smoke`: method `bf16`," in text  # each method's run
    assert "\ntasks: arithmetic.\n" in text  # what the methods trained and were evaluated on
    table = rows(section(text, "Accuracy: method x task"))[1:]
    keys = [tuple(r[:3]) for r in table]
    assert len(keys) == len(set(keys)) == 7  # (method, policy, rollout), PTQ rows included
    assert {k[:2] for k in keys} == {
        ("trace", "trained"),
        ("bf16", "trained"),
        ("bf16", "ptq:nvfp4"),
        ("bf16", "ptq:four_over_six"),
        ("bf16", "ptq:h_scale"),
    }
    assert ["trace", "trained", "fp4_wa_kv", "0.4", "0.3", "0.6", "0.5", "0.5", "0.4"] in table
    diffs = rows(section(text, "FP4 train-rollout log-prob |diff| per method"))
    assert diffs[1:] == [
        ["trace", "fp4_wa_kv", "32", "0.3", "0.02", "0.5", "0.001"],
        ["bf16", "fp4_wa_kv", "32", "-", "0.05", "1.2", "0.004"],
    ]
    training = rows(section(text, "Training per method"))
    assert training[0][:4] == ["method", "steps", "train accuracy (last, sampled)", "reward_mean (last)"]
    assert training[1][:2] == ["trace", "4"] and training[1][4:6] == ["0.028", "0.9"]
    assert training[2][:2] == ["bf16", "4"] and training[2][4:6] == ["0.056", "1.5"]  # drifted: 0.75 x 2 > 0.9
    assert "Source: run `smoke`: methods `trace`, `bf16`" in text

    page = Page(report.comparison_html(TRACE, evaluations, histories))
    assert png_alts(page) == {
        "Train-rollout log-prob |diff| per method",
        "Train accuracy per method",
        "Reward per method",
    }
    assert not [link for link in page.links if "http" in link]
    diff_caption = next(c for c in page.captions if c.startswith("Train-rollout log-prob |diff| per method."))
    assert "Series: trace, bf16." in diff_caption and "methods trace, bf16" in diff_caption  # one line per method
    assert next(t for t in page.tables if t["headers"][:3] == ["method", "policy", "rollout"])["rows"] == 7
    empty = report.comparison_html(TRACE, evaluations, [[], []])  # no training histories: tables, no plots
    assert Page(empty).images == []


def test_the_report_says_where_the_evaluation_computed(tmp_path):
    """Throughput and the train-rollout figures depend on the machine: the
    report names it, and where the CPU emulates bf16 (training and rollout
    then round alike), says what that does to the discrepancy."""
    cpu = {"device": "cpu", "cpu": "AMD EPYC 7B13", "cpu_bf16": "emulated", "cpu_threads": 2}
    gpu = {"device": "cuda:0", "gpu": "NVIDIA H200"}
    emulated = write(tmp_path, "emulated", [], TRACE_EVALUATION | {"hardware": cpu})
    text = report.markdown(TRACE, *emulated)
    line = next(line for line in text.splitlines() if line.startswith("Evaluated on"))
    assert line.startswith("Evaluated on cpu (AMD EPYC 7B13, 2 threads), bf16 emulated. This CPU runs bf16")
    assert "`TRACEFP4_CPU_BF16=native`" in line
    assert text.index(line) < text.index("## Accuracy")  # in the header, before the figures
    native = write(tmp_path, "native", [], TRACE_EVALUATION | {"hardware": cpu | {"cpu_bf16": "native"}})
    assert "Evaluated on cpu (AMD EPYC 7B13, 2 threads), bf16 native.\n" in report.markdown(TRACE, *native)
    assert "Evaluated on" not in report.markdown(TRACE, *write(tmp_path, "old", [], TRACE_EVALUATION))
    comparison = report.comparison(
        TRACE, [TRACE_EVALUATION | {"hardware": gpu}, BF16_EVALUATION | {"hardware": gpu}, BF16_EVALUATION], [[]]
    )
    assert [line for line in comparison.splitlines() if line.startswith("Evaluated")] == [
        "Evaluated on cuda:0 (NVIDIA H200)."  # once for the two evaluations on the same machine
    ]


H100 = "cuda:0 (NVIDIA H100 80GB HBM3)"


def on(step: str, device: str, cpu_bf16: str | None = None) -> dict:
    """History keys saying where ``step`` (rollout, compaction, train) measured its figures (steps.py,
    device.measured_on)."""
    return {f"{step}_device": device, f"{step}_cpu_bf16": cpu_bf16}


def test_the_report_says_where_each_step_measured_its_speed(tmp_path):
    """A cluster runs each step on a node of its own, not the evaluation's:
    the throughput and seconds per round name the machine they were measured
    on (with the CPU's bf16 mode), once in the note where every row shares it,
    per row where not."""
    same = [row | on("rollout", H100) | on("train", H100) for row in history("trace", True)]
    text = report.markdown(TRACE, *write(tmp_path, "same", same, TRACE_EVALUATION))
    times, steps = section(text, "Time breakdown per round"), section(text, "Training, per RL step")
    assert f"Rollout and training measured on {H100}. Source:" in times
    assert "rollout on" not in rows(times)[0] and "train on" not in rows(times)[0]
    assert f" Training measured on {H100}. Source:" in steps and "train on" not in rows(steps)[0]

    cpus = ["cpu (AMD EPYC 7B13, 2 threads)", "cpu (Intel(R) Xeon(R) Platinum 8481C, 2 threads)"]
    mixed = [
        row | on("rollout", cpus[row["round"]], ("emulated", "native")[row["round"]]) | on("train", H100)
        for row in history("trace", True)
    ]
    text = report.markdown(TRACE, *write(tmp_path, "mixed", mixed, TRACE_EVALUATION))
    times, steps = section(text, "Time breakdown per round"), section(text, "Training, per RL step")
    header, *by_round = rows(times)[:3]
    assert header[-1] == "rollout on" and "train on" not in header
    assert [r[-1] for r in by_round] == [f"{cpus[0]}, bf16 emulated", f"{cpus[1]}, bf16 native"]
    assert f"Training measured on {H100}. Source:" in times and "Rollout and training" not in times
    assert f"Training measured on {H100}." in steps

    text = report.markdown(TRACE, *write(tmp_path, "old", history("trace", True), TRACE_EVALUATION))
    assert "measured on" not in text and "rollout on" not in text  # a history from before: nothing said


def test_the_report_says_where_the_compaction_measured_its_seconds(tmp_path):
    """The compaction step runs on a node of its own too: the time breakdown
    names its machine with the steps that share it, or apart, or per round."""
    cpu = "cpu (AMD EPYC 7B13, 2 threads)"

    def times(compaction) -> str:
        """The time breakdown of rows whose rollout and training ran on an H100, compaction on ``compaction(row)``."""
        rows_ = [row | on("rollout", H100) | compaction(row) | on("train", H100) for row in history("trace", True)]
        return section(
            report.markdown(TRACE, *write(tmp_path, "h", rows_, TRACE_EVALUATION)), "Time breakdown per round"
        )

    same = times(lambda row: on("compaction", H100))
    assert f"Rollout, compaction and training measured on {H100}. Source:" in same
    assert "compaction on" not in rows(same)[0]
    apart = times(lambda row: on("compaction", cpu, "native"))
    assert f"Rollout and training measured on {H100}. Compaction measured on {cpu}, bf16 native. Source:" in apart
    per_round = times(lambda row: on("compaction", (H100, cpu)[row["round"]], (None, "native")[row["round"]]))
    header, *by_round = rows(per_round)[:3]
    assert header[-1] == "compaction on" and [r[-1] for r in by_round] == [H100, f"{cpu}, bf16 native"]
    assert f"Rollout and training measured on {H100}. Source:" in per_round


def test_rows_with_missing_or_null_keys_skip_cells_not_the_report(tmp_path):
    sparse = [{"step": 1}, {"round": 0}, {}, {"round": 1, "step": 4, "logprob_abs_diff_max": None, "reward_mean": 0.2}]
    evaluation = {
        "accuracy": [{"task": "arithmetic"}],
        "throughput": [{"rollout": "bf16"}],
        "discrepancy": [{"rollout": "fp4_kv", "codeword_diff_hist": None, "relative_excess_mse_by_layer": {"3": 1.0}}],
        "guidance_sensitivity": [{"bits": 1}],
    }
    files = write(tmp_path, "sparse", sparse, evaluation)
    text = report.markdown(TRACE, *files)
    assert rows(section(text, "Training, per RL step"))[0] == ["round", "step", "reward_mean"]
    assert "## Guidance sensitivity" not in text  # no layer count: no cell to put it in
    discrepancy = rows(section(text, "Train-rollout discrepancy"))
    assert discrepancy == [["rollout"], ["fp4_kv"], ["layer", "relative excess MSE"], ["3", "1"]]  # no empty histogram
    # ... but a line saying why there is none, and what the MSE column's -1 and - mean
    text_discrepancy = section(text, "Train-rollout discrepancy")
    assert "No code differs between the two paths under `fp4_kv`: no codeword-difference histogram." in text_discrepancy
    assert "-1 where the FP4 values agree exactly, - where the values before quantization do" in text_discrepancy
    page = Page(report.html_report(TRACE, *files))
    assert png_alts(page) == {"Reward and accuracy", "Relative excess MSE per layer"}
    Page(report.comparison_html(TRACE, [evaluation, {}], [sparse]))  # fewer histories than evaluations


def scored(method: str, policy: str, p: float, seed: int) -> list[dict]:
    """Accuracy rows as the evaluation writes them (per-prompt scores, Wilson interval), 400 prompts per task."""
    rng = random.Random(seed)
    prompts = [f"{i} + {i} =" for i in range(400)]
    out = []
    for task in ("arithmetic", "countdown"):
        greedy = [float(rng.random() < p) for _ in prompts]
        row = accuracy_row(task, prompts, greedy, greedy, k=1)
        out.append({"method": method, "policy": policy, "rollout": "fp4_wa_kv", **row})
    return out


def test_accuracy_has_wilson_intervals_and_pairs_methods_and_policies(tmp_path):
    trace = {"method": "trace", "accuracy": scored("trace", "trained", 0.6, 1) + scored("trace", "initial", 0.3, 2)}
    files = write(tmp_path, "scored", [], trace)
    text = report.markdown(TRACE, *files)
    accuracy = rows(section(text, "Accuracy: method x task"))
    assert accuracy[0][3:6] == ["arithmetic pass@1", "arithmetic pass@1 95% CI", "arithmetic mean@k"]
    low, high = trace["accuracy"][0]["pass@1_ci95"]
    assert accuracy[2][4] == f"[{low:.3f}, {high:.3f}]"  # trained after initial
    gain = rows(section(text, "RL gain: trained vs initial policy"))
    assert gain[0] == ["rollout", "task", "a", "b", "pass@1 a - b", "95% CI", "prompts", "verdict"]
    assert [r[2:4] + r[6:] for r in gain[1:]] == [["trained", "initial", "400", "a > b"]] * 2

    qat = {"method": "qat", "accuracy": scored("qat", "trained", 0.6, 1)}
    for row in qat["accuracy"]:  # trace's scores with a right and a wrong answer swapped: not separated
        greedy = row["pass@1_per_prompt"]
        right, wrong = greedy.index(1.0), greedy.index(0.0)
        greedy[right], greedy[wrong] = 0.0, 1.0
    text = report.comparison(TRACE, [trace, qat], [[], []])
    paired = rows(section(text, "Paired differences between methods"))
    assert [r[2:4] for r in paired[1:]] == [["trace", "qat"]] * 2 and {r[-1] for r in paired[1:]} == {"not separated"}
    assert "'alike'" not in section(text, "Paired differences between methods")


def test_policies_that_scored_every_prompt_alike_are_said_so_not_given_an_interval_of_0(tmp_path):
    """Every paired difference 0 gives the bootstrap interval [0.000, 0.000],
    which read as a broken measurement: the row says no prompt differs."""
    alike = scored("trace", "trained", 0.6, 1) + scored("trace", "initial", 0.6, 1)  # the same scores
    text = report.markdown(TRACE, *write(tmp_path, "alike", [], {"method": "trace", "accuracy": alike}))
    gain = section(text, "RL gain: trained vs initial policy")
    assert [r[4:] for r in rows(gain)[1:]] == [["0", "none: no prompt differs", "400", "alike"]] * 2
    assert "[0.000, 0.000]" not in gain
    assert "'alike': a and b scored every prompt the same (each right under both or wrong under both)" in gain
    qat = {"method": "qat", "accuracy": scored("qat", "trained", 0.6, 1)}  # methods too
    text = report.comparison(TRACE, [{"method": "trace", "accuracy": alike[:2]}, qat], [[], []])
    paired = rows(section(text, "Paired differences between methods"))
    assert {r[-1] for r in paired[1:]} == {"alike"}


@pytest.mark.parametrize(
    "layers, words",
    [
        ("all", "every layer with FP4 sites"),
        (1, "the deepest 1 layer with"),
        (2, "the deepest 2 layers"),
        ([0, 3], "layers [0, 3]"),
    ],
)
def test_the_runs_line_says_which_layers_are_guided_in_words(layers, words):
    """`guidance.layers` is 'all', a count of the deepest, or indices: "layers `2`" would read as layer 2."""
    config = TRACE.model_copy(update={"guidance": TRACE.guidance.model_copy(update={"layers": layers})})
    assert f"guidance R-1bit on {words}" in report.describe(config)


def test_the_runs_line_names_guidance_where_a_run_is_guided_and_the_bootstrap_where_there_was_one():
    """A qat or bf16 run has no guidance, and a comparison guides its trace
    run alone; 'after bootstrap' only where the run had one."""
    qat = TRACE.model_copy(update={"method": "qat"})
    assert "guid" not in report.describe(qat)
    assert "`trace` guided R-1bit" in report.describe(TRACE, ["trace", "qat"])
    assert "guid" not in report.describe(TRACE, ["qat", "bf16"])
    row = {"method": "qat", "policy": "initial", "rollout": "bf16", "task": "arithmetic", "pass@1": 0.5}
    assert "(after bootstrap)" in report._accuracy_table([row], "x", True).note
    assert "(after bootstrap)" not in report._accuracy_table([row], "x", False).note


def test_the_step_table_says_what_each_column_is_and_shows_0_1_rewards_once(tmp_path, trace_files):
    """The per-step table's columns are history keys: its caption names each
    in words. Where the mean reward equals the accuracy at every step (0/1
    rewards) one column shows both, and its caption says so."""
    steps = section(report.markdown(TRACE, *trace_files), "Training, per RL step")
    assert rows(steps)[0] == list(report.STEP_COLUMNS)  # the fixture's rewards are not its accuracies
    caption = next(line for line in steps.splitlines() if line.startswith("_round: "))
    for column in report.STEP_COLUMNS:
        assert f"{column}: {report.STEP_WORDS[column]}" in caption
    assert "every reward was 0 or 1" not in caption and "staleness" not in caption  # one step a round: nothing stale

    binary = [row | {"accuracy": row["reward_mean"]} for row in history("trace", True)]
    text = report.markdown(TRACE, *write(tmp_path, "binary", binary, TRACE_EVALUATION))
    steps = section(text, "Training, per RL step")
    assert rows(steps)[0] == [c for c in report.STEP_COLUMNS if c != "accuracy"]
    assert "which equals the share of them solved (accuracy) at every step: every reward was 0 or 1" in steps
    assert [json.loads(line) for line in (tmp_path / "binary.history").read_text().splitlines()] == binary
    page = Page(report.html_report(TRACE, *write(tmp_path, "binary", binary, TRACE_EVALUATION)))
    reward = next(c for c in page.captions if c.startswith("Reward and accuracy."))
    assert "Series: reward mean = train accuracy (sampled)." in reward  # one line, not two on top of each other
    # a mix of tasks: each one's accuracy beside the mix's, over the steps that drew it
    mixed = [
        row | {"task_solved": {"sums": [1, 4], "bench": [3, 4]} if i else {"sums": [2, 8]}}
        for i, row in enumerate(binary)
    ]
    page = Page(report.html_report(TRACE, *write(tmp_path, "mixed", mixed, TRACE_EVALUATION)))
    reward = next(c for c in page.captions if c.startswith("Reward and accuracy."))
    assert "sums train accuracy (sampled), bench train accuracy (sampled)." in reward
    # and in the per-step table, which the markdown report and the terminal show too
    markdown = report.markdown(TRACE, *write(tmp_path, "mixed", mixed, TRACE_EVALUATION))
    header = next(line for line in markdown.splitlines() if line.startswith("| round | step |"))
    assert "| reward_mean | sums accuracy | bench accuracy | logprob_abs_diff_mean |" in header
    assert "sums accuracy: share of the step's responses to sums problems solved; bench accuracy: " in markdown


def test_the_comparison_shows_0_1_rewards_once_where_every_method_has_them():
    """The comparison's training table follows the per-step table's rule: where
    every method's mean reward equals its accuracy at every step, one column
    (and one plot) shows both; where one method's rewards are not its
    accuracies, both columns stay."""
    binary = [[row | {"accuracy": row["reward_mean"]} for row in history(m, True)] for m in ("trace", "bf16")]
    evaluations = [TRACE_EVALUATION, BF16_EVALUATION]
    training = section(report.comparison(TRACE, evaluations, binary), "Training per method")
    assert rows(training)[0][:4] == [
        "method",
        "steps",
        "reward mean = train accuracy (last, sampled)",
        r"logprob \|diff\| mean (last)",
    ]
    assert [r[2] for r in rows(training)[1:]] == ["0.45", "0.45"]  # the last step's
    assert "Every method's mean reward equals its train accuracy at every step: every reward was 0 or 1." in training
    page = Page(report.comparison_html(TRACE, evaluations, binary))
    assert "Reward per method" not in png_alts(page) and "Train accuracy per method" in png_alts(page)

    mixed = [binary[0], history("bf16", True)]  # bf16's rewards are not its accuracies
    training = section(report.comparison(TRACE, evaluations, mixed), "Training per method")
    assert rows(training)[0][2:4] == ["train accuracy (last, sampled)", "reward_mean (last)"]
    assert "every reward was 0 or 1" not in training


def test_an_off_policy_run_says_its_later_steps_add_the_policys_drift(tmp_path):
    """With several RL steps a round, batch s of a round is s policy updates
    old: its train-rollout figures hold how far the policy moved as well as the
    FP4 mismatch, which each round's first step measures alone."""
    rl = TRACE.rl.model_copy(update={"schedule": "off_policy", "steps_per_round": 2})
    off_policy = TRACE.model_copy(update={"rl": rl})
    stale = [row | {"staleness": i % 2} for i, row in enumerate(history("trace", True))]
    steps = section(report.markdown(off_policy, *write(tmp_path, "stale", stale, {})), "Training, per RL step")
    assert rows(steps)[0][:3] == ["round", "step", "staleness"] and [r[2] for r in rows(steps)[1:]] == list("0101")
    assert "A round rolls out 2 steps' batches from one policy and trains them in turn (rl.steps_per_round)" in steps
    assert "each round's first step (staleness 0) measures the mismatch alone." in steps
    old = section(
        report.markdown(off_policy, *write(tmp_path, "old", history("trace", True), {})), "Training, per RL step"
    )
    assert "staleness" not in rows(old)[0] and "each round's first step measures the mismatch alone." in old
    page = Page(report.html_report(off_policy, *write(tmp_path, "stale", stale, {})))
    diff = next(c for c in page.captions if c.startswith("Train-rollout log-prob |diff|."))
    assert "Each round's first step is on-policy; the k-th after it trains k policy updates after" in diff
    on_policy = section(report.markdown(TRACE, *write(tmp_path, "on", stale, {})), "Training, per RL step")
    assert "staleness" not in on_policy and "policy moved" not in on_policy


def test_a_discrepancy_of_exactly_0_says_what_it_covered(tmp_path):
    """Every figure 0 is what a training path that rounds as the rollout did
    gives: the report counts the response tokens it covered and says so."""
    zero = {key: 0.0 for _, key in report.DISCREPANCY}
    record = {"rollout": "fp4_wa_kv", "trajectories": 16, "response_tokens": 86, **zero}
    text = report.markdown(TRACE, *write(tmp_path, "zero", [], TRACE_EVALUATION | {"discrepancy": [record]}))
    discrepancy = section(text, "Train-rollout discrepancy")
    assert rows(discrepancy)[:2] == [
        ["rollout", "trajectories", "response tokens", "code mismatch"] + rows(discrepancy)[0][4:],
        ["fp4_wa_kv", "16", "86", "0", "0", "0", "0"],
    ]
    assert (
        "Under `fp4_wa_kv` the training path rounded every captured FP4 value to the rollout's code and reproduced "
        "the rollout's log-prob of each of the 86 response tokens (5.38 a trajectory): every figure is exactly 0."
    ) in discrepancy
    assert "code mismatch: share of the captured FP4 values" in discrepancy  # the caption names the columns

    older = record.copy()
    del older["response_tokens"]  # written before the count
    text = report.markdown(TRACE, *write(tmp_path, "older", [], TRACE_EVALUATION | {"discrepancy": [older]}))
    discrepancy = section(text, "Train-rollout discrepancy")
    assert "response tokens" not in rows(discrepancy)[0] and "log-prob of each of the response tokens:" in discrepancy
    only_codes = record | {"logprob_abs_diff_mean": 0.01}  # codes alike, log-probs not: only the codes are said
    text = report.markdown(TRACE, *write(tmp_path, "codes", [], TRACE_EVALUATION | {"discrepancy": [only_codes]}))
    assert "to the rollout's code.\n" in section(text, "Train-rollout discrepancy")
    text = report.markdown(TRACE, *write(tmp_path, "some", [], TRACE_EVALUATION))  # code mismatch 0.3
    assert "rounded every captured" not in text
    evaluations = [{"method": "trace", "discrepancy": [record]}, {"method": "qat", "discrepancy": [older]}]
    assert rows(
        section(report.comparison(TRACE, evaluations, [[], []]), "FP4 train-rollout log-prob |diff| per method")
    )[1:] == [
        ["trace", "fp4_wa_kv", "16", "86", "0", "0", "0", "0"],
        ["qat", "fp4_wa_kv", "16", "-", "0", "0", "0", "0"],
    ]


def test_the_evaluation_counts_the_response_tokens_its_discrepancy_covers(monkeypatch):
    """The count the report shows is that of the tokens the log-prob figures are over (the response mask)."""
    from tracefp4.components import evaluation, steps
    from tracefp4.components.model import build_model
    from tracefp4.components.rl import SequenceBatch
    from tracefp4.components.tokenizer import build_tokenizer

    measured, real = [], evaluation.Trainer.measure
    monkeypatch.setattr(
        evaluation.Trainer, "measure", lambda self, trajectories, *a: measured.append(trajectories) or real(
            self, trajectories, *a)
    )  # fmt: skip
    tokenizer = build_tokenizer()
    prompts = steps.encode_prompts(TRACE, tokenizer, steps.problems(TRACE)[1][:2])
    quant = steps.rollout_quant(TRACE, "fp4_wa_kv")
    out = evaluation._discrepancy(TRACE, build_model("smoke"), "fp4_wa_kv", quant, tokenizer, prompts, False)
    ((trajectories,),) = [measured]
    assert out["discrepancy"]["response_tokens"] == SequenceBatch.of(trajectories).response.sum() > 0
