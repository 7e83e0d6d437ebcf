"""How long a step takes to draw a run's tasks, and what finding countdown's
reference answers from values gains over writing the expressions out.

Every step that needs problems (prepare, each round's rollout and its
workers, bootstrap, evaluation) draws every task's split again
(``steps.task_splits``: seeded, so the same in every process). A paper
preset draws 41,000 problems at difficulty 5. The figures:

- seconds to draw each task's split of ``--preset`` (one process, one pass:
  the time a step pays before its work);
- ``countdown_search_speedup``: ``tasks.canonical_answer`` (the first
  reaching expression found from the parts' values) against
  ``tasks.enumerated_answer`` (its definition: every expression written out
  until one reaches the target) on the same ``--prompts`` difficulty-5
  prompts, after checking both give the same answers.

    python benchmarks/tasks.py                       # paper-nvfp4-wa-kv
    python benchmarks/tasks.py --preset tiny --prompts 50

Prints the figures, then one JSON line.
"""

import argparse
import json
import time

from tracefp4.components import tasks
from tracefp4.components.device import cpu_kind
from tracefp4.schemas.presets import get_preset


def timed(fn):
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="paper-nvfp4-wa-kv")
    parser.add_argument("--prompts", type=int, default=300, help="countdown prompts whose answers are compared")
    args = parser.parse_args()
    config = get_preset(args.preset)
    figures: dict = {"benchmark": "tasks", **cpu_kind(), "preset": args.preset}
    for t in config.tasks:
        _, took = timed(lambda t=t: tasks.split(t.name, t.train_size, t.test_size, config.seed, t.difficulty))
        figures[f"{t.name}_d{t.difficulty}_problems"] = t.train_size + t.test_size
        figures[f"{t.name}_d{t.difficulty}_split_s"] = round(took, 2)
        print(f"{t.name} at difficulty {t.difficulty}: {t.train_size + t.test_size} problems drawn in {took:.1f} s")

    prompts = [p.meta for p in tasks.get_task("countdown").generate(args.prompts, config.seed, 5)]
    tasks._values.cache_clear()  # drawing them found their answers
    searched, search_s = timed(lambda: [tasks.canonical_answer(m["numbers"], m["target"]) for m in prompts])
    enumerated, enumerate_s = timed(lambda: [tasks.enumerated_answer(m["numbers"], m["target"]) for m in prompts])
    if searched != enumerated:
        first = next((m, s, e) for m, s, e in zip(prompts, searched, enumerated) if s != e)
        raise SystemExit(f"canonical_answer and the enumeration disagree (prompt, search, enumeration): {first}")
    figures.update(
        countdown_prompts=len(prompts),
        countdown_search_ms_per_prompt=round(1e3 * search_s / len(prompts), 3),
        countdown_enumeration_ms_per_prompt=round(1e3 * enumerate_s / len(prompts), 3),
        countdown_search_speedup=round(enumerate_s / search_s, 2),
    )
    print(
        f"countdown answers of {len(prompts)} difficulty-5 prompts: {figures['countdown_search_ms_per_prompt']} ms a "
        f"prompt from values, {figures['countdown_enumeration_ms_per_prompt']} ms enumerated "
        f"({figures['countdown_search_speedup']}x), the same answers"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
