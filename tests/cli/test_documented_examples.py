"""Every ``areal-hex`` example in README.md, docs/*.md, CONTRIBUTING.md, the recipes' headers and ``--help`` runs.

Synopses (``areal-hex plan RECIPE [--json OUT] ...``) run twice: with no optional part, and with every optional
part (the first of each ``a | b``); ``reproduce`` only the second way. Placeholders get concrete values; commands that need hardware this machine
lacks (``inventory``, ``profile`` without ``--from-measurements``) must then stop with one clean message.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from areal_hex_plugin.cli import COMMANDS, build_parser, main
from areal_hex_plugin.schemas import NAMES, load_schema
from tests.conftest import RECIPES, REPO
from tests.costmodel.helpers import TRUTH, recipe, synthetic_measurements

DOCS = (
    "README.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
    "CONTRIBUTING.md",
)
# What each placeholder becomes; {tmp} is the test's working folder (recipes/ is linked into it).
PLACEHOLDERS = {
    "RECIPE": "recipes/paper/7b.yaml",
    "OUT": "{tmp}/out.json",
    "OUT.png": "{tmp}/out.png",
    "OUT.json": "{tmp}/trace.json",
    "PLAN.json": "{tmp}/plan.json",
    "F": "{tmp}/measured.json",
    "BASELINES": "recipes/paper/baselines.json",
    "PROFILE": "{tmp}/profile.json",
    "DIR": "{tmp}",
    "X": "H20",
    "A": "127.0.0.1:1",
    "ray|slurm|local": "local",
    "slurm|ray|skypilot": "slurm",
    "JOB": "{tmp}/job.sbatch",
}
# --exhaustive refuses clusters above the brute force's size limit, which every paper and mix recipe exceeds.
EXHAUSTIVE_RECIPE = "recipes/ci/tiny.yaml"
AFTER_FLAG = {"--budget": "130", "--target-tokens-per-s": "20000", "--steps": "3"}
# check asks the live cluster and needs the relay's token, as a run does.
NEEDS_HARDWARE = ("inventory", "profile", "check")


def _doc_commands() -> list[tuple[str, str]]:
    """(where, text after `areal-hex`) for every example in the docs and the recipes' headers."""
    found = []
    for name in DOCS:
        text = (REPO / name).read_text()
        blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for snippet in [line for block in blocks for line in block.splitlines()] + spans:
            if "areal-hex " in snippet:
                found.append((name, snippet.split("areal-hex ", 1)[1].replace("\\|", "|")))
    for path in RECIPES:
        for line in path.read_text().splitlines():
            if line.startswith("#") and "areal-hex " in line:
                found.append((str(path.relative_to(REPO)), line.split("areal-hex ", 1)[1]))
    # A bare subcommand name ("see `areal-hex profile`") is a mention, not an example.
    return [(where, cmd) for where, cmd in found if len(cmd.split()) > 1 or cmd.startswith("-")]


def _variants(synopsis: str) -> list[str]:
    if "[" not in synopsis:
        return [synopsis]
    # An optional part starts a word; a bracket inside one is a value ('++hex.solver.rollout_layout=[1,1]').
    bare = re.sub(r"\s+\[[^\]]*\]", "", synopsis)
    full = re.sub(r"(?<=\s)\[([^\]]*)\]", lambda m: m.group(1).split(" | ")[0], synopsis)
    return [full] if synopsis.startswith("reproduce") else [bare, full]  # reproduce takes ~40 s a run


def _argv(command: str, tmp: Path) -> list[str]:
    argv: list[str] = []
    for token in shlex.split(command):
        if token == "|":  # a shell pipe: areal-hex's part ends here
            break
        value = AFTER_FLAG.get(argv[-1]) if argv else None
        if token == "RECIPE" and "--exhaustive" in command:
            value = EXHAUSTIVE_RECIPE
        argv.append(value or PLACEHOLDERS.get(token, token).format(tmp=tmp))
    return argv


EXAMPLES = sorted({(where, v) for where, cmd in _doc_commands() for v in _variants(cmd)})
# Commands another test runs as documented and checks further (a reproduce takes ~2 minutes of CI).
RUN_ELSEWHERE = {
    "reproduce": "tests/sim/test_reproduce_command.py",
    "calibrate": "tests/costmodel/test_paper_targets.py",  # the fit it writes, checked against the shipped one
}


def _once(examples: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One (places, command) per command line: the examples that become the same command once their placeholders
    are filled (``plan RECIPE`` in three docs and ``plan recipes/paper/7b.yaml`` in a recipe's header) run once,
    every place they are documented named."""
    places: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for where, command in examples:
        places.setdefault(tuple(_argv(command, Path("TMP"))), []).append((where, command))
    return [("; ".join(w for w, _ in same), same[0][1]) for same in places.values()]


RUN_HERE = _once([e for e in EXAMPLES if e[1].split()[0] not in RUN_ELSEWHERE])


def test_the_docs_have_examples_of_every_command():
    assert {cmd.split()[0] for _, cmd in EXAMPLES} >= set(COMMANDS) | {"--help"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A plan and measurements for the examples that read them, made once."""
    folder = tmp_path_factory.mktemp("inputs")
    measured = synthetic_measurements(recipe("paper/7b.yaml"), "H20", TRUTH)
    (folder / "measured.json").write_text(json.dumps(measured))
    profile = {"format": "areal-hex-profile/1", "gpu_types": {"H20": {"link_efficiency": 0.7}}}
    (folder / "profile.json").write_text(json.dumps(profile))
    assert main(["plan", str(REPO / "recipes/paper/7b.yaml"), "--json", str(folder / "plan.json")]) == 0
    return folder


@pytest.fixture
def workspace(inputs, tmp_path, monkeypatch) -> Path:
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    for name in ("measured.json", "plan.json", "profile.json"):
        shutil.copy(inputs / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("where", "command"),
    [
        pytest.param(
            *e,
            marks=[pytest.mark.slow]
            if e[1].startswith(("plan", "calibrate")) and "--as-written" not in e[1]
            else [],
        )
        for e in RUN_HERE
    ],
    ids=[f"{w}: {c}" for w, c in RUN_HERE],
)
def test_every_documented_command_runs(where, command, workspace, capsys):
    run_documented(_argv(command, workspace), f"{where}: areal-hex {command}", capsys.readouterr)


def run_documented(argv: list[str], example: str, printed: Callable[[], tuple[str, str]]) -> str:
    """Run a documented example: no traceback; exit 0 (or, needing hardware, one message with a fix); what it
    wrote with --json is what the shipped schema describes. ``printed`` reads back what it printed (stdout,
    stderr), which it returns."""
    try:
        code = main(argv)
    except SystemExit as exc:  # --help
        code = exc.code
    out, err = printed()
    # Upstream's loggers keep the stream an earlier test captured; their complaints are not ours.
    err = re.sub(r"--- Logging error ---.*?\nArguments: [^\n]*\n", "", err, flags=re.S)
    assert "Traceback" not in err
    if argv[0] in NEEDS_HARDWARE and "--from-measurements" not in argv and code == 2:
        assert "fix:" in err  # no GPU here: one message saying what to do
    else:
        assert code == 0, f"{example}\n{err}"
        if "--json" in argv and argv[0] in NAMES and argv[argv.index("--json") + 1] != "-":
            # What the example wrote is what the shipped schema describes.
            written = json.loads(Path(argv[argv.index("--json") + 1]).read_text())
            jsonschema.validate(written, load_schema(argv[0]), cls=jsonschema.Draft202012Validator)
    return out


def _help_texts() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return [parser.format_help()] + [p.format_help() for p in sub.choices.values()]


def _override_examples() -> list[str]:
    """Overrides the help and the docs give as examples (``e.g. hex.solver.seed=1``, `hex.dry_run=true`)."""
    texts = _help_texts() + [(REPO / name).read_text() for name in DOCS]
    found = set()
    for text in texts:
        flat = " ".join(text.split())
        found |= set(re.findall(r"e\.g\. ([+~]*[a-z_]+\.[\w.]+=[\w./-]+)", flat))
        found |= {s for s in re.findall(r"`([+~]*[a-z_]+\.[\w.]+=[^`\s]+)`", flat) if "areal-hex" not in s}
    return sorted(o for o in found if not o.lstrip("+~").startswith("a.b="))  # the grammar, not an example


def test_the_help_gives_override_examples():
    assert any("e.g." in text and "=" in text for text in _help_texts())


@pytest.mark.parametrize("override", _override_examples())
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_documented_override_applies_to_every_recipe(override, path, tmp_path, capsys):
    override = override.replace("PLAN.json", str(tmp_path / "plan.json"))
    assert main(["validate", str(path), override]) == 0, capsys.readouterr().err


def _claimed_roles(path: Path) -> dict[str, str]:
    for line in path.read_text().splitlines():
        if line.startswith("#") and "Planned roles" in line:
            return dict(pair.split() for pair in line.split(":", 1)[1].rstrip(".").split(","))
    return {}


CLAIMS = [p for p in RECIPES if _claimed_roles(p)]


def test_the_mixes_say_which_pool_does_what():
    assert {p.name for p in CLAIMS} >= {p.name for p in RECIPES if p.parent.name == "mixes"}


@pytest.mark.parametrize("path", CLAIMS, ids=lambda p: p.name)
def test_a_recipes_header_says_what_its_plan_does(path):
    from areal_hex_plugin.planner import plan_recipe
    from areal_hex_plugin.specs.recipe import load_recipe

    plan = plan_recipe(load_recipe(path))
    roles = {m.pool: m.role for m in plan.machines if m.role != "idle"}
    assert roles == _claimed_roles(path)
