"""``deepseek-flash <verb>``: one entry point, one module per verb.

Each verb lives in the module named in ``COMMANDS``; the module provides ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when their verb is
used, so ``deepseek-flash status`` never pays for importing torch.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys

from .errors import FlashError

COMMANDS: dict[str, str] = {
    # verb: module (relative to deepseek_flash)
    "pack": ".store.cli_pack",
    "verify": ".store.cli_verify",
    "inspect": ".store.cli_inspect",
    "repair": ".store.cli_repair",
    "status": ".ops.status",
    "stats": ".ops.stats",
    "models": ".ops.models",
    "load": ".ops.load",
    "unload": ".ops.unload",
    "set": ".ops.set_tunable",
    "install-units": ".ops.install_units",
    "health": ".tools.cli_health",
    "defrag": ".tools.cli_defrag",
    "prune": ".tools.cli_prune",
    "bench": ".flash_benchmark",
    "profile": ".tools.cli_profile",
    "demo": ".demo",
    "serve": ".serve.cli",
}


def bounded(kind=int, minimum=0, *, exclusive=False, what="", noun=None):
    """An argparse ``type=`` that parses ``kind`` and refuses values below ``minimum`` (or at
    it, with ``exclusive``), e.g. ``bounded(float, 0, exclusive=True, what=" seconds")``."""
    noun = noun or ("an integer" if kind is int else "a number")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            op = ">" if exclusive else ">="
            raise argparse.ArgumentTypeError(f"must be {op} {minimum}{what}, got {text}")
        return value
    return parse


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepseek-flash",
                                     description="Tiered LLM weight store and streaming daemon.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for verb, module_name in COMMANDS.items():
        if only is not None and verb != only:
            # Keep --help listing every verb without importing every module.
            sub.add_parser(verb, add_help=False)
            continue
        module = importlib.import_module(module_name, __package__)
        p = sub.add_parser(verb, help=module.HELP, description=getattr(module, "DESCRIPTION", module.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=verb if verb in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except FlashError as exc:
        print(f"deepseek-flash {args.verb}: error: {exc} [{type(exc).__name__}, code {exc.code}]",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def tool_main(verb: str, prog: str):
    """Entry point of an operator alias (``deepseek-flash-repair`` ...) that runs one verb."""
    def entry(argv: list[str] | None = None) -> int:
        argv = sys.argv[1:] if argv is None else argv
        return main([verb, *argv])
    entry.__name__ = prog
    return entry


repair_main = tool_main("repair", "deepseek-flash-repair")
health_main = tool_main("health", "ssd-health-checker")
defrag_main = tool_main("defrag", "deepseek-flash-defrag")
profiler_main = tool_main("profile", "flash-profiler")
prune_main = tool_main("prune", "deepseek-flash-prune")

if __name__ == "__main__":
    sys.exit(main())
