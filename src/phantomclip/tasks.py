"""Reward tasks: a small registry, plus user rewards loaded from `module:function`.

A reward function takes (prompts, completions, completion_ids) and returns one float per completion.
`neglen` is the reference analysis's sanity task (reward = −completion length: the optimum is to emit EOS
at once); `target-length` and `add` have non-degenerate optima, so an intervention is also judged where the
answer is not "stop".
"""

from __future__ import annotations

import importlib
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import PhantomclipError

RewardFn = Callable[[list[str], list[str], list[list[int]]], list[float]]


class TaskError(PhantomclipError):
    """Unknown task, unloadable reward, or a reward function that misbehaves."""


@dataclass(frozen=True)
class Task:
    name: str
    reward: RewardFn
    """(prompts, completions, completion_ids) -> one reward per completion."""
    converged: Callable[[dict[str, float]], bool]
    """step metrics -> True once the task counts as solved."""
    doc: str
    prompts: Callable[[int, int], list[str]] | None = None
    """(n, seed) -> task prompts; None means the bundled prompt set."""


def _neglen(prompts, completions, ids):
    return [-float(len(c)) for c in ids]


TARGET_LEN = 8


def _target_length(prompts, completions, ids):
    return [-float(abs(len(c) - TARGET_LEN)) for c in ids]


def _add_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"What is {a} + {b}? Answer with the number only."
            for a, b in ((rng.randint(1, 20), rng.randint(1, 20)) for _ in range(n))]


def _add(prompts, completions, ids):
    out = []
    for p, c in zip(prompts, completions):
        a, b = map(int, re.findall(r"(\d+) \+ (\d+)", p)[0])
        numbers = re.findall(r"-?\d+", c)
        out.append(1.0 if numbers and int(numbers[0]) == a + b else 0.0)
    return out


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("neglen", _neglen, lambda m: m["completion/length_mean"] <= 2.0,
             "reward = -completion length; solved when the mean length is <= 2 tokens"),
        Task("target-length", _target_length, lambda m: m["reward/mean"] >= -1.0,
             f"reward = -|length - {TARGET_LEN}|; solved when the mean reward is >= -1"),
        Task("add", _add, lambda m: m["reward/mean"] >= 0.9,
             "two-number addition, reward 1 if the first number in the answer is right; solved at mean reward >= 0.9",
             prompts=_add_prompts),
    ]
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}: use one of {', '.join(TASKS)}, or --reward module:function")
    return TASKS[name]


def load_reward(spec: str) -> RewardFn:
    """Import `module:function` (the module on sys.path or a dotted package path)."""
    module_name, sep, fn_name = spec.partition(":")
    if not sep or not module_name or not fn_name:
        raise TaskError(f"--reward {spec!r}: write it as module:function, e.g. my_rewards:score")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise TaskError(f"--reward {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskError(f"--reward {spec!r}: {module_name} has no function {fn_name}")
    return fn


def compute_rewards(fn: RewardFn, prompts: list[str], completions: list[str], ids: list[list[int]]) -> list[float]:
    """Call a reward function and check what it returned; errors name the function."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        rewards = list(fn(prompts, completions, ids))
    except Exception as e:
        raise TaskError(f"reward function {name} raised {type(e).__name__}: {e}") from None
    if len(rewards) != len(completions):
        raise TaskError(f"reward function {name} returned {len(rewards)} values for {len(completions)} completions")
    try:
        rewards = [float(r) for r in rewards]
    except (TypeError, ValueError):
        raise TaskError(f"reward function {name} returned a value that is not a number") from None
    if not all(math.isfinite(r) for r in rewards):
        raise TaskError(f"reward function {name} returned a non-finite value: {rewards}")
    return rewards
