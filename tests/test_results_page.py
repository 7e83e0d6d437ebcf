"""benchmarks/results_page.py: docs/results.md is exactly what the committed JSON gives (so it cannot drift from
the runs), a section from another benchmark is included from its JSON, and a JSON file the page cannot render, or
one that does not name its command, is an error rather than silently left out."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # results_page imports its sibling benchmarks, as when run as a script
spec = importlib.util.spec_from_file_location("results_page", ROOT / "benchmarks" / "results_page.py")
results_page = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_page)


@pytest.fixture(scope="module")
def committed() -> str:
    return results_page.render(results_page.RESULTS)


def test_committed_page_is_the_render_of_the_committed_json(committed):
    page = results_page.PAGE.read_text()
    assert page == committed, "docs/results.md is stale or hand-edited: run python benchmarks/results_page.py"


def test_committed_science_page_is_the_render_of_its_json(tmp_path):
    data = json.loads((results_page.RESULTS / "science.json").read_text())
    assert (results_page.RESULTS / "science.md").read_text() == results_page.science.render(data, tmp_path)


def test_every_claim_has_a_verdict_and_an_interval(committed):
    rows = [line for line in committed.split("## 1.")[0].splitlines() if line.startswith("| ") and "---" not in line]
    verdicts = {"**holds**", f"**{results_page.science.NOT_HELD}**", f"**{results_page.science.NOT_SEPARABLE}**"}
    assert len(rows) > 10  # the header and the claims
    for row in rows[1:]:
        cells = row.split(" | ")
        assert cells[3] in verdicts, row
        assert "[" in cells[2], row  # ours comes with its 95% interval


def results_copy(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for name in results_page.CORE:
        shutil.copy(results_page.RESULTS / name, folder / name)
    return folder


def test_a_section_from_another_benchmark_is_included_from_its_json(tmp_path):
    folder = results_copy(tmp_path)
    section = {"title": "Syndrome guidance in the RL loop", "command": "python benchmarks/x.py", "markdown": "| a |\n"}
    (folder / "syndrome_rl.json").write_text(json.dumps({"section": section, "rows": []}))
    page = results_page.render(folder)
    assert "## 3. Syndrome guidance in the RL loop\n\n`python benchmarks/x.py`\n\n| a |\n" in page
    assert page.index("## 2.") < page.index("## 3. Syndrome") < page.index("## Earlier measurements")


def test_a_json_file_without_a_renderer_is_an_error(tmp_path):
    folder = results_copy(tmp_path)
    (folder / "other.json").write_text(json.dumps({"command": "python benchmarks/other.py", "rows": []}))
    with pytest.raises(ValueError, match="other.json: neither a core source"):
        results_page.render(folder)
    (folder / "other.json").write_text(json.dumps({"section": {"title": "t", "command": "c"}}))
    with pytest.raises(ValueError, match=r"other.json: its 'section' lacks \['markdown'\]"):
        results_page.render(folder)


def test_a_repro_output_is_rendered_and_leaves_the_pending_list(tmp_path):
    folder = results_copy(tmp_path)
    step = {"logprob_abs_diff_mean": 0.004, "logprob_abs_diff_max": 0.1, "k3_kl": 1e-4, "guidance_coverage": 0.0}
    qat = [step | {"code_mismatch": 0.006 + 0.002 * i} for i in range(2)]
    trace = [step | {"logprob_abs_diff_mean": 0.001, "code_mismatch": 0.0, "guidance_coverage": 1.0}] * 2
    histories = {n: {"qat": qat, "trace, R-1bit all layers": trace} for n in ("bf16", "bf16 per_token")}
    data = {
        "command": "python benchmarks/repro.py --output x",
        "bootstrap": {"bootstrap_steps": 20, "bootstrap_accuracy": 0.03125},
        "histories": histories,
    }
    assert "repro-per-token.json" in results_page.render(folder)  # pending: its command is listed
    (folder / "repro-per-token.json").write_text(json.dumps(data))
    page = results_page.render(folder)
    assert "`python benchmarks/repro.py --output x`" in page
    assert "| bf16 per_token | qat | 2 | 4.00e-03 | 1.00e-01 | 1.00e-04 | 0.0070 | 0.000 | - | - |" in page
    assert "- bf16 per_token: trace, R-1bit all layers has 0.0000 code mismatch against QAT's 0.0070" in page
    assert "a mean |logprob diff| of 1.00e-03 against QAT's 4.00e-03" in page
    assert "--output docs/results/repro-per-token.json" not in page


def test_a_source_that_does_not_name_its_command_is_an_error(tmp_path):
    folder = results_copy(tmp_path)
    data = json.loads((folder / "alignment.json").read_text())
    del data["command"]
    (folder / "alignment.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="alignment.json: no 'command' key"):
        results_page.render(folder)


def test_check_mode_fails_on_a_stale_page(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nhand-typed 12%\n")
    with pytest.raises(SystemExit, match="differs from what"):
        results_page.main(["--check", "--page", str(page)])


@pytest.mark.parametrize(
    ("ci", "expect", "verdict"),
    [
        ([0.01, 0.02], ">", "holds"),
        ([-0.02, -0.01], ">", "does not hold at this scale"),
        ([-0.01, 0.02], ">", "not separable at this scale"),
        ([-0.02, -0.01], "<", "holds"),
        ([0.01, 0.02], "<", "does not hold at this scale"),
    ],
)
def test_verdicts_follow_the_interval(ci, expect, verdict):
    assert results_page.science.verdict_of(ci, expect) == verdict


def test_a_threshold_claim_is_not_separable_when_its_interval_straddles_the_threshold():
    science = results_page.science
    assert science.within([0.992, 1.0], low=0.99) == "holds"
    assert science.within([0.987, 1.0], low=0.99) == science.NOT_SEPARABLE
    assert science.within([0.95, 0.98], low=0.99) == science.NOT_HELD
    assert science.within([0.001, 0.004], high=0.002) == science.NOT_SEPARABLE
    assert results_page.combined(["holds", science.NOT_SEPARABLE]) == science.NOT_SEPARABLE
    assert results_page.combined([science.NOT_SEPARABLE, science.NOT_HELD]) == science.NOT_HELD
