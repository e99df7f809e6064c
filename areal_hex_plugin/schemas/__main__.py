"""``python -m areal_hex_plugin.schemas``: regenerate ``plan.schema.json`` from the HexPlan dataclasses."""

import json
from pathlib import Path

from areal_hex_plugin.schemas import plan_schema

path = Path(__file__).with_name("plan.schema.json")
path.write_text(json.dumps(plan_schema(), indent=2) + "\n")
print(f"wrote {path}")
