"""benchmarks/alignment.py: the adaptive coverage rule on hand-made rates, and
its --quick mode end to end on the smoke model (both training precisions)."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("alignment", ROOT / "benchmarks" / "alignment.py")
alignment = importlib.util.module_from_spec(spec)
spec.loader.exec_module(alignment)


def test_adaptive_takes_the_highest_local_rates_within_half_the_elements():
    rates = {0: 0.01, 1: 0.03, 2: 0.02, 3: 0.005}
    assert alignment.adaptive_layers(rates, dict.fromkeys(rates, 100)) == (1, 2)
    # layer 1 alone holds more than half the elements: skipped, the next ones fit
    assert alignment.adaptive_layers(rates, {0: 100, 1: 500, 2: 100, 3: 100}) == (0, 2, 3)
    assert alignment.adaptive_layers({0: 0.01, 1: 0.01}, {0: 10, 1: 10}) == (0,)  # a tie: the shallower


def test_coverages_of_four_layers():
    layers = [0, 1, 2, 3]
    assert alignment.coverage_layers("deeper", layers, ()) == (2, 3)
    assert alignment.coverage_layers("shallow", layers, ()) == (0, 1)
    assert alignment.coverage_layers("all", layers, ()) == (0, 1, 2, 3)
    assert alignment.coverage_layers("adaptive", layers, (1, 3)) == (1, 3)


def test_a_prompts_responses_are_resampled_together():
    """The pooled sequences' prompts, seed by seed, a prompt's responses together (the paired bootstrap's clusters)."""
    seeds = [{"rows": [{"logprob_abs_diff_per_sequence": [0.0] * 6}]}] * 2
    assert alignment.prompt_clusters(seeds, 3) == ["0/0", "0/0", "0/0", "0/1", "0/1", "0/1"] + [
        "1/0",
        "1/0",
        "1/0",
        "1/1",
        "1/1",
        "1/1",
    ]


def test_quick_mode(capsys, tmp_path, native_bf16):
    alignment.main(["--quick", "--output", str(tmp_path / "alignment.json")])
    out = capsys.readouterr().out
    assert "| precision | guidance |" in out and "local RTN flip rate" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert json.loads((tmp_path / "alignment.json").read_text()) == result  # the file results_page.py reads
    assert result["command"] == f"python benchmarks/alignment.py --quick --output {tmp_path / 'alignment.json'}"
    assert result["group"] == 2  # --quick's: 2 prompts x 2 responses
    rows = {(r["precision"], r["guidance"]): r for r in result["table"]}
    names = ["RTN (qat)"] + [f"R-{b} {c}" for b in (1, 4) for c in alignment.COVERAGES]
    assert set(rows) == {(p, n) for p in ("bf16", "fp32_master") for n in names}
    for precision in ("bf16", "fp32_master"):
        rtn, r4 = rows[(precision, "RTN (qat)")], rows[(precision, "R-4 all")]
        assert rtn["local_mismatch"] > 0  # the training path's own flips, the layers below held to the rollout's
        assert rtn["e2e_mismatch"] > rtn["local_mismatch"]  # end to end, the flips below cascade
        assert r4["local_mismatch"] < 1e-3 and r4["e2e_mismatch"] < 1e-3
        assert r4["logprob_abs_diff_mean"] < rtn["logprob_abs_diff_mean"]
        assert rows[(precision, "R-1 deeper")]["guided_layers"] == [[1]]
        assert rows[(precision, "R-1 shallow")]["guided_layers"] == [[0]]
        assert len(rows[(precision, "R-1 adaptive")]["guided_layers"][0]) == 1  # half of the smoke model's 2
        for half in ("deeper", "shallow"):  # half the layers guided: between none and all
            assert r4["e2e_mismatch"] <= rows[(precision, f"R-1 {half}")]["e2e_mismatch"] <= rtn["e2e_mismatch"]
    assert set(result["paired"]) >= {"bf16: R-1 shallow - R-1 deeper", "RTN (qat): fp32_master - bf16"}


def test_seeds_must_be_positive():
    with pytest.raises(SystemExit):
        alignment.main(["--seeds", "0"])


@pytest.mark.parametrize("global_scales", ["static", "per_token"])
def test_rounding_the_captured_inputs_again_gives_the_training_paths_own_codes(tmp_path, global_scales):
    """mismatch.rounded without guidance is the training path's RTN, bit for bit, in both precisions, under
    static activation global scales and per-token ones (each row's own)."""
    from dataclasses import replace

    from tracefp4.components import steps
    from tracefp4.components.capture import CaptureRecords
    from tracefp4.components.checkpoint import load_model
    from tracefp4.components.mismatch import compare, rounded
    from tracefp4.components.trainer import Trainer

    args = argparse.Namespace(preset="smoke", bootstrap_steps=0, prompts=2, group=2, new_tokens=8)
    config = alignment.bench_config(args)
    config.bootstrap.enabled = False
    config.rollout.activation_global_scale = global_scales
    steps.prepare(config, tmp_path / "base", alignment.RUN_ID)
    engine, trajectories, records = alignment.rollout(config, tmp_path / "base", 0)
    for precision in ("bf16", "fp32_master"):
        train_config = replace(steps.train_config(config), method="qat", precision=precision)
        trainer = Trainer(load_model(tmp_path / "base"), train_config, engine.quant, engine.global_scales)
        training = trainer.teacher_force(trajectories, None, records).records
        again = rounded(training, CaptureRecords())
        for key, m in compare(training, again).items():
            assert m.elements > 0 and m.mismatched == 0 and m.scale_mismatched == 0, (precision, key)
