"""A chat learned through the client's cold tier, shared by the learned-prefix tests: the
tokens, one request as mlx-lm serves it, and two turns where the second extends the first's
whole prompt (its end snapshot is sent after the response)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvstore import metrics
from kvstore.client.learn import Learner
from kvstore.client.persistent import PinnedPromptCache
from kvstore.learned.coldtier import LearnTarget

FP = bytes(range(16))
KEY = "tiny"


def chat_tokens(n: int, seed: int = 3) -> list[int]:
    return [(7 * i + seed) % 200 + 1 for i in range(n)]


def prompt_tokens_from(name: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvstore_prompt_tokens_total", {"source": name}) or 0


def learner_of(lru, home: Path, model, model_path: Path) -> Learner:
    learner = Learner(home)
    learner.add_target(KEY, LearnTarget(fingerprint=FP, model=str(model_path), model_obj=model,
                                        extra={}))  # fmt: skip
    lru.learner = learner
    return learner


def chat_turn(model, lru, prompt: list[int]) -> tuple[int, list[int]]:
    """One request as mlx-lm serves it: fetch, prefill the rest, 2 tokens, insert."""
    cache, rest = lru.fetch_nearest_cache(KEY, prompt)
    cache = cache if cache is not None else make_prompt_cache(model)
    served = len(prompt) - len(rest)
    logits = model(mx.array(rest)[None], cache=cache)
    out = []
    for _ in range(2):
        out.append(int(mx.argmax(logits[0, -1]).item()) % 200 + 1)
        logits = model(mx.array([[out[-1]]]), cache=cache)
    lru.insert_cache(KEY, prompt + out, cache)
    return served, out


def two_turns(model, lru, learner: Learner, seed: int = 4) -> tuple[list[int], list[int]]:
    """Turn 1, then turn 2 extending its whole prompt: its prefill stops one token short and the
    end snapshot is sent after the response. Returns turn 2's prompt and output."""
    _, out1 = chat_turn(model, lru, chat_tokens(300, seed=seed))
    t2 = chat_tokens(300, seed=seed) + out1 + chat_tokens(40, seed=seed + 2)
    cache, rest = lru.fetch_nearest_cache(KEY, t2)
    assert rest == t2[-1:]  # split one short of the end: the rest is the last token
    logits = model(mx.array(rest)[None], cache=cache)
    out2 = [int(mx.argmax(logits[0, -1]).item()) % 200 + 1]
    model(mx.array([out2]), cache=cache)
    lru.insert_cache(KEY, t2 + out2, cache)
    assert learner.drain(20.0)[1] == 0
    assert learner.snapshots_sent == 1
    return t2, out2


def learn_two_turns(model, home: Path, model_path: Path, *, learner_model=None, seed: int = 4):
    """Two turns of a chat in a new cache whose learner (on `learner_model`, default `model`)
    is closed after them; turn 2's prompt and output."""
    lru = PinnedPromptCache(max_size=4)
    learner = learner_of(lru, home, learner_model or model, model_path)
    try:
        return two_turns(model, lru, learner, seed=seed)
    finally:
        learner.close(timeout=5.0)
