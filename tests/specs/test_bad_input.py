"""Every malformed recipe ends in exit 2 with one message naming the field and the fix, and no traceback."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_hex_plugin.cli import main
from tests.conftest import REPO

BASE = yaml.safe_load((REPO / "recipes/paper/7b.yaml").read_text())


def _edit(fn):
    def apply(cfg):
        fn(cfg)
        return cfg

    return apply


def _pool(i, **kv):
    return _edit(lambda c: c["hex"]["cluster"]["pools"][i].update(kv))


def _hex(path, value):
    def apply(cfg):
        node = cfg["hex"]
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        return cfg

    return apply


def _del_pool_key(i, key):
    return _edit(lambda c: c["hex"]["cluster"]["pools"][i].pop(key))


def _top(section, key, value):
    return _edit(lambda c: c[section].update({key: value}))


TINY_4090 = [
    {"name": "g", "gpu_type": "RTX4090", "gpus_per_machine": 1, "machines": 2, "price_per_gpu_hour": 0.3}
]

# (id, recipe edit or raw file content, overrides, field the message must start with)
CASES = [
    ("unknown-gpu-type", _pool(0, gpu_type="H2O"), [], "hex.cluster.pools[0].gpu_type"),
    ("zero-gpus-per-machine", _pool(1, gpus_per_machine=0), [], "hex.cluster.pools[1].gpus_per_machine"),
    ("negative-machines", _pool(0, machines=-1), [], "hex.cluster.pools[0].machines"),
    ("missing-machines", _del_pool_key(0, "machines"), [], "hex.cluster.pools[0].machines"),
    ("missing-price", _del_pool_key(1, "price_per_gpu_hour"), [], "hex.cluster.pools[1].price_per_gpu_hour"),
    ("negative-price", _pool(0, price_per_gpu_hour=-5.28), [], "hex.cluster.pools[0].price_per_gpu_hour"),
    (
        "zero-inter-bandwidth",
        _pool(0, inter_machine_gb_per_s=0),
        [],
        "hex.cluster.pools[0].inter_machine_gb_per_s",
    ),
    (
        "negative-intra-bandwidth",
        _pool(1, intra_machine_gb_per_s=-1),
        [],
        "hex.cluster.pools[1].intra_machine_gb_per_s",
    ),
    ("zero-cross-bandwidth", _hex("cluster.cross_pool_gb_per_s", 0), [], "hex.cluster.cross_pool_gb_per_s"),
    (
        "link-unknown-pool",
        _hex("cluster.links", [{"pools": ["h800", "a100"], "gb_per_s": 3}]),
        [],
        "hex.cluster.links[0].pools",
    ),
    (
        "link-negative",
        _hex("cluster.links", [{"pools": ["h800", "h20"], "gb_per_s": -3}]),
        [],
        "hex.cluster.links[0].gb_per_s",
    ),
    ("duplicate-pool-name", _pool(1, name="h800"), [], "hex.cluster.pools[1].name"),
    ("no-pools", _hex("cluster.pools", []), [], "hex.cluster.pools"),
    (
        "duplicate-host",
        _edit(lambda c: [p.update(hosts=["n1"], machines=1) for p in c["hex"]["cluster"]["pools"]]),
        [],
        "hex.cluster.pools",
    ),
    ("hosts-disagree", _pool(0, hosts=["a", "b"], machines=3), [], "hex.cluster.pools[0].machines"),
    ("budget-below-feasible", _hex("objective.budget_per_hour", 20.0), [], "hex.objective.budget_per_hour"),
    (
        "model-fits-no-gpu",
        _edit(lambda c: c["hex"]["cluster"].update(pools=TINY_4090)),
        ["actor.path=meta-llama/Llama-3.1-70B"],
        "actor.path",
    ),
    ("negative-eta", _top("rollout", "max_head_offpolicyness", -1), [], "rollout.max_head_offpolicyness"),
    ("unknown-key", _hex("cluster.pool", []), [], "hex.cluster.pool"),
    ("unknown-section", _hex("solverr", {}), [], "hex.solverr"),
    ("wrong-type-int", _pool(0, machines="three"), [], "hex.cluster.pools[0].machines"),
    ("wrong-type-list", _hex("cluster.pools", {"name": "x"}), [], "hex.cluster.pools"),
    ("wrong-type-bool", _hex("dry_run", "maybe"), [], "hex.dry_run"),
    ("wrong-type-float", _pool(0, price_per_gpu_hour=[5.28]), [], "hex.cluster.pools[0].price_per_gpu_hour"),
    ("null-required", _hex("transport", None), [], "hex.transport"),
    ("no-hex-section", _edit(lambda c: c.pop("hex")), [], "hex"),
    ("unknown-transport", _hex("transport", "carrier-pigeon"), [], "hex.transport"),
    ("unknown-routing", _hex("routing", "random"), [], "hex.routing"),
    ("relay-unknown-backend", _hex("relay.backend", "mpi"), [], "hex.relay.backend"),
    ("relay-unknown-on-failure", None, ["hex.relay.on_failure=retry"], "hex.relay.on_failure"),
    ("relay-zero-timeout", _hex("relay.timeout_s", 0), [], "hex.relay.timeout_s"),
    ("relay-zero-chunk", None, ["hex.relay.chunk_mb=0"], "hex.relay.chunk_mb"),
    ("relay-fractional-chunk", None, ["hex.relay.chunk_mb=0.5"], "hex.relay.chunk_mb"),
    ("relay-negative-resends", _hex("relay.max_resends", -1), [], "hex.relay.max_resends"),
    (
        "relay-fraction-above-1",
        None,
        ["hex.relay.min_committed_fraction=1.5"],
        "hex.relay.min_committed_fraction",
    ),
    ("relay-zero-fraction", _hex("relay.min_committed_fraction", 0), [], "hex.relay.min_committed_fraction"),
    ("relay-hosts-not-a-list", _hex("relay.allowed_hosts", "10.0.0.1"), [], "hex.relay.allowed_hosts"),
    ("relay-empty-host", _hex("relay.allowed_hosts", ["10.0.0.1", " "]), [], "hex.relay.allowed_hosts[1]"),
    ("relay-bad-interface", None, ["hex.relay.bind_interface=ib 0"], "hex.relay.bind_interface"),
    ("relay-relative-stage-dir", _hex("relay.stage_dir", "stage"), [], "hex.relay.stage_dir"),
    ("relay-relative-rollback-dir", _hex("relay.rollback_dir", "old"), [], "hex.relay.rollback_dir"),
    ("relay-unknown-key", None, ["+hex.relay.chunk_bytes=4"], "hex.relay.chunk_bytes"),
    ("budget-and-target", _hex("objective.target_tokens_per_s", 1000.0), [], "hex.objective"),
    (
        "negative-target",
        _edit(lambda c: c["hex"]["objective"].update(budget_per_hour=None, target_tokens_per_s=-1)),
        [],
        "hex.objective.target_tokens_per_s",
    ),
    (
        "missing-mean-length",
        _hex("workload.output_lengths", {"kind": "lognormal"}),
        [],
        "hex.workload.output_lengths.mean_tokens",
    ),
    (
        "mean-above-max-new-tokens",
        _hex("workload.output_lengths.mean_tokens", 10**6),
        [],
        "hex.workload.output_lengths.mean_tokens",
    ),
    (
        "length-file-missing",
        _hex("workload.output_lengths", {"kind": "file", "path": "nowhere.txt"}),
        [],
        "hex.workload.output_lengths.path",
    ),
    (
        "unknown-length-kind",
        _hex("workload.output_lengths.kind", "gaussian"),
        [],
        "hex.workload.output_lengths.kind",
    ),
    ("unknown-model", _top("actor", "path", "org/NoSuchModel-3B"), [], "actor.path"),
    ("new-gpu-lacks-figures", _hex("gpu_catalog", {"MI300X": {"hbm_gb": 192}}), [], "hex.gpu_catalog.MI300X"),
    ("negative-gpu-figure", _hex("gpu_catalog", {"H20": {"hbm_gb": -96}}), [], "hex.gpu_catalog.H20.hbm_gb"),
    ("zero-batch", _top("train_dataset", "batch_size", 0), [], "train_dataset.batch_size"),
    ("zero-time-limit", _hex("solver.time_limit_s", 0), [], "hex.solver.time_limit_s"),
    ("negative-refit-every", None, ["hex.calibration.refit_every=-1"], "hex.calibration.refit_every"),
    (
        "zero-replan-threshold",
        None,
        ["hex.calibration.replan_threshold=0"],
        "hex.calibration.replan_threshold",
    ),
    (
        "auto-replan-not-elastic",
        None,
        ["hex.elastic.auto_replan=true", "hex.elastic.enabled=false"],
        "hex.elastic.auto_replan",
    ),
    (
        "auto-replan-no-refit",
        None,
        ["hex.elastic.auto_replan=true", "hex.calibration.refit_every=0"],
        "hex.elastic.auto_replan",
    ),
    ("auto-replan-not-bool", None, ["hex.elastic.auto_replan=sometimes"], "hex.elastic.auto_replan"),
    ("negative-max-auto-replans", None, ["hex.elastic.max_auto_replans=-1"], "hex.elastic.max_auto_replans"),
    ("max-auto-replans-not-int", None, ["hex.elastic.max_auto_replans=1.5"], "hex.elastic.max_auto_replans"),
    ("override-without-equals", None, ["hex.solver.seed"], "override 'hex.solver.seed'"),
    ("override-unknown-key", None, ["hex.solver.sed=1"], "hex.solver.sed"),
    ("override-bad-type", None, ["hex.cluster.pools.0.machines=many"], "hex.cluster.pools[0].machines"),
    ("yaml-syntax", "hex:\n  cluster: [unclosed\n", [], "recipe"),
    ("empty-file", "", [], "recipe"),
    ("whitespace-file", "  \n\n", [], "recipe"),
    ("binary-file", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", [], "recipe"),
    ("not-utf8", b"hex: \xff\xfe\n", [], "recipe"),
    ("top-level-list", "- a\n- b\n", [], "recipe"),
]


def _write(tmp_path: Path, content) -> Path:
    path = tmp_path / "recipe.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        cfg = copy.deepcopy(BASE)
        if content is not None:
            cfg = content(cfg)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.mark.parametrize(("content", "overrides", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_recipe_exits_2_naming_the_field(tmp_path, capsys, content, overrides, field):
    path = _write(tmp_path, content)
    assert main(["validate", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {field}"), err
    assert "fix:" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 2  # the problem line and the fix line


@pytest.mark.parametrize(
    ("path", "problem"),
    [("does/not/exist.yaml", "no file at"), ("recipes", "is a directory")],
)
def test_unusable_paths(capsys, path, problem):
    assert main(["validate", str(REPO / path)]) == 2
    assert problem in capsys.readouterr().err


def test_at_least_30_cases():
    assert len(CASES) >= 30


def test_console_script_prints_no_traceback(tmp_path):
    path = _write(tmp_path, _pool(0, gpu_type="H2O"))
    proc = subprocess.run(
        [sys.executable, "-m", "areal_hex_plugin.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "unknown GPU type 'H2O'" in proc.stderr


def test_unknown_subcommand_and_missing_argument_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["validate"])
    assert exc.value.code == 2
