"""The python blocks of docs/apps.md and the README run as written, in order, as one session (a
reader following the page), on the tiny llama: the only change is the model path they name.
Every keyword the pages show is taken, and every name a block uses is defined on the page."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from kvstore.identity.model import IDENTITY_KEYWORDS

ROOT = next(p for p in Path(__file__).parents if (p / "pyproject.toml").is_file())
DOC_MODEL = "/models/Qwen3.5-9B-8bit"  # the path the page's blocks name


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def test_every_python_block_of_apps_md_runs(llama_path, kv_home, capsys):
    blocks = python_blocks(ROOT / "docs" / "apps.md")
    assert len(blocks) == 5
    ns: dict = {}
    for i, code in enumerate(blocks, 1):
        code = code.replace(DOC_MODEL, str(llama_path))
        exec(compile(code, f"docs/apps.md, python block {i}", "exec"), ns)
        if "STAGES" in code:  # the multi-stage app: every stage served its pin
            cache = ns["cache"]
            assert set(cache.pins) == {"classify", "reason", "examine", "synthesize"}
            assert all(p.warning is None for p in cache.pins.values())
            summary = cache.stats.summary()
            assert list(summary) == ["classify", "reason", "examine", "synthesize"]
            for name, s in summary.items():  # only each stage's rest was prefilled
                assert s.cached_tokens >= len(cache.pins[name].tokens), name
            assert "kvstore: synthesize:" in capsys.readouterr().err
            assert not cache._writer.thread.is_alive()  # closed by the block
    assert ns["report"].warning  # the hydrate block's: no store in this home, said in one line
    assert ns["stats"].calls and not ns["stats"]._writer.thread.is_alive()
    out, err = capsys.readouterr()
    assert f"{ns['stats'].calls[0].prefilled_tokens} tokens prefilled" in out
    assert "kvstore: default:" not in err  # verbose=False


def test_the_signatures_apps_md_gives_are_the_functions_keywords():
    """`load(...)`, `hydrate(...)` and `generate`'s keywords as the page writes them are what the
    functions take (their keyword rows included)."""
    from kvstore.client import hydrate, load
    from kvstore.client.persistent import CacheKeywords

    text = (ROOT / "docs" / "apps.md").read_text()
    takes = {
        "load": set(inspect.signature(load).parameters) | set(CacheKeywords.__annotations__),
        "hydrate": set(inspect.signature(hydrate).parameters) | set(IDENTITY_KEYWORDS),
    }
    for name, accepted in takes.items():
        (sig,) = re.findall(rf"`{name}\((.*?)\)`", text, re.S)
        shown = set(re.findall(r"(\w+)=", sig))
        assert shown and shown <= accepted, (name, shown - accepted)


def test_every_python_block_of_the_readme_runs(llama_path, kv_home, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the tiny-model block writes its models here
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) == 2
    ns: dict = {}
    for i, code in enumerate(blocks, 1):
        code = code.replace(DOC_MODEL, str(llama_path))
        exec(compile(code, f"README.md, python block {i}", "exec"), ns)
    assert ns["cache"].stats.calls[0].label == "classify"
    assert "kvstore: classify:" in capsys.readouterr().err
    for name in ("tiny-llama", "tiny-hybrid", "tiny-gemma"):
        assert (tmp_path / name / "config.json").is_file()
