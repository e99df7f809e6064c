"""Everything the CI recipe trains on, made locally: a tiny Qwen2 model with random weights, its tokenizer (a
byte-level BPE trained here, with a chat template) and a GSM8K-shaped arithmetic dataset.

    python -m tests.e2e.assets /tmp/areal-hex-ci     # model/, gsm8k/, sglang-metadata/ (recipes/ci/tiny.yaml)

The model's shape is ``recipes/ci/tiny-qwen2/config.json``, which the recipe also plans with.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_CONFIG = REPO / "recipes" / "ci" / "tiny-qwen2" / "config.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (config.json agrees)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def problems(n: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-shaped rows: a question and an answer that ends in ``#### <number>``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return rows


def write_dataset(folder: Path, train: int = 128, test: int = 8) -> Path:
    """A local dataset folder that upstream's GSM8K loader reads (``load_dataset(path, name="main")``)."""
    (folder / "main").mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 0), ("test", test, 1)):
        lines = [json.dumps(row) for row in problems(n, seed)]
        (folder / "main" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n"
        "  - {split: train, path: main/train.jsonl}\n  - {split: test, path: main/test.jsonl}\n---\n"
    )
    return folder


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        f"{r['question']}\nPlease put your final answer within \\boxed{{}}. {r['answer']}"
        for r in problems(256, 2)
    ]
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def write_model(folder: Path, seed: int = 0) -> Path:
    """The tiny Qwen2 (random weights, bf16) and its tokenizer, saved as an HF folder."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**json.loads(MODEL_CONFIG.read_text()))
    tokenizer = build_tokenizer(config.vocab_size)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, the model {config.vocab_size}")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# Upstream's SGLangConfig.build_args (the trainer builds the servers' flags with it) refuses to run unless an
# sglang>=0.5.10.post1 distribution is installed, though it imports nothing from it. The servers here are the
# stand-in, which takes SGLang's flags, so the run gets that distribution's metadata only (no `sglang` module:
# anything that imports sglang still fails).
SGLANG_GATE_VERSION = "0.5.10.post1"


def write_sglang_metadata(folder: Path) -> Path:
    """A folder to put on PYTHONPATH that holds only ``sglang``'s distribution metadata (see above)."""
    info = folder / f"sglang-{SGLANG_GATE_VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {SGLANG_GATE_VERSION}\n")
    return folder


def write_assets(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_model(root / "model")
    write_dataset(root / "gsm8k")
    write_sglang_metadata(root / "sglang-metadata")
    return root


if __name__ == "__main__":
    print(write_assets(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/areal-hex-ci")))
