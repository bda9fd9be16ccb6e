"""The effective configuration a model runs with: config.json merged with load-time overrides.

`mlx_lm.load(path, model_config={...})` updates config.json's top level with the overrides before
it builds the ModelArgs (mlx_lm.utils.load_model), so a RoPE base or scaling override changes the
KV of the same tokens. What the fingerprint hashes is the ModelArgs the model is built from (read
from the loaded model when the app has it, so an override the app did not name still counts) and
the config keys mlx-lm reads outside the ModelArgs to build the model (quantization, custom code).
Keys mlx-lm never reads (transformers_version, eos ids) do not move the fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import xxhash

from kvstore.degrade import foreign
from kvstore.errors import ModelError

# Config keys mlx_lm.utils.load_model reads itself, not through the ModelArgs.
LOAD_KEYS = (
    "model_type",
    "architectures",
    "model_file",
    "quantization",
    "quantization_config",
    "quantize_activations",
)


# Files that change how text becomes tokens, but not the KV of given tokens: provenance only
# (the template hash).
TEMPLATE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tiktoken.model",
)


def check_overrides(model_config: Any, *, where: str = "model_config") -> dict | None:
    """A model_config must be a JSON-like table: what mlx_lm.load(model_config=) takes."""
    if model_config is None:
        return None
    if not isinstance(model_config, dict) or not all(isinstance(k, str) for k in model_config):
        raise ModelError(f"{where}: must be a table of config.json keys, got {model_config!r}")
    try:
        json.dumps(model_config, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where}: not JSON-like ({e})") from None
    return dict(model_config)


def overrides_from_json(text: str | None) -> dict | None:
    """A model_config given as JSON text (a command's --model-config), or None; ValueError saying
    what is wrong when it is not a JSON object."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def effective_config(model_dir: Path, model_config: dict | None = None) -> dict:
    """config.json as mlx_lm.load reads it, with `model_config` merged in the same way."""
    from mlx_lm.utils import load_config

    try:
        config = load_config(model_dir)
    except (OSError, ValueError) as e:
        raise ModelError(f"{model_dir / 'config.json'}: cannot read model config: {e}") from None
    if model_config:
        config.update(model_config)  # a shallow update, as mlx_lm.utils.load_model does
    if "quantization_config" not in config:
        text_config = config.get("text_config") or {}
        if isinstance(text_config, dict) and "quantization_config" in text_config:
            config["quantization_config"] = text_config["quantization_config"]
    hf_quant = model_dir / "hf_quant_config.json"
    if "quantization_config" not in config and hf_quant.is_file():
        try:
            config["quantization_config"] = json.loads(hf_quant.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{hf_quant}: cannot read: {e}") from None
    return config


def template_digest(model_dir: Path) -> bytes:
    """Hash of the chat template, tokenizer files and special tokens in `model_dir` (16 bytes):
    an entry's template hash (kvstore.identity.fingerprint.template_hash names it by path)."""
    h = xxhash.xxh3_128()
    for name in TEMPLATE_FILES:
        p = model_dir / name
        if p.is_file():
            h.update(name.encode() + b"\0")
            h.update(p.read_bytes())
    return h.digest()


def load_tokenizer(model_dir: Path, model: str) -> Any:
    """mlx-lm's tokenizer of `model_dir`; a model whose files transformers rejects (a config.json
    field of the wrong type, which transformers 5 validates strictly) is one ModelError naming
    the model, the file and transformers' own message, not a traceback from inside it."""
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    def rejected(e: Exception) -> ModelError:
        why = " ".join(str(e).split()) or type(e).__name__  # transformers' words, on one line
        return ModelError(
            f"model {model!r}: transformers rejects {_rejected_file(model_dir)}: {why}"
        )

    with foreign(rejected):
        return mlx_load_tokenizer(model_dir)


def _rejected_file(model_dir: Path) -> str:
    """Which of a model's files transformers refused: config.json when its config alone fails
    to load, else the tokenizer's files."""
    config = str(model_dir / "config.json")
    try:
        with foreign(lambda e: ModelError(config)):
            from transformers import AutoConfig

            AutoConfig.from_pretrained(str(model_dir))
    except ModelError:
        return config
    return f"the tokenizer files in {model_dir} (tokenizer.json, tokenizer_config.json)"


def config_vocab_size(config: dict) -> int | None:
    """`vocab_size` of a model's (effective) config.json, or of its text_config."""
    for c in (config, config.get("text_config")):
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def _plain(value: Any) -> Any:
    """A JSON-stable form: dataclasses and namespaces as sorted maps, integral floats as ints."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        value = vars(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)  # rope_theta = 1e6 in TOML, 1000000 in config.json: the same run
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def model_args(model: Any, config: dict) -> Any:
    """The arguments the architecture was built with: the model's own, else config's."""
    args = getattr(model, "args", None)
    return args if args is not None else config


def config_identity(args: Any, config: dict) -> bytes:
    """Canonical bytes of what the model runs with: its arguments and the load-time keys."""
    load = {k: config[k] for k in LOAD_KEYS if k in config}
    return json.dumps([_plain(args), _plain(load)], sort_keys=True).encode()
