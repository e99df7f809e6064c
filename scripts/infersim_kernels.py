"""Copy InferSim's measured decode-attention latencies into ``costmodel/profiles/kernels/infersim_attention.json``.

alibaba/InferSim (Apache-2.0) ships FlashInfer decode-attention timings measured on H20 and H800 (SXM) GPUs
(``bench_data/mha/decode/<gpu>/<q heads>-<kv heads>-<head dim>.csv``: bf16 query and KV, batch x KV length ->
microseconds for one layer). ``costmodel/kernel_checks.py`` reads the copy to check each GPU type's
``hbm_fraction`` against the rate those kernels stream KV at. Only the layouts whose query heads share a KV head
eight ways or fewer are copied: those stream KV (wider groups are compute-bound on H20) and they are the paper
models' layouts per GPU at TP 1 (2, 4 and 8 KV heads of 128). Run with a checkout of InferSim:

    git clone https://github.com/alibaba/InferSim /tmp/infersim
    python3 scripts/infersim_kernels.py /tmp/infersim
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
from pathlib import Path

from areal_hex_plugin.costmodel.kernel_checks import ATTENTION, FORMAT, MAX_GROUP

DEVICES = {"H20": "h20", "H800": "h800"}  # catalog name -> InferSim's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("infersim", type=Path, help="a checkout of github.com/alibaba/InferSim")
    parser.add_argument(
        "--out", type=Path, default=ATTENTION, help="where to write (default: the shipped file)"
    )
    args = parser.parse_args()
    root = args.infersim
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    kernels = []
    for gpu_type, device in DEVICES.items():
        for path in sorted((root / "bench_data/mha/decode" / device).glob("*.csv")):
            q_heads, kv_heads, head_dim = (int(x) for x in path.stem.split("-"))
            if q_heads // kv_heads > MAX_GROUP:
                continue
            with path.open() as f:
                rows = [
                    [int(r["batch_size"]), int(r["kv_len"]), float(r["latency_us"])]
                    for r in csv.DictReader(f)
                    if r["dtype"] == r["kv_dtype"] == "bf16"
                ]
            kernels.append(
                {
                    "gpu_type": gpu_type,
                    "q_heads": q_heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "rows": rows,
                }
            )
    table = {
        "format": FORMAT,
        "source": (
            f"alibaba/InferSim bench_data/mha/decode at commit {commit[:12]} (Apache-2.0, "
            "https://github.com/alibaba/InferSim): FlashInfer decode attention, bf16 KV, one layer"
        ),
        "kernels": kernels,
    }
    body = ",\n  ".join(json.dumps(k) for k in kernels)
    head = json.dumps({k: v for k, v in table.items() if k != "kernels"}, indent=1)[:-2]
    args.out.write_text(f'{head},\n "kernels": [\n  {body}\n ]\n}}\n')
    print(f"{len(kernels)} kernels written to {args.out}")


if __name__ == "__main__":
    main()
