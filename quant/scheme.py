"""What a quantized tensor is: scheme (int8/int4 symmetric), granularity and group size.

Pure values, shared by the packer, the store's tensor maps, the config and the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("int8_symmetric", "int4_symmetric")
GRANULARITIES = ("per_block", "per_tensor")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GRANULARITY = "per_block"
DEFAULT_GROUP_SIZE = 128

# Storage element of each scheme (the tensor map's ``dtype``) and its code range. Symmetric: the
# zero point is 0; int4 uses the whole two's complement range, -8..7 (the scale search may put the
# most negative value of a group on -8).
STORAGE_DTYPE = {"int8_symmetric": "int8", "int4_symmetric": "int4"}
QRANGE = {"int8_symmetric": (-128, 127), "int4_symmetric": (-8, 7)}
# Scales are IEEE float16 on disk whatever the source dtype: half the bytes of float32 and enough
# precision once the search picks the scale among float16 values (docs/format.md).
SCALE_DTYPE = "float16"


@dataclass(frozen=True)
class QuantSpec:
    """One quantization choice. ``group_size`` is the number of consecutive input-dimension
    elements of a row that share a scale (per_block); per_tensor has one scale and group_size 0."""

    scheme: str
    granularity: str = DEFAULT_GRANULARITY
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r}: allowed {', '.join(SCHEMES)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"quantization granularity {self.granularity!r}: allowed "
                             f"{', '.join(GRANULARITIES)}")
        if self.granularity == "per_tensor":
            object.__setattr__(self, "group_size", 0)
        elif self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size {self.group_size}: allowed "
                             f"{', '.join(map(str, GROUP_SIZES))}")

    @property
    def bits(self) -> int:
        return 8 if self.scheme == "int8_symmetric" else 4

    @property
    def qmin(self) -> int:
        return QRANGE[self.scheme][0]

    @property
    def qmax(self) -> int:
        return QRANGE[self.scheme][1]

    @property
    def storage_dtype(self) -> str:
        return STORAGE_DTYPE[self.scheme]

    def data_nbytes(self, shape) -> int:
        rows, cols = shape
        return rows * cols * self.bits // 8

    def scales_shape(self, shape) -> tuple:
        rows, cols = shape
        return (1,) if self.granularity == "per_tensor" else (rows, cols // self.group_size)

    def check_shape(self, shape, name: str = "tensor") -> None:
        """ValueError naming ``name`` when a weight of ``shape`` cannot take this scheme."""
        if len(shape) != 2:
            raise ValueError(f"{name}: only 2-D linear weights are quantized, shape {list(shape)}")
        cols = shape[1]
        if self.bits == 4 and cols % 2:
            raise ValueError(f"{name}: int4 packs two columns per byte; {cols} columns is odd")
        if self.granularity == "per_block" and cols % self.group_size:
            raise ValueError(f"{name}: {cols} input columns are not a multiple of the group size "
                             f"{self.group_size}")

    def label(self) -> str:
        return (f"{self.scheme} {self.granularity}" +
                (f" g{self.group_size}" if self.granularity == "per_block" else ""))

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "granularity": self.granularity, "group_size": self.group_size}

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        return cls(d["scheme"], d["granularity"], int(d.get("group_size") or 0) or DEFAULT_GROUP_SIZE)


def quantized_at(store) -> str:
    """Where a served store's weights were quantized: ``pack``, ``host_tier`` (quantized as its
    blocks are loaded: ``quant.host_tier``) or ``none``."""
    if store.quant is None:
        return "none"
    return getattr(store, "quantized_at", "pack")


def check_served(store_quant: dict | None, scheme: str, granularity: str, model: str,
                 where: str = "pack") -> None:
    """The ``quantization_scheme``/``quantization_granularity`` keys of an open of a model against
    how the model is served (``store_quant``: its blocks' ``quant`` map, None when unquantized;
    ``where``: ``pack`` or ``host_tier``, as ``quantized_at``).

    ``none`` serves the model as it is held. Otherwise the scheme and granularity must match the
    model's; a scheme for a model already open unquantized cannot be served (the first open
    decides how the host tier holds a model, ``quant.host_tier``). Either way ConfigError names
    both and what to do.
    """
    from ..errors import ConfigError

    if scheme == "none":
        return
    if store_quant is None:
        raise ConfigError(
            f"model {model}: quantization_scheme {scheme!r} asks for quantized weights, but the "
            f"model is open unquantized (its first open had quantization_scheme 'none'; an "
            f"unquantized store is quantized when its model is opened, not later) -- unload it "
            f"(deepseek-flash unload {model}) and open it again with this key, put the key in the "
            f"model's flash_config, or pack it quantized: deepseek-flash pack SRC DST --quantize "
            f"{scheme} --granularity {granularity}",
            key="quantization_scheme", value=scheme, allowed=["none"])
    packed = QuantSpec.from_dict(store_quant)
    how = ("the store is packed " + packed.label() if where == "pack" else
           f"the model is served {packed.label()} (quantized as its blocks enter the host tier)")
    if (packed.scheme, packed.granularity) != (scheme, granularity):
        raise ConfigError(
            f"model {model}: {how}, but the configuration asks for "
            f"quantization_scheme {scheme!r}, quantization_granularity {granularity!r}; they must "
            f"agree (set them to {packed.scheme!r} and {packed.granularity!r}, or to 'none', or "
            f"{'repack' if where == 'pack' else 'unload the model and open it again'})",
            key="quantization_scheme" if packed.scheme != scheme else
            "quantization_granularity", value=scheme if packed.scheme != scheme else granularity,
            allowed=[packed.scheme if packed.scheme != scheme else packed.granularity, "none"])
