"""Manifest loading: every accepted form, and every error names the file and what is at fault."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import cli

from kvstore.errors import ManifestError
from kvstore.pins.manifest import DEFAULT_KV_GROUP_SIZE, load_manifest, manifest_files

MINIMAL = """
[[model]]
path = "/models/Qwen3.5-9B-8bit"

[[model.prefix]]
name = "classify"
messages = [{ role = "system", content = "You are the router..." }]
"""


def write(tmp_path: Path, body: str, name: str = "kvstore.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def model_with(prefix_body: str, model_extra: str = "") -> str:
    return f'[[model]]\npath = "/models/m"\n{model_extra}\n[[model.prefix]]\n{prefix_body}\n'


def test_minimal_form(tmp_path: Path) -> None:
    manifest = load_manifest(write(tmp_path, MINIMAL))
    assert manifest.path == tmp_path / "kvstore.toml"
    (model,) = manifest.models
    assert model.path == "/models/Qwen3.5-9B-8bit"
    assert model.identity.adapter is None and model.identity.kv_bits is None
    assert model.identity.kv_group_size == DEFAULT_KV_GROUP_SIZE
    (prefix,) = model.prefixes
    assert prefix.name == "classify"
    assert prefix.messages == ({"role": "system", "content": "You are the router..."},)
    assert prefix.text is None and prefix.file is None and prefix.tools is None
    assert prefix.tools_data is None
    assert manifest_files(manifest) == [manifest.path]


def test_text_prefix_and_model_options(tmp_path: Path) -> None:
    body = model_with(
        'name = "raw"\ntext = "Answer in JSON."',
        'adapter = "/adapters/router"\nkv_bits = 8\nkv_group_size = 32',
    )
    (model,) = load_manifest(write(tmp_path, body)).models
    identity = model.identity
    assert (identity.adapter, identity.kv_bits, identity.kv_group_size) == (
        "/adapters/router",
        8,
        32,
    )
    assert identity.quantized_kv_start == 5000  # mlx_lm.generate's default
    (prefix,) = model.prefixes
    assert prefix.text == "Answer in JSON." and prefix.messages is None


def test_relative_model_path_resolves_only_when_it_exists(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    body = '[[model]]\npath = "models/tiny"\n\n[[model]]\npath = "org/hub-model"\n'
    local, hub = load_manifest(write(tmp_path, body)).models
    assert local.path == str(tmp_path / "models" / "tiny")
    assert hub.path == "org/hub-model" and hub.prefixes == ()


def test_a_model_path_through_a_symlink_is_named_by_its_folder(tmp_path: Path) -> None:
    # issue 43 item 7: the name an app's pins get for the same folder (model_name)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "current").symlink_to(tmp_path / "models" / "tiny")
    body = f'[[model]]\npath = "{tmp_path / "current"}"\n\n[[model]]\npath = "current"\n'
    (model,) = load_manifest(write(tmp_path, body)).models  # one model: the two tables merge
    assert model.path == str((tmp_path / "models" / "tiny").resolve())


def test_file_alone_becomes_the_system_message(tmp_path: Path) -> None:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "x.md").write_text("System from file.")
    manifest = load_manifest(write(tmp_path, model_with('name = "p"\nfile = "prompts/x.md"')))
    prefix = manifest.models[0].prefixes[0]
    assert prefix.file == tmp_path / "prompts" / "x.md"
    assert prefix.messages == ({"role": "system", "content": "System from file."},)
    assert manifest_files(manifest) == [manifest.path, prefix.file]


def test_file_replaces_first_system_content(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text("From file.")
    msgs = (
        'messages = [{ role = "system", content = "placeholder" },'
        ' { role = "user", content = "example" }, { role = "assistant", content = "ok" }]'
    )
    body = model_with(f'name = "p"\nfile = "x.md"\n{msgs}')
    prefix = load_manifest(write(tmp_path, body)).models[0].prefixes[0]
    assert [m["content"] for m in prefix.messages] == ["From file.", "example", "ok"]


def test_tools_are_loaded(tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    body = model_with(
        'name = "reason"\ntools = "tools.json"\nmessages = [{ role = "system", content = "s" }]'
    )
    manifest = load_manifest(write(tmp_path, body))
    prefix = manifest.models[0].prefixes[0]
    assert prefix.tools == tmp_path / "tools.json"
    assert prefix.tools_data == tuple(tools)
    assert prefix.tools in manifest_files(manifest)


SYS = 'messages = [{ role = "system", content = "s" }]'

# (manifest body, files to create, strings the error message must contain)
ERRORS = {
    "toml_syntax": ("[[model]\npath = 1\n", {}, ["line 1", "TOML"]),
    "no_model": ("# only a comment\n", {}, ["[[model]]", "model"]),
    "empty_file": ("", {}, ["[[model]]"]),
    "model_without_path": ('[[model]]\nadapter = "/a"\n', {}, ["model #0", "path"]),
    "model_path_not_string": ("[[model]]\npath = 3\n", {}, ["model #0", "path"]),
    "unknown_model_key": (
        '[[model]]\npath = "/m"\nkv_bit = 8\n',
        {},
        ["model #0", "'/m'", "kv_bit"],
    ),
    "unknown_top_key": ('modle = 1\n[[model]]\npath = "/m"\n', {}, ["modle"]),
    "kv_bits_range": ('[[model]]\npath = "/m"\nkv_bits = 7\n', {}, ["kv_bits", "7"]),
    "quantized_kv_start": (
        '[[model]]\npath = "/m"\nquantized_kv_start = -1\n',
        {},
        ["quantized_kv_start", "-1"],
    ),
    "kv_bits_type": ('[[model]]\npath = "/m"\nkv_bits = "8"\n', {}, ["kv_bits"]),
    "kv_bits_bool": ('[[model]]\npath = "/m"\nkv_bits = true\n', {}, ["kv_bits"]),
    "group_size": ('[[model]]\npath = "/m"\nkv_group_size = 48\n', {}, ["kv_group_size"]),
    "unknown_prefix_key": (model_with(f'name = "p"\n{SYS}\nsytem = "x"'), {}, ["'p'", "sytem"]),
    "empty_name": (model_with(f'name = ""\n{SYS}'), {}, ["name"]),
    "missing_name": (model_with(SYS), {}, ["prefix #0", "name"]),
    "duplicate_name": (
        model_with(f'name = "p"\n{SYS}\n[[model.prefix]]\nname = "p"\n{SYS}'),
        {},
        ["'p'", "duplicate"],
    ),
    "neither": (model_with('name = "p"'), {}, ["'p'", "messages"]),
    "both": (model_with(f'name = "p"\n{SYS}\ntext = "t"'), {}, ["'p'", "text"]),
    "file_and_text": (
        model_with('name = "p"\nfile = "x.md"\ntext = "t"'),
        {"x.md": "x"},
        ["'p'", "text"],
    ),
    "messages_not_list": (model_with('name = "p"\nmessages = "hi"'), {}, ["'p'", "messages"]),
    "message_not_table": (model_with('name = "p"\nmessages = ["hi"]'), {}, ["'p'", "messages"]),
    "content_not_string": (
        model_with('name = "p"\nmessages = [{ role = "system", content = 3 }]'),
        {},
        ["'p'", "content"],
    ),
    "message_extra_key": (
        model_with('name = "p"\nmessages = [{ role = "system", contents = "x" }]'),
        {},
        ["'p'", "contents"],
    ),
    "unknown_role": (
        model_with('name = "p"\nmessages = [{ role = "sytem", content = "x" }]'),
        {},
        ["'p'", "sytem", "messages"],
    ),
    "missing_file": (model_with('name = "p"\nfile = "nope.md"'), {}, ["'p'", "file", "nope.md"]),
    "missing_tools": (
        model_with(f'name = "p"\n{SYS}\ntools = "nope.json"'),
        {},
        ["'p'", "tools", "nope.json"],
    ),
    "tools_not_list": (
        model_with(f'name = "p"\n{SYS}\ntools = "t.json"'),
        {"t.json": '{"name": "search"}'},
        ["'p'", "tools", "list"],
    ),
    "tools_bad_json": (
        model_with(f'name = "p"\n{SYS}\ntools = "t.json"'),
        {"t.json": "[{"},
        ["'p'", "tools", "JSON"],
    ),
    "tools_with_text": (
        model_with('name = "p"\ntext = "t"\ntools = "t.json"'),
        {"t.json": "[]"},
        ["'p'", "tools"],
    ),
    "file_without_system_message": (
        model_with('name = "p"\nfile = "x.md"\nmessages = [{ role = "user", content = "u" }]'),
        {"x.md": "x"},
        ["'p'", "file", "system"],
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_name_file_and_field(tmp_path: Path, case: str) -> None:
    body, files, needles = ERRORS[case]
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    path = write(tmp_path, body, name=f"{case}.toml")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    message = str(info.value)
    assert f"{case}.toml" in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_missing_manifest_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="absent.toml"):
        load_manifest(tmp_path / "absent.toml")


# A wrong type for each key: (manifest body, the key, TOML's word for what was given)
WRONG_TYPES = {
    "model_not_tables": ('model = "m"\n', "model", "a string"),
    "path_int": ("[[model]]\npath = 5\n", "path", "an integer"),
    "path_array": ('[[model]]\npath = ["/m"]\n', "path", "an array"),
    "adapter_int": ('[[model]]\npath = "/m"\nadapter = 3\n', "adapter", "an integer"),
    "adapter_bool": ('[[model]]\npath = "/m"\nadapter = true\n', "adapter", "a boolean"),
    "kv_bits_string": ('[[model]]\npath = "/m"\nkv_bits = "8"\n', "kv_bits", "a string"),
    "kv_bits_float": ('[[model]]\npath = "/m"\nkv_bits = 8.0\n', "kv_bits", "a float"),
    "kv_group_size_string": (
        '[[model]]\npath = "/m"\nkv_group_size = "64"\n',
        "kv_group_size",
        "a string",
    ),
    "quantized_kv_start_float": (
        '[[model]]\npath = "/m"\nquantized_kv_start = 1.5\n',
        "quantized_kv_start",
        "a float",
    ),
    "quantized_kv_start_string": (
        '[[model]]\npath = "/m"\nquantized_kv_start = "0"\n',
        "quantized_kv_start",
        "a string",
    ),
    "model_config_string": (
        '[[model]]\npath = "/m"\nmodel_config = "rope_theta=1e6"\n',
        "model_config",
        "a string",
    ),
    "model_config_array": (
        '[[model]]\npath = "/m"\nmodel_config = [1]\n',
        "model_config",
        "an array",
    ),
    "model_template_kwargs_string": (
        model_with(f'name = "p"\n{SYS}', 'chat_template_kwargs = "thinking"'),
        "chat_template_kwargs",
        "a string",
    ),
    "prefix_template_kwargs_bool": (
        model_with(f'name = "p"\n{SYS}\nchat_template_kwargs = true'),
        "chat_template_kwargs",
        "a boolean",
    ),
    "prefix_not_tables": ('[[model]]\npath = "/m"\nprefix = "p"\n', "prefix", "a string"),
    "name_int": (model_with(f"name = 1\n{SYS}"), "name", "an integer"),
    "text_int": (model_with('name = "p"\ntext = 1'), "text", "an integer"),
    "tools_int": (model_with(f'name = "p"\n{SYS}\ntools = 5'), "tools", "an integer"),
    "tools_array": (model_with(f'name = "p"\n{SYS}\ntools = ["t.json"]'), "tools", "an array"),
    "file_int": (model_with('name = "p"\nfile = 7'), "file", "an integer"),
    "messages_string": (model_with('name = "p"\nmessages = "hi"'), "messages", "a string"),
    "messages_table": (
        model_with('name = "p"\nmessages = { role = "system", content = "s" }'),
        "messages",
        "a table",
    ),
    "message_int": (model_with('name = "p"\nmessages = [1]'), "messages", "an integer"),
    "role_int": (
        model_with('name = "p"\nmessages = [{ role = 1, content = "s" }]'),
        "messages",
        "an integer",
    ),
    "content_date": (
        model_with('name = "p"\nmessages = [{ role = "system", content = 1979-05-27 }]'),
        "messages",
        "a date",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_a_wrong_type_is_one_line_naming_the_file_key_and_type(tmp_path: Path, case: str) -> None:
    body, key, kind = WRONG_TYPES[case]
    path = write(tmp_path, body, name=f"{case}.toml")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert f"field '{key}'" in message and f"({kind})" in message, message


def test_kv_bits_as_a_string_names_the_type_and_the_allowed_values(tmp_path: Path) -> None:

    path = write(tmp_path, '[[model]]\npath = "/m"\nkv_bits = "8"\n')
    result = cli("warm", "--manifest", path)
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert str(path) in line and "kv_bits" in line
    assert "must be an integer, one of 2, 3, 4, 5, 6, 8; got '8' (a string)" in line


@pytest.mark.parametrize("key", ["file", "tools"])
def test_a_directory_where_a_file_belongs_is_named_a_directory(tmp_path: Path, key: str) -> None:
    (tmp_path / "prompts").mkdir()
    body = model_with(f'name = "p"\n{SYS}\n{key} = "prompts"')
    with pytest.raises(ManifestError) as info:
        load_manifest(write(tmp_path, body))
    message = str(info.value)
    assert f"field '{key}'" in message and f"{tmp_path / 'prompts'} is a directory" in message
    assert "not found" not in message


@pytest.mark.parametrize("key", ["file", "tools"])
@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_device_or_fifo_where_a_file_belongs_is_not_a_regular_file(
    tmp_path: Path, key: str, special: str
) -> None:
    # issue 43 item 8: these said "file not found ... create it"
    if special == "fifo":
        os.mkfifo(tmp_path / "fifo")  # opening it to read would block for ever
    target = special if special.startswith("/") else str(tmp_path / special)
    body = model_with(f'name = "p"\n{SYS}\n{key} = "{target}"')
    result = cli("warm", "--manifest", write(tmp_path, body))
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert f"field '{key}'" in line and f"{target} is not a regular file" in line
    assert "not found" not in line


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_manifest_that_is_a_device_or_fifo_is_not_a_regular_file(
    tmp_path: Path, special: str
) -> None:
    if special == "fifo":
        os.mkfifo(tmp_path / "fifo")
    target = special if special.startswith("/") else str(tmp_path / special)
    result = cli("warm", "--manifest", target)
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert target in line and "not a regular file" in line
