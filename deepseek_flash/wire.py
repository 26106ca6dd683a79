"""What crosses the control socket: the shapes the client and the daemon agree on.

``protocol`` moves messages (frames, msgpack, the hello's SCM_RIGHTS fd); this module says what
is inside them and what the two sides share through memory: the op names, a model's description,
a lease, a residency plan, and the *control page* a load keeps in the shared host arena. Both
sides import it and nothing else of each other, so a change to a shape is made here once.

Control page (in the host arena, at the ``control_offset`` of an attach reply)::

    uint32 gate_state[G]        G = layers + 2 (0 embeddings, 1..L decoder layers, G-1 norm + head)
    (pad to 8 bytes)
    uint64 block_offset[B]      per block (store order): its offset in the device's memory

A gate word is ``GATE_PENDING`` until the loader has issued the gate's copies (and recorded its
event), then ``GATE_READY``; ``GATE_FAILED`` when its bytes could not be loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .fsutil import align_up

OPS = ("hello", "list_models", "open_model", "close_model", "acquire", "release", "prefetch",
       "status", "stats", "get_tunable", "set_tunable", "load", "unload", "attach", "detach",
       "report_stream", "profile", "shard", "report_kv", "kv_alloc", "kv_free", "imports_done")

GATE_PENDING, GATE_READY, GATE_FAILED = 0, 1, 2

# A streaming slot holds one layer's streamed blocks back to back, each starting at a multiple of
# this: the planner sizes slots with it and the client lays blocks out with it.
SLOT_ALIGNMENT = 4096
# The residency plan's rule, shared by the planner (daemon) and the client's device_map split:
# these blocks of a layer (its MLP) stream through slots; a plan that streams has at least
# MIN_SLOTS of them.
STREAM_ROLES = ("mlp_gate_up", "mlp_down")
MIN_SLOTS = 2
# What one slot of the ring holds (``stream_unit``): a streamed layer's whole MLP, or one of its
# projections (gate, up, down: a slot a third of the size, so the budget the ring no longer
# takes keeps more MLPs resident). The default is ``projection``: under the same budget it never
# streams more bytes a token than ``layer`` (the ring is a third of the size), and at the 7-8B
# shapes under 8 GiB it streams 8-10 % fewer (docs/benchmarks.md, measured on the H200).
STREAM_UNITS = ("layer", "projection")
DEFAULT_STREAM_UNIT = "projection"


def unit_module(name: str) -> str:
    """The module a tensor of a unit belongs to (``model.layers.3.mlp.gate_proj.weight`` ->
    ``model.layers.3.mlp.gate_proj``)."""
    return name.rpartition(".")[0]


def stream_units(blocks, unit: str) -> list[list[tuple[int, int, int]]]:
    """One streamed layer's *units* in forward order, each the ``(block id, offset in the block,
    length)`` byte ranges one slot receives, laid out back to back in the slot at
    ``SLOT_ALIGNMENT`` (``unit_bytes``). ``blocks``: the layer's streamed blocks (``BlockInfo``)
    in store order. ``"layer"``: one unit, every block whole. ``"projection"``: one unit per
    module (a projection's weight and bias), in the order the blocks list them -- gate, up,
    then down, the order the MLP runs them; a quantized weight's unit holds its codes and its
    scales."""
    if unit == "layer":
        return [[(b.id, 0, b.length) for b in blocks]]
    if unit != "projection":
        raise ValueError(f"stream_unit must be one of {', '.join(STREAM_UNITS)}, not {unit!r}")
    out, owner = [], None
    for b in blocks:
        for t in b.tensors:
            module = unit_module(t.name)
            if module != owner:
                out.append([])
                owner = module
            out[-1].append((b.id, t.offset, t.nbytes))
            if t.quant:
                out[-1].append((b.id, t.quant["scales_offset"], t.quant["scales_nbytes"]))
    return out


def unit_bytes(ranges) -> int:
    """A unit's size in a slot: its ranges back to back, each at ``SLOT_ALIGNMENT``."""
    return sum(-(-n // SLOT_ALIGNMENT) * SLOT_ALIGNMENT for _, _, n in ranges)


# --- the control page ------------------------------------------------------------------------------

def _offsets_start(num_gates: int) -> int:
    return align_up(4 * num_gates, 8)


def control_page_size(num_gates: int, num_blocks: int) -> int:
    return _offsets_start(num_gates) + 8 * num_blocks


def control_views(buffer, offset: int, num_gates: int, num_blocks: int):
    """(gate states uint32[G], block offsets uint64[B]) over a control page in ``buffer``."""
    gates = np.frombuffer(buffer, dtype=np.uint32, count=num_gates, offset=offset)
    offsets = np.frombuffer(buffer, dtype=np.uint64, count=num_blocks,
                            offset=offset + _offsets_start(num_gates))
    return gates, offsets


# --- blocks, models, leases ------------------------------------------------------------------------

def block_to_wire(block) -> dict:
    return block.to_dict()


def block_from_wire(data: dict):
    from .store import BlockInfo

    return BlockInfo.from_dict(data)


@dataclass
class ModelInfo:
    """What a client learns when it opens a model (the reply to ``open_model``)."""

    name: str
    path: str
    config: dict
    blocks: list                        # BlockInfo, store order
    num_layers: int
    total_bytes: int
    flash_config: dict
    plan: dict = field(default_factory=dict)
    ignored_overrides: list = field(default_factory=list)

    def to_wire(self) -> dict:
        return {"name": self.name, "path": self.path, "config": self.config,
                "blocks": [block_to_wire(b) for b in self.blocks], "num_layers": self.num_layers,
                "total_bytes": self.total_bytes, "flash_config": self.flash_config,
                "plan": self.plan, "ignored_overrides": self.ignored_overrides}

    @classmethod
    def from_wire(cls, w: dict) -> ModelInfo:
        return cls(name=w["name"], path=w["path"], config=w["config"],
                   blocks=[block_from_wire(b) for b in w["blocks"]], num_layers=w["num_layers"],
                   total_bytes=w["total_bytes"], flash_config=w["flash_config"], plan=w["plan"],
                   ignored_overrides=w["ignored_overrides"])


@dataclass
class Lease:
    """Blocks a client holds: ``blocks`` maps block id -> offset in the host arena.

    ``client`` is the holder's id in the daemon's books; it is not part of the wire form (a
    client knows who it is).
    """

    id: int
    model: str
    blocks: dict
    client: int = 0

    def to_wire(self) -> dict:
        return {"lease": self.id, "model": self.model, "blocks": self.blocks}

    @classmethod
    def from_wire(cls, w: dict) -> Lease:
        return cls(w["lease"], w["model"], w["blocks"])


@dataclass
class Plan:
    """Which blocks stay on the device and which stream through slots (``daemon.planner``
    computes it, the client executes it)."""

    budget: int
    resident: list[int]                 # block ids kept on the device
    streamed_layers: list[int]          # decoder layers whose MLP streams, in forward order
    stream_blocks: dict[int, list[int]] = field(default_factory=dict)   # layer -> block ids
    slot_bytes: int = 0
    n_slots: int = 0
    resident_bytes: int = 0
    window: int = 0                     # the streaming client's starting prefetch window
    unit: str = DEFAULT_STREAM_UNIT     # what one slot holds (``STREAM_UNITS``, ``stream_units``)

    @property
    def streaming(self) -> bool:
        return bool(self.streamed_layers)

    def to_wire(self) -> dict:
        return {"budget": self.budget, "resident": self.resident,
                "streamed_layers": self.streamed_layers,
                "stream_blocks": {str(k): v for k, v in self.stream_blocks.items()},
                "slot_bytes": self.slot_bytes, "n_slots": self.n_slots,
                "resident_bytes": self.resident_bytes, "window": self.window,
                "unit": self.unit}

    @classmethod
    def from_wire(cls, w: dict) -> Plan:
        return cls(budget=w["budget"], resident=list(w["resident"]),
                   streamed_layers=list(w["streamed_layers"]),
                   stream_blocks={int(k): list(v) for k, v in w["stream_blocks"].items()},
                   slot_bytes=w["slot_bytes"], n_slots=w["n_slots"],
                   resident_bytes=w["resident_bytes"], window=int(w.get("window", 0)),
                   unit=w.get("unit", "layer"))
