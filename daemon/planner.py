"""Residency planning: under a weight budget, which blocks stay on the device and which stream.

Anchors stay: embeddings, norms, the head and every layer's attention (small, and needed every
token). The MLP matrices (gate+up and down, about two thirds of a Llama layer) are what streams:
each streamed layer's MLP passes through a ring of *slots*. ``stream_unit`` sets what a slot holds
(``wire.stream_units``): one layer's whole MLP, or one projection of it (gate, up or down) -- a
slot a third of the size, so the ring takes a third of the budget and the rest keeps more MLPs
resident (fewer bytes stream per token).
Whatever budget is left after the anchors and the ring keeps whole layers' MLPs resident, the
*last* layers first, so the ring serves a contiguous head of the model: between two tokens the
host samples and starts the next pass, issuing no copy until the first streamed unit has run --
with the streamed layers first that is the embeddings and one layer before it, and the resident
layers at the end run while the copies queued at the end of the pass are on the link. Those
copies must last the whole stretch (``prefetch.PASS_GAP_S``, measured) or the link idles once a
token. Where the ring is too small for that (small units: ``stream_unit: projection`` at 8 GiB
on a Mistral-7B shape holds three 117 MB slots, 6.4 ms of copies) the same number of resident
MLPs is spread among the streamed layers instead, the first and the last layer streaming: the
stretch between two tokens then holds no resident layer, and each resident layer runs between
two streamed units while the ring's copies are on the link. Same bytes resident, same bytes
streamed, same slots: only which layers.

Pure function of block sizes: the daemon publishes the plan it computes (``deepseek-flash models``
and ``models/<name>/plan`` in the status tree) and the client executes it.
"""
from __future__ import annotations

from ..errors import BudgetTooSmall
from ..fsutil import align_up
from ..prefetch import AUTO, MAX_AUTO_WINDOW, NOMINAL_LINK_BYTES_PER_S, PASS_GAP_S, auto_window
from ..wire import (DEFAULT_STREAM_UNIT, MIN_SLOTS, SLOT_ALIGNMENT, STREAM_ROLES, Plan,
                    stream_units, unit_bytes)


def _aligned(n: int) -> int:
    return align_up(n, SLOT_ALIGNMENT)


def _split(blocks, unit: str = DEFAULT_STREAM_UNIT):
    """(anchor blocks, {layer: MLP blocks}, anchor bytes, slot bytes): a slot holds the largest
    streaming unit (``wire.stream_units``)."""
    mlp: dict[int, list] = {}
    anchors = []
    for b in blocks:
        if b.role in STREAM_ROLES and b.layer >= 0:
            mlp.setdefault(b.layer, []).append(b)
        else:
            anchors.append(b)
    anchor_bytes = sum(_aligned(b.length) for b in anchors)
    # A slot holds one unit's ranges back to back, each at an aligned offset.
    slot = max((unit_bytes(u) for group in mlp.values() for u in stream_units(group, unit)),
               default=0)
    return anchors, mlp, anchor_bytes, slot


def spread(layers: list[int], keep: int) -> list[int]:
    """``keep`` of ``layers`` (ascending) to stay resident, spread among the others: the ones
    that stream are evenly spaced and include the first and the last (``len(layers) - keep`` of
    them, at least two; fewer: the last ``keep``, as a suffix)."""
    n = len(layers)
    streamed = n - keep
    if streamed < 2:
        return layers[n - keep:] if keep else []
    at = {round(j * (n - 1) / (streamed - 1)) for j in range(streamed)}
    return [layer for i, layer in enumerate(layers) if i not in at]


def resident_minimum(blocks, unit: str = DEFAULT_STREAM_UNIT) -> int:
    """The smallest weight budget that can run the model: anchors plus two streaming slots."""
    _, _, anchor_bytes, slot = _split(blocks, unit)
    return anchor_bytes + MIN_SLOTS * slot


def plan_residency(blocks, budget: int | None, prefetch_window, model: str = "model",
                   link_bytes_per_s: float | None = None, unit: str = DEFAULT_STREAM_UNIT) -> Plan:
    """The plan for ``blocks`` (BlockInfo list) under ``budget`` bytes (None: all resident).

    ``prefetch_window`` sets the ring: ``prefetch_window + 1`` slots (at least two), fewer only
    when the budget cannot hold them; ``"auto"`` resolves it from the slot size and the link
    (``prefetch.auto_window``; ``link_bytes_per_s`` None: a nominal link). The plan's ``window``
    is where the client's window starts: an explicit one as asked (at most the slots), ``"auto"``
    the whole ring (``n_slots`` copies ahead: a slot is refilled as soon as its unit has run,
    so between two tokens, while the host samples and runs the resident layers up to the first
    streamed one, every slot's copy is on the link); with ``"auto"`` the budget left over after
    the resident MLPs (less than one more of them) becomes more slots, at most
    ``MAX_AUTO_WINDOW + 1`` in all and never more than the streamed units. Raises
    ``BudgetTooSmall`` naming the sizes when the budget cannot hold the anchors plus two slots.
    ``unit``: what a slot holds (``wire.STREAM_UNITS``); the plan's ``slot_bytes`` is its
    largest unit.

    The resident MLPs are the last layers' (the streamed layers a contiguous head), unless the
    ring's copies last less than ``PASS_GAP_S`` at the link's rate (``link_bytes_per_s``, else
    nominal): then as many resident MLPs are spread among the streamed layers (``spread``), so
    that no resident layer runs between two tokens, where the host issues no copy.
    """
    total = sum(_aligned(b.length) for b in blocks)
    if budget is None or budget >= total:
        return Plan(budget=budget or total, resident=[b.id for b in blocks], streamed_layers=[],
                    resident_bytes=total)
    anchors, mlp, anchor_bytes, slot = _split(blocks, unit)
    minimum = anchor_bytes + MIN_SLOTS * slot
    if budget < minimum:
        raise BudgetTooSmall(
            f"model {model}: weight budget {budget} bytes is below the resident minimum: anchors "
            f"(embeddings, norms, attention, head) {anchor_bytes} bytes + {MIN_SLOTS} streaming "
            f"slots of {slot} bytes (stream_unit {unit}) = {minimum} bytes", model=model,
            budget=budget, anchors=anchor_bytes, slot_bytes=slot, minimum=minimum)
    auto = prefetch_window == AUTO
    if auto:
        prefetch_window = auto_window(slot, link_bytes_per_s)
    wanted_slots = max(MIN_SLOTS, prefetch_window + 1)
    n_slots = max(MIN_SLOTS, min(wanted_slots, (budget - anchor_bytes) // slot))
    left = budget - anchor_bytes - n_slots * slot
    resident = [b.id for b in anchors]
    by_id = {b.id: b for b in blocks}
    streamed = []
    stream_blocks = {}
    for layer in sorted(mlp, reverse=True):
        size = sum(_aligned(b.length) for b in mlp[layer])
        if size <= left and not streamed:
            # Keep a suffix of layers resident: the ring then serves a contiguous head.
            resident += [b.id for b in mlp[layer]]
            left -= size
        else:
            streamed.append(layer)
            stream_blocks[layer] = [b.id for b in mlp[layer]]
    streamed.reverse()
    # The budget is below the total, so at least n_slots + 1 layers stream (n_slots < streamed).
    if auto:
        # What is left (less than one more resident MLP) is more slots: copies queued further
        # ahead for free (between two tokens the host issues none). Never more than the units.
        units = sum(len(stream_units([by_id[b] for b in stream_blocks[layer]], unit))
                    for layer in streamed)
        n_slots += max(0, min(left // slot, MAX_AUTO_WINDOW + 1 - n_slots, units - n_slots))
    kept = sorted(set(mlp) - set(streamed))
    link = link_bytes_per_s or NOMINAL_LINK_BYTES_PER_S
    if kept and n_slots * slot < PASS_GAP_S * link:
        # The ring cannot cover the stretch between two tokens: keep no resident MLP there.
        moved = spread(sorted(mlp), len(kept))
        room = sum(_aligned(b.length) for layer in kept for b in mlp[layer])
        if sum(_aligned(b.length) for layer in moved for b in mlp[layer]) <= room:
            resident = [b.id for b in anchors] + [b.id for layer in moved for b in mlp[layer]]
            streamed = [layer for layer in sorted(mlp) if layer not in set(moved)]
            stream_blocks = {layer: [b.id for b in mlp[layer]] for layer in streamed}
    resident_set = set(resident)
    resident = [b.id for b in blocks if b.id in resident_set]
    return Plan(budget=budget, resident=resident, streamed_layers=streamed,
                stream_blocks=stream_blocks, slot_bytes=slot, n_slots=n_slots,
                resident_bytes=sum(_aligned(b.length) for b in blocks if b.id in resident_set),
                window=n_slots if auto else min(prefetch_window, n_slots), unit=unit)
