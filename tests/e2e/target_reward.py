"""A task the tiny random model can learn by GRPO: reward 1 when the first generated token is a target token.

The target tokens are every ``TARGET_EVERY``-th id of the vocabulary, a quarter of it, so the initial policy (near
uniform: random weights) earns about 1/4 and a group of samples almost always mixes rewards, which gives every
step a gradient until the policy has learnt; it learns by moving probability onto those ids at the first
position.
:func:`first_token_reward` is the recipe's ``hex.reward_fn``, called by upstream's ``RLVRWorkflow`` in the rollout
workers; :func:`target_probability` is the exact expected reward of a model (no sampling), and
:func:`chance_tail` how likely a mean reward at least that high is from a policy that earns at most ``p``.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean

TARGET_EVERY = 4
# The learning run (recipes/ci/tiny.yaml: 4 prompts x 8 samples a step, Adam at lr 1.5e-2): LEARN_STEPS steps take
# the policy from ~0.25 to near 1 (where whole steps earn the reward and have no gradient). Its test: the
# mean task reward of the last CURVE_WINDOW steps reaches LEARNED, and CHANCE bounds how likely those steps'
# samples reach it from a policy no better than the initial one (the binomial tail from the initial model's exact
# per-prompt probabilities: 5e-7 for 4 steps of 32 samples).
LEARN_STEPS = 20
CURVE_WINDOW = 4
LEARNED = 0.45
CHANCE = 1e-6
# Upstream's stats (areal 1.0.4 PPOActor), as its StatsLogger commits them: a step's mean task reward and its
# sequence count.
TASK_REWARD = "ppo_actor/task_reward/avg"
SEQUENCES = "ppo_actor/n_seqs"


def is_target(token_id: int) -> bool:
    return token_id % TARGET_EVERY == 0


def first_token_reward(prompt, completions, prompt_ids, completion_ids, **kwargs) -> float:
    """Upstream's reward signature (``RLVRWorkflow``): 1.0 when the completion starts with a target token."""
    return float(bool(completion_ids) and is_target(int(completion_ids[0])))


def prompt_ids(model_dir: Path, dataset_dir: Path) -> list[list[int]]:
    """The token ids upstream's RLVRWorkflow sends for each training prompt (upstream's GSM8K loader and chat
    template)."""
    from areal.dataset.gsm8k import get_gsm8k_rl_dataset
    from areal.utils.hf_utils import load_hf_tokenizer
    from areal.workflow.rlvr import default_get_input_ids_fn

    tokenizer = load_hf_tokenizer(str(model_dir))
    rows = get_gsm8k_rl_dataset(str(dataset_dir), "train", tokenizer)
    return [default_get_input_ids_fn(row["messages"], tokenizer, False) for row in rows]


def target_probability(weights: dict | None, model_dir: Path, prompts: list[list[int]]) -> list[float]:
    """Per prompt, the probability that the first token sampled at temperature 1 is a target token: the expected
    reward of the model in ``model_dir`` (bf16, as the servers run it), with ``weights`` loaded if given."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    if weights is not None:
        model.load_state_dict(weights)
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            probs = torch.softmax(logits, -1)
            out.append(float(probs[::TARGET_EVERY].sum()))
    return out


def chance_tail(successes: int, trials: int, p: float) -> float:
    """P(Binomial(trials, p) >= successes): how likely ``successes`` rewards in ``trials`` samples are from a
    policy whose every sample earns with probability at most ``p``."""
    return sum(math.comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(successes, trials + 1))


def learning(rows: list[dict], initial: list[float], trained: list[float]) -> dict:
    """The learning curve of a run's logged steps (``rows``, upstream's stats per step) beside the initial and the
    trained policy's expected reward per prompt, and whether it passes: the last CURVE_WINDOW steps' mean reward
    reaches LEARNED, which the initial policy's samples reach with probability below CHANCE, and so does the
    trained policy's exact expected reward."""
    curve = [row[TASK_REWARD] for row in rows]
    trials = round(sum(row[SEQUENCES] for row in rows[-CURVE_WINDOW:]))
    # Each sample earns with probability at most the initial policy's largest over the prompts.
    chance = chance_tail(math.ceil(LEARNED * trials), trials, max(initial))
    last = mean(curve[-CURVE_WINDOW:])
    return {
        "curve": [round(r, 4) for r in curve],
        "first_mean": round(mean(curve[:CURVE_WINDOW]), 4),
        "last_mean": round(last, 4),
        "last_samples": trials,
        "threshold": LEARNED,
        "initial_expected_reward": round(mean(initial), 4),
        "trained_expected_reward": round(mean(trained), 4),
        "chance_of_threshold": chance,
        "passed": chance < CHANCE and last >= LEARNED and mean(trained) >= LEARNED,
    }
