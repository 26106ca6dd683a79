"""``inspect``: what a store holds -- blocks, their place in the file, per-layer and total sizes."""
from __future__ import annotations

from .reader import Store


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shape_summary(block) -> str:
    """Shapes of the block's tensors, ``;``-separated (``4096x4096;1024x4096``)."""
    return ";".join("x".join(map(str, t.shape)) or "scalar" for t in block.tensors)


def quantization_label(quant: dict | None) -> str:
    if not quant:
        return "none"
    g = f" g{quant['group_size']}" if quant["granularity"] == "per_block" else ""
    return f"{quant['scheme']} {quant['granularity']}{g}"


def describe(store: Store) -> dict:
    """A JSON-ready description of ``store`` (what ``inspect --json`` prints)."""
    layers: dict[int, int] = {}
    for b in store.blocks:
        layers[b.layer] = layers.get(b.layer, 0) + b.length
    return {
        "path": str(store.path),
        "name": store.name,
        "model": store.model,
        "num_layers": store.num_layers,
        "block_count": len(store.blocks),
        "total_bytes": store.total_bytes,
        "quantization": store.quant,
        "per_layer_bytes": {str(k): v for k, v in sorted(layers.items())},
        "blocks": [{
            "id": b.id, "layer": b.layer, "role": b.role, "file": b.file, "offset": b.offset,
            "length": b.length, "crc32c": b.crc32c, "hot": b.hot, "deps": b.deps,
            "access_freq": b.access_freq, "precision_req": b.precision_req, "quant": b.quant,
            "dtypes": sorted({t.dtype for t in b.tensors}), "shape": shape_summary(b),
            "tensors": [t.to_dict() for t in b.tensors],
        } for b in store.blocks],
    }


def format_table(store: Store) -> str:
    rows = [("id", "layer", "role", "dtype", "shapes", "size", "offset")]
    for b in store.blocks:
        rows.append((str(b.id), str(b.layer) if b.layer >= 0 else "-", b.role,
                     ",".join(sorted({t.dtype for t in b.tensors})), shape_summary(b),
                     human(b.length), str(b.offset)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in (2, 3, 4) else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    layers: dict[int, int] = {}
    for b in store.blocks:
        layers[b.layer] = layers.get(b.layer, 0) + b.length
    lines.append("")
    for layer, size in sorted(layers.items()):
        lines.append(f"{'outside layers' if layer < 0 else f'layer {layer}'}: {human(size)}")
    lines.append(f"quantization: {quantization_label(store.quant)}")
    arch = store.model.get("architecture", "?")
    lines.append(f"total: {len(store.blocks)} blocks, {store.num_layers} layers, "
                 f"{human(store.total_bytes)} ({store.total_bytes} bytes), {arch}")
    return "\n".join(lines)
