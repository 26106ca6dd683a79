"""``deepseek-flash models``: the models the daemon has open, from /run/deepseek_flash/models/."""
from __future__ import annotations

import json
import sys

from ..sysfs_shim.publisher import format_fields, parse
from .common import add_location_arguments, require_live_tree, runtime_dir, with_daemon

HELP = "list the daemon's models, or show one (info, residency, --blocks)"
DESCRIPTION = """Without NAME: one line per open model (name, state, resident/total blocks, bytes in the
host tier / served in total / on GPUs, quantization scheme, granularity, group size and where the
weights were quantized: pack, or host_tier for an unquantized store quantized as it is loaded).
With NAME: models/NAME/info and models/NAME/residency, and with --blocks every block's line.
Without a status tree the daemon is asked over the control socket."""

# total_bytes: the model's payloads as served (on disk, or after quantizing on entry); disk_bytes:
# the payloads read from disk; resident_bytes: in the host tier; gpu_bytes: in GPU arenas
# (resident loads, not streaming slots).
COLUMNS = ("name", "state", "blocks", "resident_blocks", "resident_bytes", "total_bytes", "disk_bytes",
           "gpu_bytes", "quantization_scheme", "quantization_granularity", "quantization_group_size",
           "quantized_at")


def add_arguments(parser):
    add_location_arguments(parser)
    parser.add_argument("name", nargs="?", help="one model to show in full")
    parser.add_argument("--blocks", action="store_true", help="also print every block (with NAME)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    models_dir = runtime_dir(args) / "models"
    if not models_dir.is_dir():
        return with_daemon(args, lambda client: _show(args, _from_daemon(client.list_models())))
    refused = require_live_tree(args)
    if refused is not None:
        return refused
    models = {}
    for entry in sorted(models_dir.iterdir()):
        info = entry / "info"
        if info.is_file():
            models[entry.name] = {"info": parse(info.read_text()),
                                  "residency": parse((entry / "residency").read_text()),
                                  "blocks": (entry / "blocks").read_text()}
    return _show(args, models)


def _from_daemon(listing) -> dict:
    return {m["name"]: {"info": {k: v for k, v in m.items() if k != "residency"}, "residency": {},
                        "blocks": ""} for m in listing}


def _show(args, models: dict) -> int:
    if args.name is not None:
        if args.name not in models:
            known = ", ".join(models) or "none"
            print(f"deepseek-flash models: no model {args.name!r} is open (open: {known})", file=sys.stderr)
            return 1
        model = models[args.name]
        if args.json:
            print(json.dumps({"info": model["info"], "residency": model["residency"]}, indent=2,
                             default=str))
            return 0
        sys.stdout.write(format_fields(model["info"]))
        if model["residency"]:
            print("residency:")
            sys.stdout.write("".join(f"  {line}\n" for line in format_fields(model["residency"]).splitlines()))
        if args.blocks:
            print("blocks:")
            sys.stdout.write("".join(f"  {line}\n" for line in model["blocks"].splitlines()))
        return 0
    if args.json:
        print(json.dumps({name: m["info"] for name, m in models.items()}, indent=2, default=str))
        return 0
    if not models:
        print("no models open")
        return 0
    rows = [[str(m["info"].get(col, "-")) for col in COLUMNS] for m in models.values()]
    widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(COLUMNS)]
    print("  ".join(col.upper().ljust(w) for col, w in zip(COLUMNS, widths)).rstrip())
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
