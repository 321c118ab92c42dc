"""``python -m mirage info`` | ``python -m mirage demo``."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mirage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="build, torch, GPU and registered ops")
    demo = sub.add_parser("demo", help="swap mirage modules into a small model; error and timing")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args(argv)

    import mirage

    if args.command == "info":
        print(mirage.info())
    else:
        from mirage.demo import run_demo

        run_demo(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
