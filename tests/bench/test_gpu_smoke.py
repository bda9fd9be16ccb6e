"""Keep bench/gpu.py (the restart path at Qwen3.5-9B's shapes, for an accelerator) from rotting: the
whole run at tiny shapes on this CPU, one prefix, every step once; its figures are checked for
consistency with each other, never timed."""

import json
import time

import pytest

# bench/ is not an installed package: pytest's `pythonpath = ["."]` (pyproject) finds it
from bench import gpu


@pytest.mark.slow
def test_gpu_bench_at_tiny_shapes(tmp_path):
    out = tmp_path / "gpu.json"
    res = gpu.run(True, tmp_path / "run", out)  # tiny: a failing step raises

    assert json.loads(out.read_text()) == json.loads(json.dumps(res))  # rewritten after each step
    assert "errors" not in res and res["model"]["weights_bytes"] > 0
    (n,) = res["prefixes"]
    r = res["prefixes"][n]
    pin = r["warm"]["pin_tokens"]
    assert 0 < pin <= int(n) and r["warm"]["pin_bytes"] > 0 and r["warm"]["warm_s"] > 0
    assert r["cold_prefill"]["tokens"] == pin and r["cold_prefill"]["prefill_s"] > 0
    # both loaders restore the pin, all of it
    assert r["hydrate"]["tokens"] == {"kvstore": [pin], "load_prompt_cache": [pin]}
    assert r["load"]["stats"]["kvstore.client.load"]["n"] == 1
    first = r["first_request"]
    serve, plain = first["kvstore serve"], first["mlx_lm.server"]
    assert serve["prompt_tokens"] == plain["prompt_tokens"] > pin
    assert serve["cached_tokens"] == pin and plain["cached_tokens"] == 0
    for s in (serve, plain):
        assert s["spawn_to_first_answer_s"] >= s["spawn_to_ready_s"] > 0
    assert first["ttft_plain_over_kvstore"] == pytest.approx(plain["ttft_s"] / serve["ttft_s"])
    assert first["learned"]["bytes_per_turn"] > 0
    table = gpu.table(res)
    assert f"| {n} ({pin}) |" in table and "failed" not in table


def test_a_step_past_its_limit_is_recorded_and_the_run_goes_on(tmp_path):
    out, res = tmp_path / "gpu.json", {}
    assert gpu._step(res, out, "prefixes/1/warm", 1, lambda: time.sleep(5) or {}, False) is None
    assert gpu._step(res, out, "prefixes/1/next", 5, lambda: {"x": 1}, False) == {"x": 1}
    saved = json.loads(out.read_text())
    assert saved["errors"] == {"prefixes/1/warm": "prefixes/1/warm: timed out after 1 s"}
    assert saved["prefixes"] == {"1": {"next": {"x": 1}}}
    assert "failed: prefixes/1/warm" in gpu.table(saved)
    with pytest.raises(gpu.StepTimeout):
        gpu._step(res, None, "k", 1, lambda: time.sleep(5) or {}, True)
