"""`kvserve ray`: start (or, with --address, join) a Ray cluster and deploy
kvserve's Ray Serve application on it: per model a deployment of kvserve
engines (`kvserve serve`'s engine and admission flags, passed to every
replica), the OpenAI ingress with the fleet's admission, kvserve's router
and autoscaling policy.

Runs until SIGINT / SIGTERM, then drains within a bound, as `kvserve serve`
does: every model replica is told the drain began (it stops admitting,
and requests in flight get --shutdown-grace seconds to finish; a stream
still running then ends as finish_reason "abort", as `kvserve serve`
ends it), the application is deleted (Ray stops routing to it and stops
its replicas once their requests ended), and a cluster started here is
shut down with all its processes; exit 0. A second signal skips what is
left of the drain.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

from kvserve.ray.flags import add_arguments  # noqa: F401 (the command's flags, for kvserve.cli)

log = logging.getLogger("kvserve.ray")

# Beyond the grace: Ray's controller notices stopped replicas on its own loop.
SHUTDOWN_MARGIN_S = 10.0
# How often the main thread looks at the signals (see StopSignals).
SIGNAL_POLL_S = 0.2
# For every replica to answer begin_drain (it returns at once; the handle may first learn the replicas).
DRAIN_NOTICE_TIMEOUT_S = 10.0


class StopSignals:
    """SIGINT / SIGTERM, counted. Waits poll: a signal the kernel hands to
    one of Ray's threads runs the Python handler only when the main thread
    next runs bytecode, so a main thread blocked in a wait without a timeout
    never saw it (kvserve ray did not stop on Ctrl-C)."""

    def __init__(self) -> None:
        self.count = 0
        self.install()

    def install(self) -> None:
        """(Again) after ray.init: Ray's core worker puts its own SIGTERM
        handler in place (it aborts the process, exit 134)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.count += 1
        log.info("%s received (%d)", signal.Signals(signum).name, self.count)

    def wait(self, count: int, done: Callable[[], bool] = lambda: False, timeout_s: float = float("inf")) -> bool:
        """Until `count` signals came or `done()`; False when timeout_s passed first."""
        deadline = time.monotonic() + timeout_s
        while self.count < count and not done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(SIGNAL_POLL_S)
        return True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import ray
        from ray import serve
    except ImportError:
        print("kvserve ray: error: Ray Serve is not installed (pip install 'kvserve[ray]')", file=sys.stderr)
        return 2
    from kvserve.ray.app import application

    try:
        app = application(args)
    except ValueError as exc:
        print(f"kvserve ray: error: {exc}", file=sys.stderr)
        return 2
    signals = StopSignals()  # before Ray starts: a Ctrl-C during a slow start is not lost
    ray.init(address=args.address, num_cpus=args.num_cpus if args.address is None else None)
    signals.install()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deploying = Call(serve.run, app, name=args.app_name, route_prefix="/")
        signals.wait(1, deploying.done)
        if deploying.done():
            deploying.result()  # raises what a failed deployment raised
            log.info("kvserve on Ray Serve: http://%s:%d (Ctrl-C to stop)", args.host, args.port)
            signals.wait(1)
        bound_s = args.shutdown_grace + SHUTDOWN_MARGIN_S
        log.info("shutting down: draining the application (at most %.0f s; a second signal stops at once)", bound_s)
        deleting = Call(drain_then_delete, args.app_name, deploying.done())
        if not signals.wait(2, deleting.done, bound_s):
            log.warning("the application did not stop within %.0f s; shutting down anyway", bound_s)
    finally:
        # A cluster started here goes with its processes; a joined one is only left.
        ray.shutdown()
    log.info("kvserve ray stopped")
    return 0


def drain_then_delete(app_name: str, deployed: bool) -> None:
    """Tell the model replicas the drain began, then delete the application.
    Ray itself never tells a replica before it kills it at the grace, which
    would cut the streams still running (an error event, not an abort)."""
    from ray import serve

    from kvserve.ray.app import MODEL_DEPLOYMENT

    if deployed:
        try:
            handle = serve.get_deployment_handle(MODEL_DEPLOYMENT, app_name)
            answers = handle.broadcast("begin_drain").results(timeout_s=DRAIN_NOTICE_TIMEOUT_S,
                                                                return_exceptions=True)
            failed = [a for a in answers if isinstance(a, Exception)]
            log.info("drain begun on %d model replicas%s", len(answers) - len(failed),
                     f" ({len(failed)} did not answer: {failed[0]!r})" if failed else "")
        except Exception as exc:  # the delete below still drains, only the streams' end is an error event
            log.warning("could not tell the replicas the drain began: %r", exc)
    serve.delete(app_name)


class Call:
    """fn(*args) on a daemon thread, so the main thread keeps watching the
    signals while Ray deploys or drains."""

    def __init__(self, fn: Callable, *args, **kwargs) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._call, args=(fn, args, kwargs), name=f"kvserve-ray-{fn.__name__}",
                                        daemon=True)
        self._thread.start()

    def _call(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as exc:  # handed to the main thread by result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> None:
        if self._error is not None:
            raise self._error
