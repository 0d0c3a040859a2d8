"""python -m benchmarks <name> [args] runs one benchmark; --list lists them; <name> --help shows its options."""

import importlib
import sys

from benchmarks import benchmarks, summary

USAGE = "usage: python -m benchmarks <name> [args] | --list   (python -m benchmarks <name> --help: its options)"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    found = benchmarks()
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print(USAGE)
        width = max(map(len, found))
        for name, module in found.items():
            print(f"  {name:<{width}}  {summary(module)}")
        return
    if argv[0] not in found:
        print(f"unknown benchmark {argv[0]!r}: one of {', '.join(found)} (python -m benchmarks --list)",
              file=sys.stderr)
        sys.exit(2)
    importlib.import_module(found[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
