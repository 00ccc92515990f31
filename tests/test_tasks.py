import sys

import pytest

from phantomclip.training.tasks import TASKS, TaskError, compute_rewards, get_task, load_reward


def test_builtin_rewards():
    ids = [[1], [1, 2, 3], [1] * 8, [1] * 10]
    assert compute_rewards(get_task("neglen").reward, [""] * 4, [""] * 4, ids) == [-1, -3, -8, -10]
    assert compute_rewards(get_task("target-length").reward, [""] * 4, [""] * 4, ids) == [-7, -5, 0, -2]
    prompts = ["What is 3 + 4? Answer with the number only."] * 3
    assert compute_rewards(get_task("add").reward, prompts, ["7", "The answer is 8", "none"], [[1]] * 3) == [1, 0, 0]
    assert get_task("neglen").converged({"completion/length_mean": 2.0, "reward/mean": -2.0})
    assert not get_task("neglen").converged({"completion/length_mean": 2.5, "reward/mean": -2.5})
    assert len(TASKS["add"].prompts(5, 0)) == 5 and TASKS["add"].prompts(5, 0) == TASKS["add"].prompts(5, 0)


def test_unknown_task_and_bad_reward_specs(tmp_path, monkeypatch):
    with pytest.raises(TaskError, match="neglen, target-length, add"):
        get_task("chess")
    with pytest.raises(TaskError, match="module:function"):
        load_reward("nocolon")
    with pytest.raises(TaskError, match="cannot import"):
        load_reward("no_such_module_xyz:f")
    (tmp_path / "my_rewards.py").write_text(
        "def good(p, c, i): return [1.0] * len(c)\n"
        "def short(p, c, i): return [1.0]\n"
        "def boom(p, c, i): raise RuntimeError('bad')\n"
        "def nan(p, c, i): return [float('nan')] * len(c)\n"
        "def text(p, c, i): return ['x'] * len(c)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    assert compute_rewards(load_reward("my_rewards:good"), ["a", "b"], ["a", "b"], [[1], [2]]) == [1.0, 1.0]
    with pytest.raises(TaskError, match="has no function missing"):
        load_reward("my_rewards:missing")
    for fn, msg in (("short", "returned 1 values for 2"), ("boom", "short|raised RuntimeError: bad"),
                    ("nan", "non-finite"), ("text", "not a number")):
        with pytest.raises(TaskError, match=msg):
            compute_rewards(load_reward(f"my_rewards:{fn}"), ["a", "b"], ["a", "b"], [[1], [2]])
