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

import torch

from ..base.errors import PhantomclipError

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
    """Import `module:function` (the module on sys.path or a dotted package path). Whatever the module's import
    raises, SystemExit included (a module that calls sys.exit(0) must not end the command as a success), is one
    TaskError line naming the module; a KeyboardInterrupt is Ctrl-C's and stays one."""
    module_name, sep, fn_name = spec.partition(":")
    if not sep or not module_name or not fn_name:
        raise TaskError(f"--reward {spec!r}: write it as module:function, e.g. my_rewards:score")
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 (user code: SystemExit too, see the docstring)
        raise TaskError(f"--reward {spec!r}: cannot import {module_name} ({exception_line(e)})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskError(f"--reward {spec!r}: {module_name} has no function {fn_name}")
    return fn


def exception_line(e: BaseException) -> str:
    """An exception from user code as one line: its type and its message's first line (a traceback or a multi-line
    message must not become several lines of the command's one-line error)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    more = f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else ""
    return f"{type(e).__name__}: {lines[0][:300]}{more}" if lines else type(e).__name__


def _reward_name(fn: RewardFn) -> str:
    """'module.function': how every reward error names the user's function."""
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', repr(fn))}"


def compute_rewards(fn: RewardFn, prompts: list[str], completions: list[str], ids: list[list[int]]) -> list[float]:
    """Call a reward function and check what it returned; errors name the function and its module. Anything it
    raises, SystemExit included, is one TaskError line (load_reward); a KeyboardInterrupt is Ctrl-C's."""
    name = _reward_name(fn)
    try:
        rewards = list(fn(prompts, completions, ids))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 (user code)
        raise TaskError(f"reward function {name} raised {exception_line(e)}") from None
    if len(rewards) != len(completions):
        raise TaskError(f"reward function {name} returned {len(rewards)} values for {len(completions)} completions")
    try:
        rewards = [float(r) for r in rewards]
    except (TypeError, ValueError, OverflowError):
        raise TaskError(f"reward function {name} returned a value that is not a number") from None
    if not all(math.isfinite(r) for r in rewards):
        raise TaskError(f"reward function {name} returned a non-finite value: {rewards}")
    return rewards


def check_rewards_fit(fn: RewardFn, rewards: torch.Tensor, advantages: torch.Tensor) -> None:
    """Rewards and advantages as the loss uses them (in `rewards.dtype`): a finite Python reward past that dtype's
    range (1e308 in float32) becomes ±inf there, and the step would learn nothing while saying nothing. One TaskError
    line naming the function and the range instead."""
    if bool(torch.isfinite(rewards).all() and torch.isfinite(advantages).all()):
        return
    name = _reward_name(fn)
    dtype = str(rewards.dtype).removeprefix("torch.")
    raise TaskError(f"reward function {name} returned rewards that overflow {dtype}, the dtype the loss uses them in "
                    f"(largest |reward| {torch.finfo(rewards.dtype).max:.3g}, and their spread within a group as "
                    "large): scale the rewards down")
