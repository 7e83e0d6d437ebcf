"""The documentation names only what exists: every relative link and anchor
resolves, and every ``tracefp4`` command line, ``--set`` path, ``make``
target and ``python benchmarks/...`` command line that README.md and docs/
show is one the code has. A renamed option or heading otherwise leaves the
docs sending users to something that fails."""

import re
from pathlib import Path

import click
import pytest

from tracefp4.pipelines.cli import main
from tracefp4.schemas import RunConfig

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``doc`` (lower case, punctuation dropped, spaces as hyphens; a
    repeated one numbered)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = not fenced and re.match(r"#+\s+(.*)", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
            slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
            n = seen[slug] = seen.get(slug, -1) + 1
            found.add(f"{slug}-{n}" if n else slug)
    return found


def code(doc: Path) -> list[str]:
    """The commands ``doc`` shows: inline code and the lines of code blocks (continued lines joined)."""
    text = doc.read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"(?m)^(?:    .*\n)+", text)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines = [line.split(" # ")[0] for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return lines + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def commands() -> dict[str, set[str]]:
    """Every ``tracefp4`` command line's words (``tracefp4 runs clean``) -> its options."""
    found = {}

    def walk(command, words):
        found[" ".join(words)] = {o for p in command.params if isinstance(p, click.Option) for o in p.opts}
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*words, name])

    walk(main, ["tracefp4"])
    return found


def benchmark_options(script: Path) -> set[str]:
    """The options ``script``'s argparse parser takes: the ``--`` strings its ``add_argument`` calls begin with,
    read from its source rather than by running ``--help`` (each benchmark imports torch and the library first).
    Not through ``ast.parse``: CPython 3.11's parser can fail with 'AST constructor recursion depth mismatch'
    while another thread of the process runs (a test server's)."""
    calls = re.findall(r"add_argument\(([^)]*)", script.read_text())
    return {option for call in calls for option in re.findall(r"[\"'](--[\w-]+)[\"']", call)}


def config_paths(model=RunConfig, prefix="") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        paths.add(prefix + name)
        for kind in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(kind, type) and hasattr(kind, "model_fields"):
                paths |= config_paths(kind, f"{prefix}{name}.")
    return paths


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_commands_options_set_paths_and_make_targets_exist(doc):
    known, paths = commands(), config_paths()
    targets = set(re.findall(r"(?m)^([a-z0-9-]+):", (ROOT / "Makefile").read_text()))
    wrong = []
    for line in code(doc):
        for part in re.split(r"&&|;|\|", line):
            words = part.split()
            if words[:1] == ["tracefp4"]:
                command, i = "tracefp4", 1
                while i < len(words) and f"{command} {words[i]}" in known:
                    command, i = f"{command} {words[i]}", i + 1
                rest = words[i:]
                if command == "tracefp4" and rest and not rest[0].startswith("-"):
                    wrong.append(f"no command: {part.strip()}")
                options = {w.split("=")[0].rstrip(",.;)") for w in rest if w.startswith("--")}
                wrong += [f"{command} has no {o}" for o in sorted(options - known[command])]
                for path in re.findall(r"--set\s+([\w.]+)=", part):
                    if re.sub(r"\.\d+", "", path) not in paths:
                        wrong.append(f"no config field {path}")
            if words[:1] == ["make"] and len(words) > 1 and "=" not in words[1] and words[1] not in targets:
                wrong.append(f"no make target: {part.strip()}")
            benchmark = re.search(r"\bpython3? (?:-P )?(benchmarks/\w+\.py)(.*)", part)
            if benchmark:
                script = ROOT / benchmark.group(1)
                if not script.exists():
                    wrong.append(f"no benchmark {benchmark.group(1)}")
                    continue
                options = {w.split("=")[0].rstrip(",.;)") for w in benchmark.group(2).split() if w.startswith("--")}
                wrong += [f"{benchmark.group(1)} has no {o}" for o in sorted(options - benchmark_options(script))]
    assert not wrong, f"{doc.name}: {wrong}"
