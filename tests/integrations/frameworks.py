"""The frameworks as their users call them, on a model path: one agent step each (the system
prompt, the task, and every earlier step's exchange), for the tests in this folder and for a new
process (`python -m tests.integrations.frameworks NAME MODEL HOME` reads the turns as JSON on
stdin, attaches, runs one step and prints the text and the call's stats as JSON).

LangChain: langchain-community 0.4.2's `MLXPipeline._call` passes `formatter=` to
`mlx_lm.generate`, which mlx-lm 0.31 and 0.32 refuse (TypeError; langchain-community issue 373,
its fix is pull request 374). `langchain_fix()` applies that fix (drops the argument) where a test
needs LangChain to generate at all; with or without kvstore, unfixed, it fails the same way.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tests.helpers import CLASSIFY

MAX = 12
SYSTEM = CLASSIFY * 3  # long enough to be learned (at least 64 tokens; blocks of 256)
TASK = "Which team handles invoice 2291, charged twice on 3 May?"


def turns(*said: str) -> list[dict[str, str]]:
    """An agent's messages at a step: the system prompt, the task, each earlier exchange."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for i, text in enumerate(said):
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Observation {i}: the tool answered 'billing'."},
        ]
    return messages


@dataclass
class Driver:
    """A framework's model object on a model path: `model` and `tokenizer` (what attach takes),
    `step(messages, **generation_kwargs) -> text` (the keywords reach mlx-lm where the framework
    passes them on: smolagents and Outlines)."""

    model: Any
    tokenizer: Any
    step: Callable[..., str]


def penalty() -> list:
    """mlx-lm's repetition penalty over the whole history (a processor the prefix matters to)."""
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(repetition_penalty=1.6, repetition_context_size=100_000)


def smolagents(path: str) -> Driver:
    from smolagents import MLXModel

    engine = MLXModel(path, max_tokens=MAX, logits_processors=penalty())

    def step(messages: list[dict[str, str]], **kw: Any) -> str:
        return engine.generate(
            [
                {"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                for m in messages
            ],
            **kw,
        ).content

    return Driver(engine.model, engine.tokenizer, step)


def langchain(path: str) -> Driver:
    from langchain_community.chat_models.mlx import ChatMLX
    from langchain_community.llms.mlx_pipeline import MLXPipeline
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    pipe = MLXPipeline.from_model_id(
        path,
        pipeline_kwargs={"max_tokens": MAX, "repetition_penalty": 1.6,
                         "repetition_context_size": 100_000},
    )  # fmt: skip
    chat = ChatMLX(llm=pipe)

    def step(messages: list[dict[str, str]], **kw: Any) -> str:
        return chat.invoke([kinds[m["role"]](content=m["content"]) for m in messages]).content

    return Driver(pipe.model, pipe.tokenizer, step)


def outlines(path: str) -> Driver:
    import mlx_lm
    import outlines as ol
    from outlines.inputs import Chat

    model, tokenizer = mlx_lm.load(path)
    om = ol.from_mlxlm(model, tokenizer)

    def step(messages: list[dict[str, str]], **kw: Any) -> str:
        return om(Chat(messages), max_tokens=MAX, **kw)

    return Driver(model, tokenizer, step)


DRIVERS = {"smolagents": smolagents, "langchain": langchain, "outlines": outlines}
PACKAGES = {"smolagents": "smolagents", "langchain": "langchain_community", "outlines": "outlines"}


def installed(name: str) -> bool:
    return importlib.util.find_spec(PACKAGES[name]) is not None


@contextlib.contextmanager
def langchain_fix() -> Iterator[None]:
    """langchain-community pull request 374 in effect: `formatter=` no longer reaches mlx-lm."""
    import mlx_lm

    plain = mlx_lm.generate

    def generate(*args: Any, formatter: Any = None, **kwargs: Any) -> Any:
        return plain(*args, **kwargs)

    mlx_lm.generate = generate
    try:
        yield
    finally:
        mlx_lm.generate = plain


def main() -> None:
    import warnings

    warnings.simplefilter("ignore")  # the frameworks' deprecation notices
    from kvstore.client import attach

    name, path, home = sys.argv[1:4]
    messages = json.loads(sys.stdin.read())
    driver = DRIVERS[name](path)
    fix = langchain_fix() if name == "langchain" else contextlib.nullcontext()
    with fix, attach(driver.model, driver.tokenizer, path, home=home, verbose=False) as att:
        text = driver.step(messages)
        calls = [(c.prompt_tokens, c.cached_tokens) for c in att.calls]
    print(json.dumps({"text": text, "calls": calls}))


if __name__ == "__main__":
    main()
