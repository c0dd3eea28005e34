"""A cluster under a seeded random schedule of faults, with invariants checked: ``python bench/nemesis.py``.

It starts a throwaway PostgreSQL (``initdb``, as the tests do), ``--servers``
``llmgw server`` on it, ``--agents`` agents running sim engines on
``$LLMGW_DEV_NET`` addresses, a gateway and ``--clients`` clients (half
streaming), then for ``--duration`` seconds applies faults drawn from
``--seed`` (kinds: ``--faults``, comma-separated, ``all`` by default): kill -9
and SIGSTOP/SIGCONT of servers, agents, engines, the gateway and PostgreSQL,
several at once, certificate revocations, catalog applies (args, scale, a
model removed with ``--prune``), drains, a node's seed folder emptied. It
checks the invariants of :mod:`llmgw.testing.nemesis_checks` every few
seconds and at the end, and prints the faults by kind, the invariants
checked and every violation with the seed and the time line that reproduce
it. Exit status 1 when an invariant was violated. See
:mod:`llmgw.testing.nemesis_run`.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from llmgw.dev.signals import Stopped, stop_on_signals
from llmgw.testing.nemesis import parse_kinds
from llmgw.testing.nemesis_run import Options, run
from llmgw.testing.postgres import find_postgres_bin


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the nemesis, print its report; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seed", type=int, default=None, help="the schedule's seed (default: a random one, printed)"
    )
    parser.add_argument("--duration", type=float, default=600, help="seconds of faults (default 600)")
    parser.add_argument("--servers", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--faults", default="all", help="fault kinds, comma-separated (default all)")
    parser.add_argument("--rate", type=float, default=0.2, help="faults per second on average (default 0.2)")
    parser.add_argument("--settle", type=float, default=120, help="seconds after the last fault to converge")
    parser.add_argument(
        "--root", type=Path, default=None, help="where the run's files go (default: a new temp dir)"
    )
    parser.add_argument(
        "--one-by-one",
        action="store_true",
        help="start the servers one after the other (by default together: two may take the first lease)",
    )
    args = parser.parse_args(argv)
    try:
        kinds = parse_kinds(args.faults)
    except ValueError as exc:
        parser.error(str(exc))
    if args.agents < 4:
        parser.error("--agents: at least 4 (the catalog places a two-node model beside four replicas)")
    bindir = find_postgres_bin()
    if bindir is None:
        print("PostgreSQL is not installed (apt-get install postgresql)", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    options = Options(seed=seed, duration=args.duration, servers=args.servers, agents=args.agents,
                      clients=args.clients, kinds=kinds, rate=args.rate, settle=args.settle,
                      together=not args.one_by_one)  # fmt: skip
    root = args.root or Path(tempfile.mkdtemp(prefix="llmgw-nemesis-"))
    try:
        with stop_on_signals():  # SIGTERM, SIGINT, SIGHUP: the run's finally stops its cluster and database
            report = run(root, options, bindir, say=lambda line: print(line, flush=True))
    except Stopped as stopped:
        print(f"nemesis: {stopped}: stopped before the end; its cluster and database are stopped", flush=True)
        return 128 + stopped.signum
    print(report.text(), flush=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
