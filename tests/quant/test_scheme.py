"""quant.scheme: QuantSpec sizes and the config-vs-store check (pure, table-tested)."""
from __future__ import annotations

import pytest

from deepseek_flash.errors import ConfigError
from deepseek_flash.quant import QuantSpec
from deepseek_flash.quant.scheme import check_served

INT4_G128 = {"scheme": "int4_symmetric", "granularity": "per_block", "group_size": 128}


def test_sizes():
    s = QuantSpec("int4_symmetric", "per_block", 64)
    assert s.data_nbytes((10, 256)) == 1280 and s.scales_shape((10, 256)) == (10, 4)
    assert QuantSpec("int8_symmetric", "per_tensor", 64).group_size == 0
    assert QuantSpec.from_dict(INT4_G128) == QuantSpec("int4_symmetric")
    assert QuantSpec("int4_symmetric").label() == "int4_symmetric per_block g128"


@pytest.mark.parametrize("store, scheme, granularity", [
    (None, "none", "per_block"),
    (INT4_G128, "none", "per_tensor"),
    (INT4_G128, "int4_symmetric", "per_block"),
])
def test_served(store, scheme, granularity):
    check_served(store, scheme, granularity, "m")


@pytest.mark.parametrize("store, scheme, granularity, key, message", [
    (INT4_G128, "int8_symmetric", "per_block", "quantization_scheme",
     "model m: the store is packed int4_symmetric per_block g128, but the configuration asks for "
     "quantization_scheme 'int8_symmetric', quantization_granularity 'per_block'"),
    (INT4_G128, "int4_symmetric", "per_tensor", "quantization_granularity",
     "quantization_granularity 'per_tensor'; they must agree"),
    (None, "int4_symmetric", "per_block", "quantization_scheme",
     "model m: quantization_scheme 'int4_symmetric' asks for quantized weights, but the model is "
     "open unquantized"),
])
def test_disagreement_is_a_config_error_naming_both(store, scheme, granularity, key, message):
    with pytest.raises(ConfigError) as info:
        check_served(store, scheme, granularity, "m")
    assert message in str(info.value) and info.value.key == key and info.value.code == 500


def test_host_tier_quantized_model_says_so():
    with pytest.raises(ConfigError) as info:
        check_served(INT4_G128, "int8_symmetric", "per_block", "m", "host_tier")
    assert ("model m: the model is served int4_symmetric per_block g128 (quantized as its blocks "
            "enter the host tier), but the configuration asks for quantization_scheme "
            "'int8_symmetric'") in str(info.value)
    assert "unload the model and open it again" in str(info.value)
