"""Issue 16, property-based: mutate a recipe, a saved plan, a calibration profile or a measurements file, run the
command that reads it in-process, and fail on any exception other than the clean error (exit 2 with one
``error: FIELD: ...`` message) or on any run longer than a bound.

CI runs a fixed (derandomized) set of cases; ``HEX_MUTATIONS=N`` runs N cases per input kind with fresh random
ones, e.g. ``HEX_MUTATIONS=500 .venv/bin/python -m pytest tests/specs/test_mutated_inputs.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_hex_plugin.cli import main
from areal_hex_plugin.costmodel.calibration import PROFILE_FORMAT
from areal_hex_plugin.planner import plan_recipe
from areal_hex_plugin.specs.recipe import UPSTREAM_FIELDS, load_recipe
from tests.conftest import REPO
from tests.costmodel.helpers import TRUTH, synthetic_measurements

pytestmark = pytest.mark.slow

RECIPE = REPO / "recipes" / "paper" / "1.5b.yaml"
MEASURED_RECIPE = REPO / "recipes" / "paper" / "7b.yaml"
EXPLORE = int(os.environ.get("HEX_MUTATIONS", "0"))
# A run may take at most this long (seconds; `plan` runs with a 1 s solver time limit): the hangs the mutation run
# found ran past 70 s.
BOUND_S = 30.0


def _settings(ci_examples: int) -> settings:
    return settings(
        max_examples=EXPLORE or ci_examples,
        deadline=None,
        derandomize=not EXPLORE,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


NASTY: list[Any] = [
    float("nan"), float("inf"), float("-inf"), 0, -1, 1, 0.5, -0.5, 1.5, 2**31, 2**63, 10**15, 10**300,
    1e300, -1e300, 1e-300, True, False, None, "", " ", "x" * 5000, "abc", "1e400", ".nan", "-1", [], [[[[1]]]],
    {}, {"a": 1}, ["", "n2"],
]  # fmt: skip
NUMBERS: list[Any] = [
    float("nan"),
    float("inf"),
    float("-inf"),
    0,
    -1,
    10**15,
    10**300,
    1e300,
    -1e300,
    1e-300,
    2**63,
]
# Half the values are the classes the mutation run found (NaN, inf, huge, negative, zero), half anything.
VALUES = st.one_of(
    st.sampled_from(NUMBERS),
    st.sampled_from(NASTY),
    st.integers(-(10**6), 10**18),
    st.floats(allow_nan=True, allow_infinity=True),
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``node`` (keys and list indices), containers included."""
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _mutate(doc: Any, path: tuple, value: Any, delete: bool) -> Any:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if delete:
        if isinstance(node, list) or path[-1] in node:
            del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


def _numeric(doc: Any) -> list[tuple]:
    """The paths of ``doc``'s numbers (where the tracebacks were)."""
    out = []
    for path in _paths(doc):
        node = doc
        for key in path:
            node = node[key]
        if isinstance(node, int | float) and not isinstance(node, bool):
            out.append(path)
    return out


@st.composite
def mutations(draw, doc: Any, focus: list[tuple]) -> tuple[tuple, Any, bool]:
    """A path (three times in four a focus path), a value, and whether to delete the key instead."""
    path = draw(st.sampled_from(focus if draw(st.integers(0, 3)) else _paths(doc)))
    delete = draw(st.integers(0, 9)) == 0
    return path, draw(VALUES), delete


class _TooLong(Exception):
    pass


def _run(argv: list[str]) -> tuple[int, str, float]:
    """Run ``areal-hex ARGV`` in-process; any exception but the clean exit 2 fails, and so does a long run."""

    def stop(*_):
        raise _TooLong(f"areal-hex {' '.join(argv)[:300]} ran past {BOUND_S:.0f} s")

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    text = err.getvalue()
    assert code in (0, 2), (code, text[-2000:])
    if code == 2:
        assert text.strip().splitlines()[-1].startswith(("error: ", "  fix: ")), text[-2000:]
        assert "Traceback" not in text
    return code, text, time.perf_counter() - start


def _no_nan(path: Path) -> None:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{path.name} holds {constant}")

    json.loads(path.read_text(), parse_constant=refuse)


def _has(doc: dict, dotted: str) -> bool:
    node = doc
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


RECIPE_DOC = yaml.safe_load(RECIPE.read_text())
# Focus: the numbers of the hex: section, the upstream fields the planner reads, and numeric hex fields the
# recipe leaves at their defaults.
RECIPE_FOCUS = (
    [p for p in _numeric(RECIPE_DOC) if p[0] == "hex"]
    + [tuple(key.split(".")) for key in UPSTREAM_FIELDS if _has(RECIPE_DOC, key.rsplit(".", 1)[0])]
    + [
        ("hex", "solver", name)
        for name in ("max_pp_stages", "stable_iterations", "num_workers", "seed", "rollout_layout")
    ]
    + [("hex", "workload", name) for name in ("reward_cpus", "reward_cpu_s_per_sample", "prompt_tokens")]
    + [("hex", "cluster", "pools", 0, name) for name in ("intra_machine_gb_per_s", "hosts")]
)


@_settings(40)
@given(mutation=mutations(RECIPE_DOC, RECIPE_FOCUS))
def test_mutated_recipes_plan_or_exit_2(tmp_path_factory, mutation):
    path, value, delete = mutation
    folder = tmp_path_factory.mktemp("recipe")
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_mutate(RECIPE_DOC, path, value, delete), sort_keys=False))
    code, _, _ = _run(["validate", str(recipe)])
    if code == 0 and path[-1] != "time_limit_s":
        # A valid recipe plans within the bound (a mutated time limit is the user's own bound).
        _run(["plan", str(recipe), "++hex.solver.time_limit_s=1", "--json", str(folder / "plan.json")])


@pytest.fixture(scope="module")
def plan_doc() -> dict:
    return plan_recipe(load_recipe(RECIPE)).to_dict()


@_settings(30)
@given(data=st.data())
def test_mutated_plans_simulate_or_exit_2(tmp_path_factory, plan_doc, data):
    path, value, delete = data.draw(mutations(plan_doc, _numeric(plan_doc)))
    plan = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.write_text(json.dumps(_mutate(plan_doc, path, value, delete)))
    _run(["simulate", str(RECIPE), "--plan", str(plan), "--steps", "2"])


PROFILE_DOC = {"format": PROFILE_FORMAT, "gpu_types": {"H20": dict(TRUTH), "H800-PCIe": dict(TRUTH)}}


@_settings(25)
@given(mutation=mutations(PROFILE_DOC, _numeric(PROFILE_DOC)))
def test_mutated_profiles_load_or_exit_2(tmp_path_factory, mutation):
    path, value, delete = mutation
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.write_text(json.dumps(_mutate(PROFILE_DOC, path, value, delete)))
    _run(["validate", str(RECIPE), f"++hex.calibration.profile={profile}"])


@pytest.fixture(scope="module")
def measurements_doc() -> dict:
    return synthetic_measurements(load_recipe(MEASURED_RECIPE), "H20", TRUTH)


@_settings(25)
@given(data=st.data())
def test_mutated_measurements_fit_or_exit_2(tmp_path_factory, measurements_doc, data):
    path, value, delete = data.draw(mutations(measurements_doc, _numeric(measurements_doc)))
    folder = tmp_path_factory.mktemp("measured")
    (folder / "raw.json").write_text(json.dumps(_mutate(measurements_doc, path, value, delete)))
    out = folder / "h20.json"
    argv = ["profile", str(MEASURED_RECIPE), "--gpu-type", "H20", "--json", str(out)]
    code, _, _ = _run([*argv, "--from-measurements", str(folder / "raw.json")])
    if code == 0:
        _no_nan(out)
        assert all(0 < v <= 1 for v in json.loads(out.read_text())["gpu_types"]["H20"].values())
        assert math.isfinite(json.loads(out.read_text())["fit"]["H20"]["rms_log_error"])
