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
        import torch

        from mirage.demo import run_demo

        if args.device is not None:
            try:
                device = torch.device(args.device)
            except RuntimeError as error:
                parser.error(f"--device {args.device!r} is not a torch device: {error}")
            if device.type not in ("cpu", "cuda"):
                parser.error(f"--device {args.device}: the demo runs on cuda or cpu")
            if device.type == "cuda" and not torch.cuda.is_available():
                parser.error(f"--device {args.device}: no CUDA GPU is available to this torch "
                             f"({torch.__version__}); run the demo on the CPU (--device cpu, the default here)")
        run_demo(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
