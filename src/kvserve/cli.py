"""`kvserve` command line: one subcommand per face of the product.

Each subcommand lives beside the code it drives and exposes
`add_arguments(parser)` and `run(args) -> int`; modules are imported only
when their subcommand runs, so `kvserve plan` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvserve.server.cli", "Serve a model behind the OpenAI API with KV-aware admission."),
    "gateway": ("kvserve.gateway.cli", "Front a fleet of OpenAI-compatible servers: routing, fleet admission, "
                                       "model pools, a degradation ladder, the Batch API."),
    "ray": ("kvserve.ray.cli", "Run kvserve on Ray Serve: replicas across machines, kvserve's router and "
                               "autoscaling (queue wait, KV headroom, a warm pool), fleet admission."),
    "generate": ("kvserve.engine.cli", "Generate text for one prompt with the offline engine."),
    "bench": ("kvserve.bench.cli", "Load-test any OpenAI-compatible server against an SLO."),
    "plan": ("kvserve.plan.cli", "Capacity math: KV bytes, concurrency, queueing, replicas."),
    "simulate": ("kvserve.sim.cli", "Simulate the real scheduler on a hardware cost model."),
    "profile": ("kvserve.engine.profile", "Time real engine steps and the serving loop between them; fit a "
                                          "local cost model."),
}


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already states
    its default or there is none worth stating."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if ("default" in help_text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return help_text
        return help_text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        # Build every subparser lazily only for the one being run: `--help` on
        # the top level lists names without importing anything heavy.
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        top.parse_args(argv)  # prints usage / error and exits
        return 2
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvserve {name}", description=help_text,
                                     formatter_class=_HelpFormatter)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
