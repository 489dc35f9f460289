"""`python -m kvserve.compiled build | clean | status` (what `make compile` runs)."""

from __future__ import annotations

import argparse
import sys

from kvserve.compiled import COMPILED_MODULES, why_not_compiled
from kvserve.compiled.build import build, clean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.compiled",
                                     description="The optional compiled core (mypyc) of kvserve.")
    parser.add_argument("action", choices=("build", "clean", "status"),
                        help="build: type-check and compile in place; clean: remove it; status: say which is used")
    args = parser.parse_args(argv)
    if args.action == "build":
        build()
        print(f"kvserve: compiled {len(COMPILED_MODULES)} modules in place; new processes use them "
              f"({why_not_compiled() or 'checked'})")
    elif args.action == "clean":
        for path in clean():
            print(f"removed {path}")
    else:
        reason = why_not_compiled()
        print("compiled (mypyc)" if reason is None else f"pure Python: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
