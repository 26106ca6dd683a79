"""FlashConfig: defaults, validation errors naming key/value/allowed, files, overrides, tunables."""
import json
import logging

import pytest
from deepseek_flash.daemon.config import (
    KEYS,
    READ_SHAPE_RANGE,
    RESTART_ONLY,
    TUNABLE,
    FlashConfig,
    check_tunable,
    parse_size,
    read_shape,
)

from deepseek_flash.errors import ConfigError


def test_defaults_cover_every_design_key():
    cfg = FlashConfig()
    assert cfg.prefetch_window == "auto"
    assert cfg.block_eviction_policy == "lru"
    assert cfg.eviction_threshold == 0.9
    assert cfg.unified_memory_ratio == 0.8
    assert cfg.quantization_granularity == "per_block"
    assert cfg.quantization_scheme == "none"
    assert cfg.error_recovery_mode == "strict"
    assert cfg.socket_mode == 0o660 and cfg.socket_group is None
    assert cfg.max_frame_bytes == 1 << 20
    assert set(cfg.as_dict()) == set(KEYS)


@pytest.mark.parametrize("key, value, allowed", [
    ("prefetch_window", 65, '"auto" | 0..64'),
    ("prefetch_window", -1, '"auto" | 0..64'),
    ("prefetch_window", "2", '"auto" | 0..64'),
    ("prefetch_window", "Auto", '"auto" | 0..64'),
    ("prefetch_window", True, '"auto" | 0..64'),
    ("block_eviction_policy", "fifo", ["lru", "access_frequency_weighted"]),
    ("eviction_threshold", 1.5, "0 <= x <= 1"),
    ("unified_memory_ratio", 0, "0 < r <= 1"),
    ("quantization_granularity", "per_row", ["per_tensor", "per_block"]),
    ("quantization_scheme", "fp8", ["none", "int8_symmetric", "int4_symmetric"]),
    ("error_recovery_mode", "lenient", ["strict", "graceful"]),
    ("socket_mode", "rw", "0000..0777 (octal string or integer)"),
    ("max_frame_bytes", 100, "4KiB..256MiB"),
    ("devices", ["gpu0"], "null | [int | \"cuda:N\", ...]"),
    ("read_shape", "8", READ_SHAPE_RANGE),
    ("read_shape", "0x4MiB", READ_SHAPE_RANGE),
    ("read_shape", "1025x1MiB", READ_SHAPE_RANGE),
    ("read_shape", "8x6000", READ_SHAPE_RANGE),
    ("read_shape", "8x128MiB", READ_SHAPE_RANGE),
    ("read_shape", "8xbig", READ_SHAPE_RANGE),
    ("read_shape", 8, READ_SHAPE_RANGE),
])
def test_invalid_values_name_key_value_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        FlashConfig.from_dict({key: value})
    err = info.value
    assert err.code == 500
    assert err.key == key and err.value == value and err.allowed == allowed
    assert key in str(err) and repr(value) in str(err)


def test_read_shape_forms():
    assert FlashConfig().read_shape == "8x4MiB" and read_shape("k", "32x1MiB") == (32, 1 << 20)
    assert FlashConfig.from_dict({"read_shape": "8x4MiB"}).read_shape == "8x4MiB"
    assert read_shape("k", "8x4MiB") == (8, 4 << 20) and read_shape("k", "1x64MiB") == (1, 64 << 20)
    assert read_shape("k", "1024x4KiB") == (1024, 4096)
    assert "read_shape" in RESTART_ONLY and "read_shape" not in TUNABLE


@pytest.mark.parametrize("scheme", ["int8_symmetric", "int4_symmetric"])
def test_quantization_schemes_accepted(scheme):
    cfg = FlashConfig.from_dict({"quantization_scheme": scheme, "quantization_granularity": "per_tensor"})
    assert cfg.quantization_scheme == scheme and cfg.quantization_granularity == "per_tensor"


def test_unknown_key_rejected():
    with pytest.raises(ConfigError, match="prefetch_windw") as info:
        FlashConfig.from_dict({"prefetch_windw": 3})
    assert info.value.key == "prefetch_windw"


@pytest.mark.parametrize("text, expected", [
    (4096, 4096), ("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("1G", 1 << 30), ("2MB", 2_000_000),
    ("1.5KiB", 1536)])
def test_sizes(text, expected):
    assert parse_size("host_cache_bytes", text) == expected


def test_host_cache_and_devices_forms():
    cfg = FlashConfig.from_dict({"host_cache_bytes": "8GiB", "devices": ["cuda:1", 0],
                                 "socket_mode": "0600", "socket_group": "flash"})
    assert cfg.host_cache_bytes == 8 << 30 and cfg.devices == [0, 1]
    assert cfg.socket_mode == 0o600 and cfg.socket_group == "flash"
    with pytest.raises(ConfigError, match="1 MiB"):
        FlashConfig.from_dict({"host_cache_bytes": "12KiB"})
    with pytest.raises(ConfigError, match="not a size"):
        FlashConfig.from_dict({"host_cache_bytes": "lots"})


def test_model_registry_names_are_names():
    cfg = FlashConfig.from_dict({"models": {"llama-8b": "/srv/llama", "org/model": "/srv/m"}})
    assert cfg.models == {"llama-8b": "/srv/llama", "org/model": "/srv/m"}
    for bad in ("../x", "a/../b", "/abs", ""):
        with pytest.raises(ConfigError) as info:
            FlashConfig.from_dict({"models": {bad: "/srv/x"}})
        assert info.value.key == "models"


def test_load_missing_file_gives_defaults_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO, "deepseek_flash.config"):
        cfg = FlashConfig.load(tmp_path / "nope.json")
    assert cfg == FlashConfig()
    assert "not found; using defaults" in caplog.text


def test_load_file_errors_name_the_file(tmp_path):
    path = tmp_path / "flash.json"
    path.write_text(json.dumps({"prefetch_window": 2, "host_cache_bytes": "64MiB"}))
    assert FlashConfig.load(path).host_cache_bytes == 64 << 20
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        FlashConfig.load(path)
    assert info.value.path == str(path)
    path.write_text(json.dumps({"eviction_threshold": 2}))
    with pytest.raises(ConfigError) as info:
        FlashConfig.load(path)
    assert str(path) in str(info.value) and info.value.key == "eviction_threshold"


def test_model_overrides_apply_model_keys_and_refuse_daemon_keys(monkeypatch):
    base = FlashConfig()
    cfg, ignored = base.model_overrides(
        {"flash_config": {"prefetch_window": 5, "error_recovery_mode": "graceful"}}, "m")
    assert cfg.prefetch_window == 5 and cfg.error_recovery_mode == "graceful"
    assert cfg.host_cache_bytes == base.host_cache_bytes and ignored == []
    monkeypatch.setenv("DEEPSEEK_FLASH_CONFIG", "/etc/deepseek-flash/flash.json")
    with pytest.raises(ConfigError) as info:
        base.model_overrides({"flash_config": {"prefetch_window": 5, "host_cache_bytes": "1TiB"}}, "m")
    assert str(info.value) == ("model m config.json flash_config: host_cache_bytes is daemon-wide and only "
                               "flash.json (/etc/deepseek-flash/flash.json) can set it; remove it from "
                               "the model's config.json")
    assert (info.value.key, info.value.value, info.value.code) == ("host_cache_bytes", "1TiB", 500)
    with pytest.raises(ConfigError, match="model m") as info:
        base.model_overrides({"flash_config": {"prefetch_window": 99}}, "m")
    assert info.value.key == "prefetch_window"


def test_per_open_overrides_refuse_daemon_keys():
    cfg = FlashConfig()
    assert cfg.override({"prefetch_window": 0}, scope="model").prefetch_window == 0
    with pytest.raises(ConfigError, match="daemon-wide") as info:
        cfg.override({"eviction_threshold": 0.5}, scope="model")
    assert info.value.key == "eviction_threshold"


def test_tunables():
    assert set(TUNABLE) == {"prefetch_window", "block_eviction_policy", "eviction_threshold",
                            "error_recovery_mode", "max_outstanding_requests_per_client",
                            "max_leases_per_client"}
    assert check_tunable("prefetch_window", 4) == 4
    with pytest.raises(ConfigError, match="fixed at start") as info:
        check_tunable("host_cache_bytes", "1GiB")
    assert info.value.key == "host_cache_bytes"
    with pytest.raises(ConfigError, match="unknown tunable"):
        check_tunable("nope", 1)
    with pytest.raises(ConfigError):
        check_tunable("eviction_threshold", -0.1)


def test_config_is_immutable():
    cfg = FlashConfig()
    with pytest.raises(AttributeError):
        cfg.prefetch_window = 3


@pytest.mark.parametrize("key, value, allowed", [
    ("kv_gpu_tokens", -1, "0..1048576"),
    ("kv_sink_tokens", 1.5, "0..4096"),
    ("kv_page_tokens", 48, "\"auto\" | 16 | 32 | 64 | 128"),
    ("kv_page_tokens", True, "\"auto\" | 16 | 32 | 64 | 128"),
    ("kv_top_k_pages", 0, "null | int >= 1 | 0 < fraction <= 1"),
    ("kv_top_k_pages", 1.5, "null | int >= 1 | 0 < fraction <= 1"),
    ("kv_spill_dir", "", "null | \"/path\""),
    ("kv_prune_threshold", 1.5, "null | 0 <= number <= 1"),
    ("kv_prune_threshold", "0.15", "null | 0 <= number <= 1"),
    ("kv_prune_threshold", True, "null | 0 <= number <= 1"),
    ("kv_page_cache", 0.5, "\"auto\" | null | 0 | number >= 1"),
    ("kv_page_cache", "all", "\"auto\" | null | 0 | number >= 1"),
])
def test_kv_keys_invalid(key, value, allowed):
    with pytest.raises(ConfigError) as info:
        FlashConfig.from_dict({key: value})
    assert info.value.key == key and info.value.allowed == allowed


def test_kv_keys_defaults_and_per_open():
    cfg = FlashConfig()
    assert (cfg.kv_gpu_tokens, cfg.kv_sink_tokens, cfg.kv_page_tokens, cfg.kv_top_k_pages,
            cfg.kv_host_bytes, cfg.kv_spill_dir) == (512, 4, "auto", None, None, None)
    opened = cfg.override({"kv_top_k_pages": 0.25, "kv_host_bytes": "1GiB", "kv_page_tokens": 64},
                          scope="model")
    assert (opened.kv_top_k_pages, opened.kv_host_bytes, opened.kv_page_tokens) == (0.25, 1 << 30, 64)
    assert cfg.kv_prune_threshold is None
    assert cfg.kv_page_cache == 1.5
    assert cfg.override({"kv_page_cache": 2}, scope="model").kv_page_cache == 2.0
    assert cfg.override({"kv_page_cache": "auto"}, scope="model").kv_page_cache == "auto"
    assert cfg.kv_prune_threshold is None
    assert cfg.override({"kv_prune_threshold": 0.15}, scope="model").kv_prune_threshold == 0.15
    with pytest.raises(ConfigError):
        FlashConfig.from_dict({"kv_host_bytes": "lots"})
