"""``sdp store``: the TCP store of a run on several nodes, hosted where no rank trains.

``sdp train --on-worker-loss continue --nnodes M --store HOST:PORT`` on every node connects to it
instead of to node 0's launcher, so that losing node 0 is a lost set of workers like any other
(`sdp_train.trainer.survivor_launcher.serve_store`; docs/design.md §7, "Which engine does what").
"""

from __future__ import annotations

import argparse
import sys

from sdp_train.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "store", help="host the store of a run on several nodes (sdp train --store HOST:PORT)",
        description="Host the TCP store that the launchers and ranks of `sdp train --on-worker-loss continue "
                    "--nnodes M --store HOST:PORT` share, on a host that trains nothing, and count a node lost "
                    "when its launcher's beat stops for SDP_NODE_TIMEOUT_S seconds (default 15), node 0 as any "
                    "other. It ends once every node has read the run's outcome or is lost: exit 0 when every "
                    "worker of the last membership finished, 1 otherwise.")
    p.add_argument("--nnodes", type=int, required=True, metavar="M", help="the run's nodes (sdp train --nnodes)")
    p.add_argument("--port", type=int, default=29500, metavar="PORT",
                   help="the port to listen on, on every interface (default 29500; 0: any free one, printed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sdp_train.trainer.survivor_launcher import node_timeout, serve_store

    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes} must be >= 1")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} must be a port number in [0, 65535]")
    try:
        node_timeout()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    def ready(port: int) -> None:
        print(f"sdp store: listening on port {port} for {args.nnodes} nodes (sdp train --store HOST:{port})",
              file=sys.stderr, flush=True)

    return serve_store(args.nnodes, args.port, ready=ready)
