"""`splitserve` command line: one subcommand per job, each defined next to the code it drives.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; this file
only dispatches, so adding a subcommand never touches another one's code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "generate": ("splitserve.entrypoints.generate", "generate text offline with the engine, streamed"),
    "serve": ("splitserve.entrypoints.launch", "start the OpenAI-compatible server and its engines"),
    "engine": ("splitserve.engine.process", "start one engine instance by hand (--role, --connect)"),
    "trial": ("splitserve.trial.cli", "replay a workload against arrangements and count good requests"),
    "workload": ("splitserve.trial.analyze", "analyze a request trace: lengths, long-input share, burstiness"),
    "profile": ("splitserve.control.profile", "time one engine instance: prefill, decode, KV transfer, startup"),
    "admin": ("splitserve.entrypoints.admin_cli", "operate a running server: restart its instances one at a time"),
    "plan": ("splitserve.control.plan_cli", "predict every arrangement on a workload from a profile; recommend one"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, allow_abbrev=False)
        # Only the chosen subcommand's module is imported: `splitserve trial` must not pay
        # for importing torch, and one broken module must not take the others down.
        if argv and argv[0] == name:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
