"""Values parsed as the engine parses them: gflags on the command line (ASCII digits, no size
suffix, its bool spellings), nlohmann's get<T> for the engine's JSON file, TOML consistent with
it; each with the nearest value that must pass."""

from __future__ import annotations

import pytest

from xllm_vmm.config.findings import ConfigError
from xllm_vmm.config.loader import load
from xllm_vmm.config.sources import read_json, read_toml


def one_error(argv):
    with pytest.raises(ConfigError) as e:
        load(argv)
    (f,) = e.value.findings
    assert f.id == "CFG-TYPE"
    return f.message


@pytest.mark.parametrize("bad, good, value", [
    ("--block_size=١٢٨", "--block_size=128", 128),            # Arabic-Indic digits
    ("--port=８０８０", "--port=8080", 8080),                   # full-width digits
    ("--port=1_000", "--port=1000", 1000),                    # Python's underscores
    ("--block_size=64 ", "--block_size= 64", 64),             # strtol: leading blanks only
    ("--block_size=0o100", "--block_size=0x40", 64),          # gflags: 0x hex, no 0o
    ("--max_memory_utilization=٠.5", "--max_memory_utilization=5e-1", 0.5),
    ("--max_memory_utilization=0.5x", "--max_memory_utilization=.5", 0.5),
])
def test_numbers_are_ascii_as_gflags_reads_them(bad, good, value):
    assert "is not valid for" in one_error([bad])
    name = good.split("=")[0].lstrip("-")
    assert load([good])[name] == value


def test_byte_flags_take_no_size_suffix_on_the_command_line(tmp_path):
    msg = one_error(["--max_cache_size=1.5GiB"])
    assert "no size suffix); write 1610612736" in msg
    assert load(["--max_cache_size=1610612736"])["max_cache_size"] == 1610612736
    # TOML and XLLM_VMM_* keep sizes as this tool's own convenience
    p = tmp_path / "c.toml"
    p.write_text('max_cache_size = "1.5GiB"\n')
    assert load(config_files=[p])["max_cache_size"] == 1610612736
    assert load(env={"XLLM_VMM_MAX_CACHE_SIZE": "1.5GiB"})["max_cache_size"] == 1610612736


@pytest.mark.parametrize("text, value", [
    ("true", True), ("TRUE", True), ("t", True), ("y", True), ("Yes", True), ("1", True),
    ("false", False), ("F", False), ("n", False), ("no", False), ("0", False),
])
def test_bool_spellings_of_gflags(text, value):
    assert load([f"--enable_vmm_kvcache={text}"])["enable_vmm_kvcache"] is value


@pytest.mark.parametrize("text", ["on", "off", "enabled", " true", "true ", "2", "ｔｒｕｅ"])
def test_other_bool_spellings_are_refused(text):
    assert "enable_vmm_kvcache" in one_error([f"--enable_vmm_kvcache={text}"])


@pytest.mark.parametrize("doc, message", [
    ('{"enable_vmm_kvcache": "yes"}', "reads a bool only as true or false, not a string"),
    ('{"enable_vmm_kvcache": "true"}', "write true without quotes"),
    ('{"block_size": "64"}', "reads a number, not a string"),
    ('{"max_cache_size": "16GiB"}', "reads a number, not a string (write it without quotes, "
                                    "in bytes)"),
    ('{"block_size": 1.5}', "would truncate it to 1"),
    ('{"block_size": true}', "is not valid for block_size"),
])
def test_engine_json_values_as_its_loader_reads_them(doc, message):
    got, findings = read_json("c.json", doc)
    assert got == [] and [f.id for f in findings] == ["CFG-TYPE"]
    assert message in findings[0].message


@pytest.mark.parametrize("doc, name, value", [
    ('{"enable_vmm_kvcache": true}', "enable_vmm_kvcache", True),
    ('{"block_size": 64}', "block_size", 64), ('{"block_size": 64.0}', "block_size", 64),
    ('{"max_memory_utilization": 1}', "max_memory_utilization", 1.0),
    ('\ufeff{"block_size": 64}', "block_size", 64),  # nlohmann skips a UTF-8 BOM
])
def test_engine_json_values_that_pass(doc, name, value):
    got, findings = read_json("c.json", doc)
    assert findings == [] and [(a.name, a.value) for a in got] == [(name, value)]


def test_toml_and_json_agree_on_a_string_bool():
    _, t = read_toml("c.toml", 'enable_vmm_kvcache = "yes"\n')
    _, j = read_json("c.json", '{"enable_vmm_kvcache": "yes"}')
    assert [f.id for f in t] == [f.id for f in j] == ["CFG-TYPE"]


def test_toml_with_a_utf8_byte_order_mark_is_read(tmp_path):
    p = tmp_path / "bom.toml"
    p.write_bytes(b"\xef\xbb\xbfblock_size = 64\n")
    assert load(config_files=[p])["block_size"] == 64
    q = tmp_path / "bom.json"
    q.write_bytes(b'\xef\xbb\xbf{"block_size": 32}')
    assert load(json_file=q)["block_size"] == 32


def test_engine_json_group_objects_are_refused_flat_keys_read():
    got, findings = read_json("c.json", '{"kv_cache": {"block_size": 64}}')
    assert got == [] and [f.id for f in findings] == ["CFG-UNKNOWN"]
    assert "reads every flag as a top-level key" in findings[0].message
    got, findings = read_json("c.json", '{"block_size": 64}')
    assert findings == [] and got[0].value == 64
