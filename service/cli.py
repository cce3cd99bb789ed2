"""The ``ckpt`` command.

Each subcommand imports what it needs when it runs, so the command works in a training
image (no FastAPI) and in a control-plane image (no torch) alike.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from service import __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckpt`` command line; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="ckpt", description="Bit-exact checkpoints for PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"ckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "demo",
        add_help=False,
        help="train, kill, resume in a new process, and check the result is bit-exact",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        try:
            from agent.demo.run import main as demo
        except ImportError as err:
            parser.exit(
                2, f"ckpt demo needs the training extra: pip install 'ckpt[agent]' ({err})\n"
            )
        return demo(rest)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
