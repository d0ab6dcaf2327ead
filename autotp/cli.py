"""Command line: ``autotp plan ...`` and ``autotp profile ...``."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    from autotp.profiling import command as profile_command

    profile_parser = sub.add_parser("profile", help="measure the interconnect and the device, write a hardware profile")
    profile_command.add_arguments(profile_parser)
    profile_parser.set_defaults(run=profile_command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
