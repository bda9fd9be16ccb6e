"""The frameworks as users meet them, with one added line (`kvstore.client.attach`): smolagents'
`MLXModel`, LangChain's `ChatMLX` over `MLXPipeline`, Outlines' `MLXLM` (and llama-index's
`MLXLLM`), each on a tiny generated model with a real `kvstore daemon`. Two agent steps: the
second prefills only what is new, both answer what the framework alone answers; then a new
process whose first step is served from the store. A framework not installed is skipped."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from helpers import wait_learned

from kvstore.client import attach
from tests.integrations.frameworks import DRIVERS, MAX, installed, langchain_fix, turns

ROOT = Path(__file__).resolve().parents[2]
NAMES = [
    pytest.param(n, marks=pytest.mark.skipif(not installed(n), reason=f"{n} is not installed"))
    for n in DRIVERS
]


def fixed(name: str):
    """LangChain generates only with its upstream fix in effect (frameworks.py says why)."""
    return langchain_fix() if name == "langchain" else contextlib.nullcontext()


def settled(daemon) -> dict:
    """The daemon's learned stats once records arrived and stopped changing for a second."""
    first = wait_learned(daemon)
    last, since = first, time.monotonic()
    deadline = since + 10.0
    while time.monotonic() - since < 1.0 and time.monotonic() < deadline:
        time.sleep(0.1)
        now = daemon.request("stats").get("learned") or {}
        if now != last:
            last, since = now, time.monotonic()
    return last


def new_process(name: str, model: Path, home: Path, messages: list) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.frameworks", name, str(model), str(home)],
        input=json.dumps(messages), capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "KVSTORE_HOME": str(home), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", NAMES)
def test_two_steps_then_a_restart_prefill_only_what_is_new(name, llama_path, daemon):
    driver = DRIVERS[name](str(llama_path))
    with fixed(name):
        plain1 = driver.step(turns())
        plain2 = driver.step(turns(plain1))
        with attach(driver.model, driver.tokenizer, llama_path, home=daemon.home,
                    verbose=False) as att:  # fmt: skip
            step1 = driver.step(turns())
            step2 = driver.step(turns(step1))
            calls = att.calls
    assert (step1, step2) == (plain1, plain2)  # the framework's own answers, token for token
    (prompt1, cached1), (prompt2, cached2) = [(c.prompt_tokens, c.cached_tokens) for c in calls]
    assert cached1 == 0
    assert cached2 >= prompt1  # the second step prefilled only what is new
    assert prompt2 - cached2 < prompt2 // 4

    settled(daemon)  # step 2 extended step 1's prompt: the daemon keeps it
    again = new_process(name, llama_path, daemon.home, turns())
    assert again["text"] == plain1
    [(prompt, cached)] = again["calls"]
    assert prompt == prompt1 and cached == prompt1 - 1  # all but the token that makes the logits


@pytest.mark.parametrize("name", [n for n in NAMES if n.values[0] != "langchain"])
def test_a_call_with_its_own_prompt_cache_is_left_alone(name, llama_path, kv_home):
    """smolagents (`MLXModel.generate(..., prompt_cache=)`) and Outlines pass a keyword on to
    mlx-lm; LangChain's MLXPipeline takes none."""
    from mlx_lm.models.cache import make_prompt_cache

    driver = DRIVERS[name](str(llama_path))
    own = make_prompt_cache(driver.model)
    with attach(driver.model, driver.tokenizer, llama_path, verbose=False) as att:
        driver.step(turns(), prompt_cache=own)
        assert att.calls == [] and len(att.cache) == 0  # not fetched, not recorded, not kept
    assert own[0].offset > 0  # the app's own cache got the prompt, as without kvstore


@pytest.mark.parametrize("name", NAMES)
def test_detach_undoes_it(name, llama_path, kv_home):
    driver = DRIVERS[name](str(llama_path))
    with fixed(name):
        att = attach(driver.model, driver.tokenizer, llama_path, verbose=False)
        driver.step(turns())
        att.detach()
        driver.step(turns())
    assert len(att.calls) == 1  # only the call made while attached went through the cache


@pytest.mark.skipif(not installed("langchain"), reason="langchain-community is not installed")
def test_langchain_as_released_fails_the_same_with_or_without_kvstore(llama_path, kv_home):
    """langchain-community 0.4.2 on mlx-lm 0.31 / 0.32: `invoke` passes `formatter=` to mlx-lm
    (TypeError) and `stream` imports `generate_step` from `mlx_lm.utils` (gone: ImportError).
    kvstore neither hides nor changes either."""
    from langchain_community.chat_models.mlx import ChatMLX
    from langchain_community.llms.mlx_pipeline import MLXPipeline
    from langchain_core.messages import HumanMessage

    pipe = MLXPipeline.from_model_id(str(llama_path), pipeline_kwargs={"max_tokens": MAX})
    chat = ChatMLX(llm=pipe)
    ask = [HumanMessage(content="hello")]
    said = []
    for attached in (False, True):
        with contextlib.ExitStack() as stack:
            if attached:
                stack.enter_context(attach(pipe.model, pipe.tokenizer, llama_path, verbose=False))
            for call in (chat.invoke, lambda m: list(chat.stream(m))):
                with pytest.raises((TypeError, ImportError)) as e:
                    call(ask)
                said.append((type(e.value), str(e.value)))
    assert said[:2] == said[2:]
    assert said[0][0] is TypeError and "formatter" in said[0][1]
    assert said[1][0] is ImportError and "mlx_lm" in said[1][1]


@pytest.mark.skipif(
    importlib.util.find_spec("llama_index.llms.mlx") is None,
    reason="llama-index-llms-mlx is not installed",
)
def test_llama_index_chat_goes_through_the_cache(llama_path, kv_home):
    """llama-index-llms-mlx 0.6.0's `MLXLLM.chat` / `complete` generate with `mlx_lm.generate`
    (bound at its import), then encode the answer with `return_tensors="pt"`, which needs torch:
    without it the call raises after generating, with or without kvstore. What mlx-lm generated
    inside it is compared (a recorder around the function it bound)."""
    import mlx_lm
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.mlx import MLXLLM, base

    model, tokenizer = mlx_lm.load(str(llama_path))
    llm = MLXLLM(model=model, tokenizer=tokenizer, max_new_tokens=MAX)
    said: list[str] = []
    real = base.generate

    def recorded(*args, **kwargs):
        said.append(real(*args, **kwargs))
        return said[-1]

    def step(messages):
        with mock.patch.object(base, "generate", recorded):
            try:
                llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in messages])
            except ImportError as e:  # no torch: after mlx-lm generated
                assert "PyTorch" in str(e)
        return said[-1]

    plain1 = step(turns())
    plain2 = step(turns(plain1))
    with attach(model, tokenizer, llama_path, verbose=False) as att:
        step1 = step(turns())
        step2 = step(turns(step1))
        calls = att.calls
    assert (step1, step2) == (plain1, plain2)
    assert calls[0].cached_tokens == 0 and calls[1].cached_tokens >= calls[0].prompt_tokens
