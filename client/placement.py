"""Where a model's decoder layers run: a ``device_map`` resolved into *parts*, one per device slice.

Pure (no torch, no IO): ``load_model`` passes in what it learned (the model's blocks, the devices
that exist, their free memory) and executes the parts this module returns. Each part is attached
on its own (``attach`` with the part's blocks): its own load and arena on its device, its own
residency plan under its own budget, its own slot ring and copy stream when it streams.

``device_map`` forms (docs/multigpu.md):

* ``"auto"``: every visible CUDA device (``["cpu"]`` without one);
* ``{"devices": ["cuda:0", "cuda:1"]}``: these devices, in this order; a device may repeat (two
  *logical slices* of one GPU: two parts, two loads, two slot rings, two copy streams);
* ``{"layers": {"cuda:0": range(0, 16), "cuda:1": range(16, 32)}}`` or, where a device repeats,
  ``{"layers": [["cuda:0", [0, 1]], ["cuda:0", [2, 3]]]}``: every layer exactly once.

Either dict may add ``"l0_device": "cuda:0"``: the seed's rule for real-time (L0) work -- that
device's parts are held whole (never streamed), so once loaded its PCIe link carries no weight
copies and is left to the L0 requests whose KV lives there; the weight budget goes to the other
parts. It places weights; it does not route requests (docs/multigpu.md).

Automatic maps cut the layers into contiguous runs whose bytes follow each part's *capacity*:
its budget where ``weight_budget`` is a dict, else its device's free memory (a device's slices
share it equally), else equal shares. The embeddings go with layer 0's part, the final norm and
lm_head with the last layer's part (and, for tied embeddings, a copy of the embedding block).

``weight_budget``: None (everything resident), a total (``int`` or ``"8GiB"``), a dict
``{device: budget}`` (a device's budget is split among its slices; a device left out is not
capped), or a list with one budget per part. A total (or a device's budget over its slices) is
split so that every part first gets its *resident minimum* -- what the planner needs before
anything can stream: the part's anchors (its embeddings, norms, attention, head) plus two
streaming slots of its largest unit (``stream_unit``: an MLP, or one projection) -- and the rest in proportion to what each part could still
keep resident beyond that, so the parts stream the same share of their MLPs. (A split by bytes
alone ignores that every part pays its own anchors and slots: half of each part's bytes can be
below its minimum while half of the model is well above the one-device minimum.) A budget below
the sum of the minimums is refused with ``BudgetTooSmall`` naming each part's. Without
``stream_bytes`` (callers that do not know the layers' MLP sizes) the split is by bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import BudgetTooSmall, DeviceMapError
from ..sizes import parse_size
from ..wire import DEFAULT_STREAM_UNIT, MIN_SLOTS, STREAM_ROLES, stream_units, unit_bytes

EMBED_PREFIX = "model.embed_tokens."
HEAD_PREFIXES = ("model.norm.", "lm_head.")


@dataclass(frozen=True)
class Part:
    """One device slice of a model: its layers, whether it holds the embeddings (``first``) and
    the final norm + lm_head (``last``), and its weight budget (None: uncapped)."""

    index: int
    device: str                      # "cpu" or "cuda:N"
    layers: tuple[int, ...]
    first: bool
    last: bool
    budget: int | None = None
    l0: bool = False                 # on the map's ``l0_device``: held whole, never streamed

    @property
    def target(self):
        """What ``attach`` takes: "cpu" or the CUDA index."""
        return "cpu" if self.device == "cpu" else int(self.device.split(":")[1])

    def owns(self, name: str) -> bool:
        """Whether parameter ``name`` (HF name) is bound by this part."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layers
        if name.startswith(EMBED_PREFIX):
            return self.first
        return self.last and name.startswith(HEAD_PREFIXES)

    def blocks(self, blocks) -> list:
        """The block ids this part places (BlockInfo list in store order)."""
        layers = set(self.layers)
        aliased_head = not any(b.role == "lm_head" for b in blocks)
        out = []
        for b in blocks:
            if b.layer >= 0:
                keep = b.layer in layers
            elif b.role == "embed":
                # Tied embeddings: lm_head is an alias of the embedding block's bytes.
                keep = self.first or (self.last and aliased_head)
            else:
                keep = self.last
            if keep:
                out.append(b.id)
        return out

    def describe(self) -> str:
        span = (f"layers {self.layers[0]}-{self.layers[-1]}" if self.layers and
                list(self.layers) == list(range(self.layers[0], self.layers[-1] + 1))
                else f"layers {list(self.layers)}")
        return f"part {self.index} on {self.device} ({span})"


def normalize_device(device, available: list[str]) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a device a user typed; DeviceMapError for one that does not
    exist here (``available``: the devices that do)."""
    text = str(device).strip()
    if text == "cuda":
        text = "cuda:0"
    if isinstance(device, int) and not isinstance(device, bool):
        text = f"cuda:{device}"
    if text != "cpu":
        head, _, index = text.partition(":")
        if head != "cuda" or not index.isdigit():
            raise DeviceMapError(f"device_map: {device!r} is not a device ('cpu' or 'cuda:N')",
                                 device=str(device))
        text = f"cuda:{int(index)}"
    if text not in available:
        raise DeviceMapError(f"device_map: device {text} does not exist here (devices: "
                             f"{', '.join(available)})", device=text, available=list(available))
    return text


def _layer_list(device: str, layers, num_layers: int) -> list[int]:
    try:
        out = [int(x) for x in layers]
    except (TypeError, ValueError):
        raise DeviceMapError(f"device_map: the layers of {device} must be a list or range of "
                             f"layer numbers, not {layers!r}", device=device) from None
    for layer in out:
        if not 0 <= layer < num_layers:
            raise DeviceMapError(f"device_map: layer {layer} given to {device} does not exist "
                                 f"(the model has layers 0-{num_layers - 1})", device=device,
                                 layer=layer)
    return out


def _explicit(spec, num_layers: int, available: list[str]) -> list[tuple[str, list[int]]]:
    items = list(spec.items()) if isinstance(spec, dict) else list(spec)
    runs, owner = [], {}
    for item in items:
        try:
            raw_device, layers = item
        except (TypeError, ValueError):
            raise DeviceMapError(f"device_map: {item!r} is not a (device, layers) pair",
                                 device=str(item)) from None
        device = normalize_device(raw_device, available)
        layer_list = _layer_list(device, layers, num_layers)
        for layer in layer_list:
            if layer in owner:
                raise DeviceMapError(f"device_map: layer {layer} is given twice ({owner[layer]} "
                                     f"and {device})", device=device, layer=layer)
            owner[layer] = device
        if layer_list:
            runs.append((device, sorted(layer_list)))
    missing = [layer for layer in range(num_layers) if layer not in owner]
    if missing:
        raise DeviceMapError(f"device_map: layers {missing} are on no device", layer=missing[0],
                             missing=missing)
    # Parts in forward order (by their first layer): the embeddings go with layer 0's part.
    return sorted(runs, key=lambda run: run[1][0])


def _auto(devices: list[str], capacity: list[float], layer_bytes: list[int], edge_bytes: tuple[int, int]
          ) -> list[tuple[str, list[int]]]:
    n, parts = len(layer_bytes), len(devices)
    if parts > n:
        raise DeviceMapError(f"device_map: {parts} devices for {n} layers; give at most one "
                             f"device per layer", device=devices[-1])
    total_cap = sum(capacity) or float(parts)
    shares = [c / total_cap if sum(capacity) else 1.0 / parts for c in capacity]
    total = sum(layer_bytes) + sum(edge_bytes)
    bounds, acc = [], 0.0
    for share in shares:
        acc += share
        bounds.append(acc * total)
    # Each layer goes to the part whose byte range holds the layer's middle byte.
    starts, cum, part = [0] * parts, edge_bytes[0], 0
    owner = []
    for size in layer_bytes:
        middle = cum + size / 2
        while part < parts - 1 and middle >= bounds[part]:
            part += 1
        owner.append(part)
        cum += size
    for k in range(parts):
        starts[k] = next((i for i, p in enumerate(owner) if p >= k), n)
    # Every part gets at least one layer: clamp the starts into [k, n - (parts - k)].
    for k in range(1, parts):
        starts[k] = min(max(starts[k], starts[k - 1] + 1), n - (parts - k))
    ends = starts[1:] + [n]
    return [(devices[k], list(range(starts[k], ends[k]))) for k in range(parts)]


def resolve(device_map, *, num_layers: int, layer_bytes: list[int], edge_bytes: tuple[int, int],
            weight_budget=None, available: list[str], free_bytes: dict | None = None,
            stream_bytes: list[int] | None = None, slot_bytes: list[int] | None = None) -> list[Part]:
    """The parts of ``device_map`` (see the module docstring) for a model of ``num_layers``
    layers of ``layer_bytes`` each plus ``edge_bytes`` (embeddings, norm + head) bytes.
    ``stream_bytes``: of each layer's bytes, those that may stream (its MLP); the rest of a layer
    stays resident. With it a total budget's split gives every part its resident minimum first.
    ``slot_bytes``: each layer's largest streaming unit (``stream_unit``; default: its MLP).

    ``available``: the devices that exist (``"cpu"`` and ``"cuda:N"``); ``free_bytes``: free
    memory per CUDA device for automatic maps. Raises ``DeviceMapError`` naming the device or
    layer at fault."""
    if len(layer_bytes) != num_layers:
        raise ValueError("layer_bytes must list every layer")
    if stream_bytes is not None and len(stream_bytes) != num_layers:
        raise ValueError("stream_bytes must list every layer")
    budgets = weight_budget if isinstance(weight_budget, dict) else None
    l0 = None
    if isinstance(device_map, dict) and "l0_device" in device_map:
        device_map = dict(device_map)
        l0 = normalize_device(device_map.pop("l0_device"), available)
    if device_map == "auto":
        cuda = [d for d in available if d != "cpu"]
        runs_spec = ("devices", cuda or ["cpu"])
    elif isinstance(device_map, dict) and set(device_map) == {"devices"}:
        devices = device_map["devices"]
        if isinstance(devices, (str, bytes)) or not list(devices):
            raise DeviceMapError(f"device_map: 'devices' must be a non-empty list, not {devices!r}",
                                 device=str(devices))
        runs_spec = ("devices", [normalize_device(d, available) for d in devices])
    elif isinstance(device_map, dict) and set(device_map) == {"layers"}:
        runs_spec = ("layers", device_map["layers"])
    else:
        raise DeviceMapError(f"device_map must be \"auto\", {{\"devices\": [...]}} or "
                             f"{{\"layers\": ...}}, not {device_map!r}", device=str(device_map))

    if budgets is not None:
        budgets = {normalize_device(d, available): parse_size("weight_budget", b)
                   for d, b in budgets.items()}
    if runs_spec[0] == "devices":
        devices = runs_spec[1]
        count = {d: devices.count(d) for d in devices}
        if budgets is not None and all(d in budgets for d in devices):
            capacity = [budgets[d] / count[d] for d in devices]
        elif free_bytes and all(d in free_bytes for d in devices):
            capacity = [free_bytes[d] / count[d] for d in devices]
        else:
            capacity = [1.0] * len(devices)
        runs = _auto(devices, capacity, layer_bytes, edge_bytes)
    else:
        runs = _explicit(runs_spec[1], num_layers, available)

    used = {d for d, _ in runs}
    if l0 is not None and l0 not in used:
        raise DeviceMapError(f"device_map: l0_device {l0} holds no layers of the map (devices: "
                             f"{', '.join(sorted(used))})", device=l0)
    if budgets is not None:
        for device in budgets:
            if device not in used:
                raise DeviceMapError(f"weight_budget names {device}, which the device_map does "
                                     f"not use (devices: {', '.join(sorted(used))})", device=device)
    part_bytes = []
    for k, (device, layers) in enumerate(runs):
        size = sum(layer_bytes[i] for i in layers)
        size += edge_bytes[0] if 0 in layers else 0
        size += edge_bytes[1] if num_layers - 1 in layers else 0
        part_bytes.append(size)
    minimums = _minimums(runs, part_bytes, stream_bytes, slot_bytes)
    if l0 is None:
        part_budgets = _split_budget(weight_budget, budgets, runs, part_bytes, minimums)
    else:
        part_budgets = _l0_budgets(l0, weight_budget, budgets, runs, part_bytes, minimums)
    return [Part(index=k, device=device, layers=tuple(layers), first=0 in layers,
                 last=num_layers - 1 in layers, budget=part_budgets[k], l0=device == l0)
            for k, (device, layers) in enumerate(runs)]


def block_sizes(blocks, num_layers: int, alignment: int, unit: str = DEFAULT_STREAM_UNIT) -> dict:
    """``resolve``'s size arguments for a model's blocks (BlockInfo list), counted as the planner
    counts them (each block at an ``alignment``-aligned offset): ``layer_bytes``, ``stream_bytes``
    (each layer's MLP: the blocks of ``wire.STREAM_ROLES``) and ``edge_bytes``
    (embeddings; final norm + head, plus the embedding block again where the head is tied to it:
    the last part holds that block too, ``Part.blocks``)."""
    def aligned(n: int) -> int:
        return (n + alignment - 1) // alignment * alignment

    layer_bytes, stream_bytes, edges = [0] * num_layers, [0] * num_layers, [0, 0]
    mlp: list[list] = [[] for _ in range(num_layers)]
    for b in blocks:
        size = aligned(b.length)
        if b.layer >= 0:
            layer_bytes[b.layer] += size
            if b.role in STREAM_ROLES:
                stream_bytes[b.layer] += size
                mlp[b.layer].append(b)
        else:
            edges[0 if b.role == "embed" else 1] += size
    if not any(b.role == "lm_head" for b in blocks):
        edges[1] += edges[0]
    slot_bytes = [max((unit_bytes(u) for u in stream_units(group, unit)), default=0) if group else 0
                  for group in mlp]
    return {"num_layers": num_layers, "layer_bytes": layer_bytes, "stream_bytes": stream_bytes,
            "slot_bytes": slot_bytes, "edge_bytes": tuple(edges)}


def _minimums(runs, part_bytes, stream_bytes, slot_bytes=None) -> list[int] | None:
    """Each part's resident minimum (anchors + ``MIN_SLOTS`` slots of its largest streaming
    unit -- ``slot_bytes``, else its largest MLP; its whole size where that is less), or None
    without ``stream_bytes``."""
    if stream_bytes is None:
        return None
    slots = slot_bytes if slot_bytes is not None else stream_bytes
    out = []
    for (_, layers), size in zip(runs, part_bytes):
        streamable = sum(stream_bytes[i] for i in layers)
        slot = max((slots[i] for i in layers), default=0)
        out.append(min(size, size - streamable + MIN_SLOTS * slot))
    return out


def _share(total: int, runs, sizes: list[int], minimums: list[int] | None, what: str) -> list[int]:
    """``total`` bytes split over parts of ``sizes`` bytes: by bytes where the minimums are not
    known or everything fits; else each part's minimum first and the rest in proportion to
    what each part could still keep resident beyond it."""
    whole = sum(sizes)
    if len(sizes) == 1:
        return [total]          # nothing to split: the planner names what does not fit
    if minimums is None or total >= whole:
        return [int(total * b / whole) for b in sizes]
    need = sum(minimums)
    if total < need:
        each = ", ".join(f"part on {d} (layers {layers[0]}-{layers[-1]}) {m}"
                         for (d, layers), m in zip(runs, minimums))
        raise BudgetTooSmall(
            f"{what} {total} bytes cannot be split over {len(runs)} parts: each part needs its own "
            f"anchors (embeddings, norms, attention, head) plus {MIN_SLOTS} streaming slots -- "
            f"{each} bytes -- {need} bytes in all; raise the budget or use fewer parts",
            budget=total, minimum=need, part_minimums=list(minimums), device=runs[0][0])
    rest, room = total - need, [b - m for b, m in zip(sizes, minimums)]
    spare = sum(room)
    return [m + (rest * r // spare if spare else 0) for m, r in zip(minimums, room)]


def _l0_budgets(l0: str, weight_budget, budgets, runs, part_bytes, minimums=None) -> list[int | None]:
    """Budgets where the parts on ``l0`` are held whole (None: nothing of theirs streams, so
    their device's link carries no weight copies once loaded) and the rest of the budget goes
    to the other parts."""
    held = sum(b for (d, _), b in zip(runs, part_bytes) if d == l0)
    if weight_budget is None:
        return [None] * len(runs)
    if budgets is not None:
        if l0 in budgets and budgets[l0] < held:
            raise DeviceMapError(f"device_map: l0_device {l0} must hold its layers whole "
                                 f"({held} bytes) but its weight_budget is {budgets[l0]}",
                                 device=l0, needed=held, budget=budgets[l0])
        out = _split_budget(weight_budget, budgets, runs, part_bytes, minimums)
    elif isinstance(weight_budget, (list, tuple)):
        out = _split_budget(weight_budget, budgets, runs, part_bytes, minimums)
    else:
        total = parse_size("weight_budget", weight_budget)
        if total < held:
            raise DeviceMapError(f"device_map: l0_device {l0} must hold its layers whole "
                                 f"({held} bytes) but the whole weight_budget is {total}",
                                 device=l0, needed=held, budget=total)
        others = [(k, run, b) for k, (run, b) in enumerate(zip(runs, part_bytes)) if run[0] != l0]
        rest = _split_budget(total - held, None, [r for _, r, _ in others], [b for _, _, b in others],
                             None if minimums is None else [minimums[k] for k, _, _ in others])
        it = iter(rest)
        out = [None if d == l0 else next(it) for d, _ in runs]
    return [None if d == l0 else b for (d, _), b in zip(runs, out)]


def _split_budget(weight_budget, budgets, runs, part_bytes, minimums=None) -> list[int | None]:
    if weight_budget is None:
        return [None] * len(runs)
    if budgets is not None:
        out: list[int | None] = [None] * len(runs)
        for device, budget in budgets.items():
            mine = [k for k, (d, _) in enumerate(runs) if d == device]
            shares = _share(budget, [runs[k] for k in mine], [part_bytes[k] for k in mine],
                            None if minimums is None else [minimums[k] for k in mine],
                            f"weight_budget of {device}")
            for k, share in zip(mine, shares):
                out[k] = share
        return out
    if isinstance(weight_budget, (list, tuple)):
        if len(weight_budget) != len(runs):
            raise DeviceMapError(f"weight_budget lists {len(weight_budget)} budgets for "
                                 f"{len(runs)} parts", device=runs[0][0])
        return [None if b is None else parse_size("weight_budget", b) for b in weight_budget]
    total = parse_size("weight_budget", weight_budget)
    return _share(total, runs, part_bytes, minimums, "weight_budget")
