"""The SGLang stand-in as upstream drives it: launched by HexSGLangBackend through HEX_SGLANG_SERVER_MODULE,
generating for upstream's RemoteSGLangEngine with real per-token log-probs, pausing and aborting as SGLang does,
and taking new weights through the relay transport's SGLang sink, after which it generates with them."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

pytest.importorskip("areal")

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, SGLangConfig  # noqa: E402
from areal.api.io_struct import ModelRequest  # noqa: E402

from areal_hex_plugin.areal.engines import SERVER_MODULE_ENV, HexRemoteSGLangEngine  # noqa: E402
from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route  # noqa: E402
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig  # noqa: E402
from tests.e2e.assets import write_model, write_sglang_metadata  # noqa: E402
from tests.e2e.sglang_server import LOG_DIR_ENV, weights_digest  # noqa: E402
from tests.transport.harness import TOKEN  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """What the model itself gives each output token (temperature 1)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def _generate(engine, prompt: list[int], n: int = 8):
    gconfig = GenerationHyperparameters(max_new_tokens=n, max_tokens=256, temperature=1.0, n_samples=1)
    return asyncio.run(engine.agenerate(ModelRequest(input_ids=list(prompt), gconfig=gconfig)))


def test_upstream_engine_drives_the_standin(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    monkeypatch.setenv(SERVER_MODULE_ENV, "tests.e2e.sglang_server")
    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path / "log"))
    monkeypatch.setenv("HEX_POOL", "small")
    monkeypatch.syspath_prepend(str(write_sglang_metadata(tmp_path / "meta")))
    model_dir = write_model(tmp_path / "model", seed=0)
    new_dir = write_model(tmp_path / "model-new", seed=1)
    engine = HexRemoteSGLangEngine(
        InferenceEngineConfig(
            experiment_name="hex", trial_name="t", pause_grace_period=0.0, setup_timeout=120
        )
    )
    info = engine.launch_server(
        SGLangConfig.build_args(SGLangConfig(model_path=str(model_dir)), tp_size=1, base_gpu_id=0)
    )
    address = f"http://{info.host}:{info.port}"
    try:
        engine.initialize(addr=f"{info.host}:{info.port}", train_data_parallel_size=1)
        old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        prompt = [5, 6, 7, 8]
        first = _generate(engine, prompt)
        assert 1 <= len(first.output_tokens) <= 8 and first.stop_reason in ("stop", "length")
        got = torch.tensor(first.output_logprobs)
        assert torch.allclose(got, _logprobs(old, prompt, first.output_tokens), atol=0.05)

        # SGLang's pause: a running request returns at once with "abort" and what it has; new ones wait.
        with ThreadPoolExecutor(2) as pool:
            # Longer than any pause can take to land: an unloaded machine decodes 500 tiny-model tokens in 1 s.
            long = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
            running = pool.submit(requests.post, f"{address}/generate", json=long, timeout=120)
            time.sleep(1.0)
            engine.pause_generation()
            aborted = running.result().json()["meta_info"]
            assert aborted["finish_reason"]["type"] == "abort" and aborted["completion_tokens"] < 100_000
            held = pool.submit(requests.post, f"{address}/generate", json={"input_ids": prompt}, timeout=120)
            time.sleep(1.0)
            assert not held.done()
            engine.continue_generation()
            assert held.result().json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")

        # New weights through the relay transport's SGLang sink: the server reports the version and their digest.
        endpoint = Endpoint.parse(
            engine.hex_start_receiver(bind_host="127.0.0.1", stage_dir=str(tmp_path / "s"))
        )
        new = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.bfloat16).eval()
        sender = RelaySender(Route([PoolRoute("small", [endpoint], 1.5, 5.0)]), SenderConfig(), token=TOKEN)
        sender.send_version(4, [list(new.state_dict().items())])
        sender.close()
        assert requests.get(f"{address}/get_weight_version", timeout=5).json() == {"weight_version": "4"}
        second = _generate(engine, prompt)
        got = torch.tensor(second.output_logprobs)
        assert torch.allclose(got, _logprobs(new, prompt, second.output_tokens), atol=0.05)
        (log_file,) = (tmp_path / "log").glob("small-*.jsonl")
        log = [json.loads(line) for line in log_file.read_text().splitlines()]
        loads = [(r["version"], r["digest"]) for r in log if r["event"] == "load"]
        digests = [weights_digest(m.state_dict().items()) for m in (old, new)]
        assert loads == [("default", digests[0]), ("4", digests[1])]
        used = [r["version"] for r in log if r["event"] == "generate" and r["finish"] != "abort"]
        assert used[0] == "default" and used[-1] == "4"
    finally:
        engine.hex_stop_receiver()
        engine.destroy()
        engine.teardown_server()
    assert info.process.poll() is not None  # the server is gone


def test_a_health_poll_during_startup_waits_for_the_whole_server(tmp_path, monkeypatch):
    """Upstream's launcher polls /health as soon as the port listens. A poll that lands while the server is
    still loading waits, and then finds /generate there: answered early, it made Flask refuse the rest of the
    routes and the server died (CI, 2026-12-06)."""
    from tests.e2e.sglang_server import SGLangCPUServer

    polled = []

    def digest_after_a_poll(self):  # digest() runs while the server is being built
        if not polled:
            poll = ThreadPoolExecutor(1).submit(requests.get, f"http://{self.address}/health", timeout=60)
            polled.append(poll)
            time.sleep(0.5)  # long enough for a running server to answer it
        return "digest"

    monkeypatch.setattr(SGLangCPUServer, "digest", digest_after_a_poll)
    server = SGLangCPUServer(str(write_model(tmp_path / "model", seed=0)))
    try:
        assert polled[0].result().status_code == 200
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2}}
        answer = requests.post(f"http://{server.address}/generate", json=body, timeout=60)
        assert answer.json()["meta_info"]["completion_tokens"] >= 1
    finally:
        server.close()


def test_tp2_standin_generates_from_its_shards(tmp_path):
    """A server started with --tp-size 2 holds every split tensor as two SGLang-style shards, computes each step
    from them (its log-probs are the whole model's), takes new weights into them, and runs at most
    --max-running-requests requests at once, reported on /metrics."""
    from transformers import AutoModelForCausalLM

    from areal_hex_plugin.areal.server_stats import read_server
    from tests.e2e.sglang_server import KV_POOL_TOKENS, SGLangCPUServer

    model_dir = write_model(tmp_path / "model", seed=0)
    new_dir = write_model(tmp_path / "model-new", seed=1)
    log = tmp_path / "server.jsonl"
    server = SGLangCPUServer(str(model_dir), log_path=str(log), tp_size=2, max_running_requests=1)
    address = f"http://{server.address}"
    try:
        assert requests.get(f"{address}/get_server_info", timeout=5).json()["tp_size"] == 2
        full = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict())
        name = "model.layers.0.self_attn.q_proj.weight"
        halves = [shard[name] for shard in server.model.shards]
        assert [h.shape[0] for h in halves] == [full[name].shape[0] // 2] * 2
        assert torch.equal(torch.cat(halves), full[name])

        prompt = [5, 6, 7, 8]
        for model_path in (model_dir, new_dir):
            if model_path == new_dir:
                answer = requests.post(
                    f"{address}/update_weights_from_disk",
                    json={"model_path": str(new_dir), "weight_version": "1"},
                    timeout=60,
                )
                assert answer.json()["success"], answer.text
            reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}}
            meta = requests.post(f"{address}/generate", json=body, timeout=60).json()["meta_info"]
            tokens = [t for _, t, _ in meta["output_token_logprobs"]]
            got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
            assert torch.allclose(got, _logprobs(reference, prompt, tokens), atol=0.05)
            assert server.digest() == weights_digest(reference.state_dict().items())

        # One request at a time: the second waits until the first is aborted.
        with ThreadPoolExecutor(2) as pool:
            long = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True}}
            first = pool.submit(requests.post, f"{address}/generate", json=long, timeout=120)
            time.sleep(0.5)
            second = pool.submit(
                requests.post, f"{address}/generate", json={"input_ids": prompt}, timeout=120
            )
            time.sleep(1.0)
            assert not second.done()
            reading = read_server(server.address)  # SGLang's /metrics, as the online refit reads it
            assert reading.running == 1.0 and reading.tokens_per_s > 0
            # The one running request holds its prompt and the tokens made so far in the 65,536-token pool.
            assert len(prompt) / KV_POOL_TOKENS < reading.kv_usage < 100_000 / KV_POOL_TOKENS
            requests.post(f"{address}/abort_request", json={}, timeout=5)
            assert first.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert second.result().json()["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    finally:
        server.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["tp_size"] == 2
    assert records[0]["max_running_requests"] == 1


def test_a_rollout_worker_gets_the_whole_staleness_budget(tmp_path):
    """Started by the controller (no data-parallel size given), a server's executor may hold the whole batch and
    every rollout in flight: share routing sends the tp1 server of the CI plan 3/4 of the batch, more than the 1/2
    upstream's even split (``consumer_batch_size // servers``) allows, and that split stalled the run at its
    second step. With a data-parallel size (upstream's SPMD trainers) upstream's split stays."""
    from tests.e2e.sglang_server import SGLangCPUServer

    server = SGLangCPUServer(str(write_model(tmp_path / "model", seed=0)))
    config = dict(experiment_name="hex", trial_name="t", backend="sglang:d2p1t1", setup_timeout=60)
    config.update(consumer_batch_size=4, max_concurrent_rollouts=3, max_head_offpolicyness=1)
    try:
        for given, budget in ((None, (4, 3)), (2, (2, 1))):
            engine = HexRemoteSGLangEngine(InferenceEngineConfig(**config))
            engine.initialize(addr=server.address, train_data_parallel_size=given)
            try:
                manager = engine.workflow_executor.staleness_manager
                assert (manager.consumer_batch_size, manager.max_concurrent_rollouts) == budget, given
            finally:
                engine.destroy()
    finally:
        server.close()
