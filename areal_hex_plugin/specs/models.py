"""Model shapes: from a local Hugging Face ``config.json`` or a built-in table of common dense models."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.typed import between


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool
    head_dim: int = 0  # 0: hidden // heads
    qkv_bias: bool = False

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Elements of K (or V) per token per layer: GQA-aware."""
        return self.kv_heads * self.dim_per_head

    @cached_property  # read per stage cost by the training search: computed once per shape
    def params_per_layer(self) -> int:
        q = self.heads * self.dim_per_head
        attn = self.hidden * q + 2 * self.hidden * self.kv_width + q * self.hidden
        if self.qkv_bias:
            attn += q + 2 * self.kv_width
        return attn + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @cached_property
    def params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params + self.hidden

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        return 2 * self.layers * self.kv_width * bytes_per_element

    def weight_bytes(self, bytes_per_element: int = 2) -> int:
        return self.params * bytes_per_element


def _m(name, layers, hidden, heads, kv, ffn, vocab, tied, head_dim=0, bias=False) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv, ffn, vocab, tied, head_dim, bias)


# Public config.json figures of each model.
BUILTIN_MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _m("DeepSeek-R1-Distill-Qwen-1.5B", 28, 1536, 12, 2, 8960, 151936, False, bias=True),
        _m("DeepSeek-R1-Distill-Qwen-7B", 28, 3584, 28, 4, 18944, 152064, False, bias=True),
        _m("DeepSeek-R1-Distill-Qwen-14B", 48, 5120, 40, 8, 13824, 152064, False, bias=True),
        _m("DeepSeek-R1-Distill-Qwen-32B", 64, 5120, 40, 8, 27648, 152064, False, bias=True),
        _m("Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, True, bias=True),
        _m("Qwen2.5-1.5B", 28, 1536, 12, 2, 8960, 151936, True, bias=True),
        _m("Qwen2.5-3B", 36, 2048, 16, 2, 11008, 151936, True, bias=True),
        _m("Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, False, bias=True),
        _m("Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, False, bias=True),
        _m("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, False, bias=True),
        _m("Qwen2.5-72B", 80, 8192, 64, 8, 29568, 152064, False, bias=True),
        _m("Qwen3-0.6B", 28, 1024, 16, 8, 3072, 151936, True, head_dim=128),
        _m("Qwen3-1.7B", 28, 2048, 16, 8, 6144, 151936, True, head_dim=128),
        _m("Qwen3-4B", 36, 2560, 32, 8, 9728, 151936, True, head_dim=128),
        _m("Qwen3-8B", 36, 4096, 32, 8, 12288, 151936, False, head_dim=128),
        _m("Qwen3-14B", 40, 5120, 40, 8, 17408, 151936, False, head_dim=128),
        _m("Qwen3-32B", 64, 5120, 64, 8, 25600, 151936, False, head_dim=128),
        _m("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, True, head_dim=64),
        _m("Llama-3.2-3B", 28, 3072, 24, 8, 8192, 128256, True, head_dim=128),
        _m("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, False),
        _m("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, False),
    )
}

_FOLDED = {name.lower(): shape for name, shape in BUILTIN_MODELS.items()}
# HF model types whose attention has q/k/v biases without saying so in config.json.
_QKV_BIAS_TYPES = {"qwen2"}


# The config.json fields a shape needs, with the ranges a real dense decoder has (generously).
_HF_FIELDS = {
    "num_hidden_layers": ("layers", between(1, 1_024)),
    "hidden_size": ("hidden", between(1, 1_000_000)),
    "num_attention_heads": ("heads", between(1, 10_000)),
    "intermediate_size": ("ffn", between(1, 10_000_000)),
    "vocab_size": ("vocab", between(1, 100_000_000)),
}


def from_hf_config(config: dict, name: str, source: str) -> ModelShape:
    """A shape from the fields of an HF ``config.json`` (dense decoder models)."""
    values = {}
    for key, (attr, allowed) in _HF_FIELDS.items():
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
            raise HexError(
                source,
                f"config.json has no {key!r} that is a whole number in {allowed}",
                "point at a dense decoder model",
            )
        values[attr] = value
    optional = {"num_key_value_heads": values["heads"], "head_dim": 0}
    for key in optional:
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value not in between(0, 100_000):
            raise HexError(source, f"config.json's {key!r} is {value!r}", "point at a dense decoder model")
        optional[key] = value or optional[key]
    bias = bool(config.get("attention_bias", config.get("model_type") in _QKV_BIAS_TYPES))
    return ModelShape(
        name=name,
        kv_heads=optional["num_key_value_heads"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=optional["head_dim"],
        qkv_bias=bias,
        **values,
    )


def resolve_model(spec: str, field_path: str) -> ModelShape:
    """A model shape from a local HF directory / config.json, or a built-in name (an HF id's last part works)."""
    path = Path(spec).expanduser()
    try:
        config_file = path / "config.json" if path.is_dir() else path
        local = config_file.is_file()
    except OSError:  # a name too long for a file name, or a path this user cannot see into
        local = False
    if local:
        try:
            config = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise HexError(
                field_path, f"cannot read {config_file}: {exc}", "point at a readable HF config.json"
            ) from None
        if not isinstance(config, dict):
            raise HexError(field_path, f"{config_file} is not a JSON object", "point at an HF config.json")
        return from_hf_config(config, path.name if path.is_dir() else path.parent.name, field_path)
    base = spec.rstrip("/").split("/")[-1].lower()
    # Fine-tuned variants share the base shape: Qwen2.5-7B-Instruct, Llama-3.1-8B-Instruct, ...
    shape = _FOLDED.get(base) or _FOLDED.get(re.sub(r"-(instruct|chat|base|it)$", "", base))
    if shape is None:
        shown = spec if len(spec) <= 80 else spec[:77] + "..."
        raise HexError(
            field_path,
            f"model {shown!r} is neither a local HF model directory nor a built-in model",
            f"give a directory with config.json, or set hex.workload.model to one of {', '.join(BUILTIN_MODELS)}",
        )
    return shape
