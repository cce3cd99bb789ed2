"""The ``ckpt`` command.

Each subcommand imports what it needs when it runs, so the command works in a training
image (no FastAPI) and in a control-plane image (no torch) alike.

    ckpt demo                      train, kill, resume, compare (needs the agent extra)
    ckpt launch -- COMMAND...      run a trainer, restart it after a preemption or a crash
    ckpt server | migrate | gc     run the control plane, upgrade its schema, collect garbage
    ckpt token create|list|revoke  manage the bearer tokens in the catalog
    ckpt catalog rebuild           recreate the catalog from the manifests in the store
    ckpt verify RUN                check every blob of a bundle in the store
    ckpt runs | attempts | resumable | bundle
                                   ask a running control plane (CKPT_SERVER, CKPT_TOKEN)

One module per job: ``server`` (server, migrate, gc, catalog), ``tokens``, ``verify``,
``ask`` (the REST queries); ``config`` and ``text`` are what they share; ``failure`` says
in a line or two what to fix when a command fails (the traceback with ``--debug``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ckpt.cli import ask, failure, server, tokens, verify
from ckpt.cli.config import Handler
from ckpt.core.version import __version__, install_hint

# The demo and the launcher parse their own arguments (their own --help).
PASSTHROUGH = {
    "demo": "train, kill, resume in a new process, and check the result is bit-exact",
    "launch": "run a training command; restart it after a preemption or a crash",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``ckpt`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description="Bit-exact checkpoints for PyTorch training.",
        epilog="Run 'ckpt COMMAND --help' for what a command does, reads and prints.",
    )
    parser.add_argument("--version", action="version", version=f"ckpt {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback of an error too ({failure.DEBUG_VARIABLE}=1 does the same)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in PASSTHROUGH.items():
        commands.add_parser(name, add_help=False, help=summary)
    server.add_commands(commands)
    tokens.add_commands(commands)
    server.add_catalog_commands(commands)
    verify.add_commands(commands)
    ask.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckpt`` command line; returns the exit code."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    command = f"ckpt {args.command}"
    if args.command in PASSTHROUGH:
        return failure.run(
            command, lambda: _passthrough(parser, args.command, rest), debug=args.debug
        )
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler: Handler = args.handler
    try:
        return failure.run(command, lambda: handler(args), debug=args.debug)
    except ImportError as err:
        parser.exit(2, f"{command} needs the server extra: {install_hint('server')} ({err})\n")


def _passthrough(parser: argparse.ArgumentParser, command: str, rest: list[str]) -> int:
    if command == "launch":
        from agent.launch.supervisor import main as launch

        return launch(rest)
    try:
        from agent.demo.run import main as demo
    except ImportError as err:
        parser.exit(2, f"ckpt demo needs the training extra: {install_hint('agent')} ({err})\n")
    return demo(rest)


if __name__ == "__main__":
    sys.exit(main())
