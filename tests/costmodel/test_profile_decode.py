"""The SGLang decode measurement without a GPU: engine arguments from real recipes, batching and timing."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from functools import cache

import pytest

from areal_hex_plugin.areal import profile_decode as pd
from areal_hex_plugin.errors import HexError
from tests.conftest import REPO

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
no_sglang = pytest.mark.skipif(HAS_SGLANG, reason="checks the message for a machine without sglang")


@cache
def _loaded(name: str):
    from areal_hex_plugin.areal.config import load_hex_config

    config, _ = load_hex_config(["--config", str(REPO / "recipes" / "paper" / name)])
    return config


def _config(name: str = "1.5b.yaml"):
    return copy.deepcopy(_loaded(name))


@pytest.fixture
def sglang_version_ok(monkeypatch):
    """upstream's build_args asks for sglang's installed version; pretend the pinned one is there."""
    from areal.utils import pkg_version

    monkeypatch.setattr(pkg_version, "is_version_greater_or_equal", lambda *a: True)


@pytest.mark.integration
def test_engine_args_are_upstreams_server_args_adjusted_per_gpu(sglang_version_ok):
    from areal.api.cli_args import SGLangConfig

    config = _config()
    config.sglang.max_prefill_tokens = 12345
    upstream = SGLangConfig.build_args(sglang_config=config.sglang, tp_size=2, base_gpu_id=0)
    args = pd.engine_args(config, 2, "A100", 40.0)

    assert args["model_path"] == args["tokenizer_path"] == config.actor.path
    assert (args["tp_size"], args["base_gpu_id"], args["max_prefill_tokens"]) == (2, 0, 12345)
    assert args["attention_backend"] == "flashinfer"  # no FA3 on Ampere
    assert args["mem_fraction_static"] == 0.8  # the recipe's, under the 40 GB cap of 0.85
    assert args["disable_radix_cache"] is True
    assert not {"host", "port", "dist_init_addr"} & set(args)
    assert not any(v is None or v is False or v == "" or v == [] for v in args.values())
    # Everything else is upstream's, value for value.
    changed = {"attention_backend", "mem_fraction_static", "disable_radix_cache", "skip_tokenizer_init"}
    assert {k: v for k, v in args.items() if k not in changed} == {
        k: v for k, v in upstream.items() if k not in changed and not pd._unset(v)
    }
    json.dumps(args)


@pytest.mark.integration
def test_engine_args_memory_cap_and_fa3(sglang_version_ok):
    config = _config()
    config.sglang.mem_fraction_static = 0.95
    args = pd.engine_args(config, 1, "H20", 96.0)
    assert (args["attention_backend"], args["mem_fraction_static"]) == ("fa3", 0.9)


@pytest.mark.integration
def test_engine_args_tokenizer_and_model_path(sglang_version_ok, tmp_path):
    config = _config()
    config.sglang = dataclasses.replace(config.sglang, model_path="", skip_tokenizer_init=False)
    config.actor.path = str(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    args = pd.engine_args(config, 1, "H20", 96.0)
    assert args["model_path"] == args["tokenizer_path"] == str(tmp_path)
    assert args["skip_tokenizer_init"] is True  # a folder with no tokenizer

    (tmp_path / "tokenizer.json").write_text("{}")
    assert "skip_tokenizer_init" not in pd.engine_args(config, 1, "H20", 96.0)  # the recipe's False stands

    with pytest.raises(HexError, match="rollout-tp"):
        pd.engine_args(config, 0, "H20", 96.0)


@no_sglang
@pytest.mark.integration
def test_without_sglang_both_entry_points_say_so():
    config = _config()
    with pytest.raises(HexError, match="sglang: is not installed") as engine_err:
        pd.engine_args(config, 1, "H20", 96.0)
    with pytest.raises(HexError, match="sglang: is not installed") as measure_err:
        pd.measure_decode(
            config, gpu_type="H20", hbm_gb=96.0, tp=1, batch_sizes=(1, 4), prompt_tokens=8, decode_tokens=4
        )
    assert "areal-hex-plugin[gpu]" in engine_err.value.fix == measure_err.value.fix


class FakeEngine:
    """A generate callable that records its calls; each call 'takes' prompt and decode time on a fake clock."""

    def __init__(self, prefill_per_seq=0.01, step=0.002, completion=None, retractions=0):
        self.now, self.calls, self.durations = 0.0, [], []
        self.prefill_per_seq, self.step = prefill_per_seq, step
        self.completion, self.retractions = completion, retractions

    def clock(self) -> float:
        return self.now

    def __call__(self, input_ids, params):
        self.calls.append((input_ids, params))
        n = params["max_new_tokens"]
        # Calls vary in speed, so medians differ from means and from any single call.
        slow = (1.0, 1.3, 0.9, 1.05)[len(self.calls) % 4]
        self.durations.append(slow * (self.prefill_per_seq * len(input_ids) + self.step * (n - 1)))
        self.now += self.durations[-1]
        got = self.completion if self.completion is not None else n
        return [
            {"meta_info": {"completion_tokens": got, "total_retractions": self.retractions}}
            for _ in input_ids
        ]


def _time(engine: FakeEngine, batch_sizes=(1, 4), repeats=3, **kw):
    return pd.time_batches(
        engine,
        batch_sizes=batch_sizes,
        prompt_tokens=16,
        decode_tokens=kw.get("decode_tokens", 33),
        repeats=repeats,
        vocab_size=1000,
        sampling={"temperature": 1.0, "top_p": 1.0},
        clock=engine.clock,
    )


def test_each_batch_is_one_call_of_distinct_fresh_prompts():
    engine = FakeEngine()
    _time(engine, batch_sizes=(4, 2), repeats=2)
    # Per batch size: one warm-up, then (prefill, generate) per repeat.
    assert [len(ids) for ids, _ in engine.calls] == [4] * 5 + [2] * 5
    assert [p["max_new_tokens"] for _, p in engine.calls] == [33, 1, 33, 1, 33] * 2
    assert all(p["ignore_eos"] and p["temperature"] == 1.0 for _, p in engine.calls)
    prompts = [tuple(prompt) for ids, _ in engine.calls for prompt in ids]
    assert len(set(prompts)) == len(prompts)
    assert all(len(p) == 16 and min(p) >= 100 and max(p) < 900 for p in prompts)
    first = [ids for ids, _ in engine.calls]
    again = FakeEngine()
    _time(again, batch_sizes=(4, 2), repeats=2)
    assert [ids for ids, _ in again.calls] == first  # fixed seed


def test_points_are_medians_and_step_time():
    engine = FakeEngine(prefill_per_seq=0.01, step=0.002)
    points = _time(engine, batch_sizes=(1, 4), repeats=3)
    assert [p["batch"] for p in points] == [1, 4]
    for i, p in enumerate(points):
        timed = engine.durations[7 * i + 1 : 7 * i + 7]  # after the batch's warm-up call
        assert p["prefill_s"] == pytest.approx(sorted(timed[0::2])[1])
        assert p["generate_s"] == pytest.approx(sorted(timed[1::2])[1])
        assert p["step_s"] == pytest.approx((p["generate_s"] - p["prefill_s"]) / 32)
        assert 0.5 * 0.002 < p["step_s"] < 2 * 0.002
    assert json.loads(json.dumps(points)) == points


def test_wrong_token_counts_and_retractions_are_refused():
    with pytest.raises(HexError, match="completion_tokens"):
        _time(FakeEngine(completion=5))
    with pytest.raises(HexError, match="retracted") as err:
        _time(FakeEngine(retractions=1))
    assert err.value.field == "--batch-sizes"
    with pytest.raises(HexError, match="--decode-tokens"):
        _time(FakeEngine(), decode_tokens=1)


def test_batches_must_fit_the_engine():
    pd._check_limits((1, 8, 32), 100, 28, None, None)
    with pytest.raises(HexError, match="32 is more than the engine's 16 max running") as err:
        pd._check_limits((1, 8, 32), 100, 28, 16, None)
    assert err.value.field == "--batch-sizes"
    with pytest.raises(HexError, match="KV cache of 2048"):
        pd._check_limits((1, 8, 32), 100, 28, None, 2048)
    info = {"max_total_num_tokens": 4096, "internal_states": [{"effective_max_running_requests_per_dp": 48}]}
    assert pd._engine_limits(info) == (48, 4096)
    assert pd._engine_limits({}) == (None, None)


def test_keys_sglang_does_not_know_are_named():
    @dataclasses.dataclass
    class Args:
        model_path: str = ""
        tp_size: int = 1

    pd._check_known({"model_path": "m", "tp_size": 2}, Args, "0.0")
    with pytest.raises(HexError, match="cuda_graph_max_bs") as err:
        pd._check_known({"model_path": "m", "cuda_graph_max_bs": 8}, Args, "0.0")
    assert err.value.field == "sglang.cuda_graph_max_bs"


def test_vocab_size_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 4321}))
    assert pd._vocab_size(str(tmp_path)) == 4321


@pytest.mark.integration
def test_sampling_follows_the_recipe_gconfig():
    gconfig = _config().gconfig
    assert pd._sampling(gconfig)["temperature"] == gconfig.temperature
    assert pd._sampling(dataclasses.replace(gconfig, greedy=True))["temperature"] == 0.0
