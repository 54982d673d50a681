"""`plait serve --dp N`: N `plait serve` replicas on loopback ports behind the router, or
`plait serve --replica URL ...`: the router alone, in front of servers that already run.
`--prefill-replicas K` (or `--prefill-replica URL ...`) disaggregates prefill and decode: K of
the replicas prefill prompts and push their KV to the others, which decode."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

from plait.server.launch import ServerProcess
from plait.server.routing import POLICIES, RouterConfig

_SERVER_FLAGS = (
    "api_key",
    "max_queue",
    "served_model_name",
    "accept_any_model",
    "closed_finish_reason",
    "log_level",
)


_ROUTER_HELP = {
    "cache_threshold": "follow the cache when a replica holds this share of the prompt (0-1)",
    "balance_abs_threshold": "loads are imbalanced when the busiest replica has this many more "
    "requests than the idlest ...",
    "balance_rel_threshold": "... and this many times as many (>= 1); then the idlest one is "
    "chosen",
    "max_tree_chars": "prompt characters remembered per replica (least recently used are "
    "forgotten)",
    "health_interval": "seconds between /health probes of each replica",
    "prefill_min_chars": "with prefill replicas: prompts shorter than this many characters are "
    "prefilled by their decode replica itself (0: every prompt goes to a prefill replica)",
}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallelism")
    group.add_argument(
        "--dp",
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="engine replicas on loopback ports behind a cache-aware router (>= 1)",
    )
    group.add_argument(
        "--replica",
        dest="replicas",
        action="append",
        default=[],
        metavar="URL",
        help="route to a running plait server instead (repeatable; no local engine; default: none)",
    )
    group.add_argument(
        "--prefill-replicas",
        dest="prefill_replicas",
        type=int,
        default=0,
        help="of the --dp replicas, this many run --role prefill and push the KV "
        "of the prompts they prefill to the others (--role decode), which "
        "decode: prefill-decode disaggregation (0: off)",
    )
    group.add_argument(
        "--prefill-replica",
        dest="prefill_urls",
        action="append",
        default=[],
        metavar="URL",
        help="with --replica: a running `plait serve --role "
        "prefill` that prefills for them (repeatable; default: none)",
    )
    group.add_argument(
        "--router-policy",
        dest="router_policy",
        default="cache_aware",
        choices=POLICIES,
        help="how the router picks a replica",
    )
    defaults = RouterConfig()
    for name, help in _ROUTER_HELP.items():
        default = getattr(defaults, name)
        group.add_argument(
            "--router-" + name.replace("_", "-"),
            dest="router_" + name,
            type=type(default),
            default=default,
            metavar=name.upper(),
            help=help,
        )
    if hasattr(parser, "config_checks"):
        parser.config_checks.append(check_router_args)


def check_router_args(args: argparse.Namespace) -> None:
    if args.dp_size < 1:
        raise ValueError(f"dp_size: must be at least 1, got {args.dp_size}")
    if args.prefill_replicas and not 0 < args.prefill_replicas < args.dp_size:
        raise ValueError(
            f"prefill_replicas: must leave a decode replica, in [1, {args.dp_size - 1}] with "
            f"--dp {args.dp_size}, got {args.prefill_replicas}"
        )
    if args.prefill_urls and not args.replicas:
        raise ValueError("prefill_urls: a prefill replica needs --replica URLs to decode for")
    routed = args.dp_size > 1 or args.replicas
    if routed and getattr(args, "role", "both") != "both":
        raise ValueError("role: one server's; behind the router use --prefill-replicas")
    try:
        router_config(args)
    except ValueError as e:  # RouterConfig names its field; the flag is --router-<field>
        raise ValueError(f"router_{e}") from None


def router_config(args: argparse.Namespace) -> RouterConfig:
    values = {
        f.name: getattr(args, "router_" + f.name)
        for f in dataclasses.fields(RouterConfig)
        if hasattr(args, "router_" + f.name)
    }
    return RouterConfig(**values)


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The `plait serve` flags of one replica: every engine and server flag but host/port/dp."""
    from plait.runtime.config_flags import engine_kwargs

    argv: list[str] = []
    for name, value in sorted(engine_kwargs(args).items()):
        flag = "--model" if name == "model_path" else "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    for spec in args.programs:
        argv += ["--programs", spec]
    for name in _SERVER_FLAGS:
        value = getattr(args, name, None)
        if value is True:
            argv.append("--" + name.replace("_", "-"))
        elif value is not None and value is not False:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def start_replicas(
    argv: list[str], dp_size: int, timeout: float = 600.0, roles: list[str] | None = None
) -> list[ServerProcess]:
    """Starts `dp_size` servers at once (the i-th with `--role roles[i]` when given) and waits
    until all are healthy (or stops them all)."""
    threads = max(1, (os.cpu_count() or 1) // dp_size)
    env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(threads)}
    procs: list[ServerProcess] = []
    try:
        for i in range(dp_size):
            role = ["--role", roles[i]] if roles else []
            procs.append(ServerProcess(argv + role, timeout=timeout, env=env, wait=False))
        for p in procs:
            p.wait_healthy()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def serve_router(args: argparse.Namespace) -> int:
    import uvicorn

    from plait.server.limits import KEEP_ALIVE_SECONDS, UVICORN_HTTP
    from plait.server.router_app import create_router_app
    from plait.server.routing import Router

    log = logging.getLogger("plait.router")
    config = router_config(args)
    procs: list[ServerProcess] = []
    if args.replicas:
        router = Router.for_urls(args.replicas, config, args.prefill_urls)
    else:
        log.info("starting %d replicas", args.dp_size)
        prefill = args.prefill_replicas
        roles = ["decode"] * (args.dp_size - prefill) + ["prefill"] * prefill if prefill else None
        procs = start_replicas(replica_argv(args), args.dp_size, roles=roles)
        urls = [p.url for p in procs]
        split = args.dp_size - prefill
        router = Router.for_urls(urls[:split], config, urls[split:])
        for replica, proc in zip(router.replicas, procs):
            replica.process = proc
    log.info(
        "routing (%s) to %s",
        config.policy,
        ", ".join(f"{r.url} ({r.role})" for r in router.replicas),
    )
    app: Any = create_router_app(router, api_key=args.api_key)
    # NOTE: uvicorn re-raises the SIGTERM it caught once it has shut down; turning it into
    # SystemExit lets the `finally` below stop the replicas instead of orphaning them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            http=UVICORN_HTTP,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
    finally:
        app.state.router.close()
        for p in procs:
            p.stop()
    return 0
