"""Every state layout the installed mlx-lm builds as a tiny random model (kvstore.tiny), and
gemma3's sliding windows: a chat learned through a real daemon is restored exactly after a
restart. Turn 3 of a restarted app is served turn 2's whole prompt from the store (KV records +
a state-only snapshot where the layout has KV layers, the whole state otherwise), and its cache
and logits equal a cold prefill of the same split."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import tiny_model
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from kvstore.client.persistent import PinnedPromptCache
from kvstore.codec import codec
from kvstore.learned.records import kv_layers
from kvstore.store.entry import entry_key
from kvstore.store.store import Store
from tests.client.learn_chat import (
    FP,
    KEY,
    chat_tokens,
    learn_two_turns,
    learner_of,
    prompt_tokens_from,
)

LAYOUTS = ["qwen3_5", "qwen3_next", "falcon_h1", "nemotron_h", "granitemoehybrid", "lfm2",
           "kimi_linear", "mamba", "mamba2", "recurrent_gemma", "gemma3_text"]  # fmt: skip


@pytest.mark.parametrize("arch", LAYOUTS)
def test_a_state_layout_chat_is_restored_exactly_after_a_restart(arch, models_dir, kv_home,
                                                                  tmp_path):  # fmt: skip
    from helpers import Proc, serving

    path = tiny_model(models_dir, arch)
    model = load_model(path)[0]
    with serving(Proc(kv_home, log=tmp_path / "daemon.log"), warm=False):
        t2, out2 = learn_two_turns(model, kv_home, path)
        with Store(kv_home, readonly=True) as ro:
            meta = ro.get_meta(entry_key(FP, t2))
        layers = kv_layers(make_prompt_cache(model))
        assert (meta.extra.kv_layers or []) == layers  # the KV layers went as records
        fresh = PinnedPromptCache(max_size=4)
        learner = learner_of(fresh, kv_home, model, path)
        try:
            t3 = t2 + out2 + chat_tokens(30, seed=8)
            before = prompt_tokens_from("store")
            cache, rest = fresh.fetch_nearest_cache(KEY, t3)
            assert prompt_tokens_from("store") - before == len(t2)
            assert rest == t3[-1:]
            # the same split as the served path: turn 1's prompt, its 2 generated tokens one by
            # one, turn 2 up to its last token, that token (a chunked SSM scan's sums depend on
            # where a prefill is cut), then turn 3 up to its last token
            cold = make_prompt_cache(model)
            for a, b in ((0, 300), (300, 301), (301, 302), (302, len(t2) - 1), (len(t2) - 1,
                         len(t2)), (len(t2), len(t3) - 1)):  # fmt: skip
                model(mx.array(t3[a:b])[None], cache=cold)
            assert codec.encode(cache) == codec.encode(cold)  # every layer, bit for bit
            logits = model(mx.array(rest)[None], cache=cache)
            assert mx.array_equal(logits, model(mx.array(rest)[None], cache=cold)).item()
        finally:
            learner.close(timeout=5.0)


def test_an_architecture_the_installed_mlx_lm_lacks_is_named_in_one_line(llama_path, kv_home,
                                                                          tmp_path):  # fmt: skip
    """`warm` and `kvstore serve` of a model whose architecture this mlx-lm cannot build: one line
    that names it, no traceback."""
    import json
    import shutil
    import subprocess
    import sys

    from helpers import cli, manifest_for

    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    manifest = manifest_for(tmp_path, model, '[[model.prefix]]\nname = "x"\ntext = "hello"\n')
    out = cli("warm", "--home", kv_home, "--manifest", manifest, code=1).output
    said = [line for line in out.splitlines() if "no_such_arch" in line]
    assert len(said) == 1 and "not supported" in said[0] and "Traceback" not in out
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--home", str(kv_home), "--model", str(model),
         "--port", "0"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode != 0 and len(said) == 1, proc.stderr
    assert "no_such_arch" in said[0] and "not supported" in said[0]
    assert "Traceback" not in proc.stderr
