"""bench/agent_steps stays runnable: a 2-step smolagents run, plain, attached and after a restart,
in new interpreters against a real daemon (the figures' shape, no timing thresholds)."""

import pytest

pytest.importorskip("smolagents")

from bench import agent_steps  # noqa: E402


def test_two_steps_plain_attached_and_after_a_restart():
    res = agent_steps.run(steps=2)
    runs = res["runs"]
    plain, attached, again = runs["plain"], runs["attached"], runs["after a restart, the same task"]
    assert res["same_outputs"]
    assert plain["prefilled"] == plain["prompt"]  # mlx-lm alone: every whole prompt
    assert attached["prefilled"][0] == plain["prompt"][0]  # a fresh store: step 1 is cold
    assert attached["prefilled"][1] < plain["prompt"][1] // 4  # step 2: only what is new
    assert again["prefilled"][:2] == [1, 1]  # after a restart: served from the store
    new = runs["after a restart, a new task"]
    assert new["prefilled"][0] < runs["plain, the new task"]["prompt"][0] // 4  # only the task
    assert "2 steps" in agent_steps._table(res)
