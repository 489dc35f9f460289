"""kvserve's Ray Serve application, for `kvserve ray`, `serve run` and a
Ray Serve config file:

    serve run kvserve.ray_app:build_app model=/models/smol.gguf max_replicas=4
    serve deploy deploy/ray/kvserve.yaml

`build_app(args)` takes the `kvserve ray` flags as a dict (names with
underscores or dashes, values as strings or their types; a true flag is
`true`), so the command line, `serve run` and a YAML file configure the
same application: an `Ingress` (the OpenAI API and fleet admission) bound
to a model deployment of `ModelReplica`s, with kvserve's router as its
request router and, unless `num_replicas` is fixed, kvserve's autoscaling
policy.
"""

from __future__ import annotations

import argparse

from kvserve.ray.app import MODEL_DEPLOYMENT, application

__all__ = ["MODEL_DEPLOYMENT", "build_app", "parse_app_args"]


def build_app(args: dict):
    """The application from `kvserve ray` flags given as a dict."""
    return application(parse_app_args(args))


def parse_app_args(args: dict) -> argparse.Namespace:
    from kvserve.ray.flags import add_arguments

    argv: list[str] = []
    for key, value in (args or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is False or str(value).lower() == "false" or value is None:
            continue
        else:
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="kvserve.ray_app:build_app", exit_on_error=False)
    add_arguments(parser)
    try:
        return parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"bad application args {args!r}: {exc}") from None
