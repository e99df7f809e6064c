"""A do-nothing upstream engine that reports where its worker process was placed (used by scheduler tests)."""

from __future__ import annotations

import os

from areal.api.engine_api import InferenceEngine


class PoolProbe(InferenceEngine):
    @property
    def initialized(self) -> bool:
        return True

    def whereami(self) -> dict[str, str]:
        report = {k: v for k, v in os.environ.items() if k.startswith("HEX_")}
        report["pid"] = str(os.getpid())
        try:
            import ray

            if ray.is_initialized():
                report["ray_node_id"] = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return report


class AnswerProbe(InferenceEngine):
    """Answers ``agenerate`` and ``submit`` calls from the rollout controller: ``{"fail": True}`` raises and
    ``{"sleep_s": s}`` answers after ``s`` seconds (a request that a caller can abort mid-flight)."""

    @property
    def initialized(self) -> bool:
        return True

    def agenerate(self, req: dict) -> dict:
        import time

        if req.get("fail"):
            raise RuntimeError("this request fails on purpose")
        time.sleep(req.get("sleep_s", 0.0))
        return {"pid": os.getpid()}

    def submit(self, data: dict, **kwargs) -> int:
        self.agenerate(data)
        return kwargs["task_id"]

    def wait_for_task(self, task_id: int, **kwargs) -> dict:
        return {"task_id": task_id, "pid": os.getpid()}


class LaunchProbe(PoolProbe):
    """Stands in for a rollout server launcher: records the ``server_args`` upstream's controller sends it."""

    def __init__(self, config=None) -> None:
        self.config = config
        self.server_args: dict | None = None

    def launch_server(self, server_args: dict):
        from areal.api.io_struct import LocalInfServerInfo

        self.server_args = dict(server_args)
        return LocalInfServerInfo(host="127.0.0.1", port=10_000 + os.getpid() % 50_000, process=None)

    def initialize(self, *args, **kwargs) -> None:
        pass

    def destroy(self) -> None:
        pass

    def launched(self) -> dict:
        return {"server_args": self.server_args, "env": self.whereami()}
