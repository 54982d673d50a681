"""`plait serve`: the engine behind the HTTP server. `plait.cli` adds the parser and calls
`serve`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.runtime.config_flags import Parser
    from plait.server.state import ServerConfig


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from plait.runtime.config_flags import add_engine_args

    parser: Parser = subparsers.add_parser(
        "serve", help="serve a model over HTTP (SGLang-native and OpenAI-compatible APIs)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="the port to listen on (0-65535)")
    parser.add_argument(
        "--programs",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="serve the @program functions of a .py file or module (repeatable)",
    )
    parser.add_argument(
        "--api-key",
        dest="api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: none)",
    )
    parser.add_argument(
        "--max-queued-requests",
        "--max-queue",
        dest="max_queue",
        type=int,
        default=None,
        metavar="N",
        help="requests that may wait beyond the running batch; more get a 503 (default: no limit)",
    )
    parser.add_argument(
        "--request-timeout",
        dest="request_timeout",
        type=float,
        default=None,
        help="seconds a request may take unless it sets its own `timeout`; then a 504 "
        "(default: no limit)",
    )
    parser.add_argument(
        "--max-body-bytes",
        dest="max_body_bytes",
        type=int,
        default=16 << 20,
        help="larger request bodies get a 413 (default 16 MiB)",
    )
    parser.add_argument(
        "--served-model-name",
        dest="served_model_name",
        default=None,
        help="the model id in /v1/models and the only `model` the OpenAI routes accept "
        "(default: the model file's stem or folder's name)",
    )
    parser.add_argument(
        "--closed-finish-reason",
        dest="closed_finish_reason",
        default="length",
        choices=["length", "stop"],
        help="the finish_reason of an output budget-aware closing finished, unless a request sets "
        "its own (`stop` for clients that refuse `length`; `closed_early` is set either way)",
    )
    parser.add_argument(
        "--accept-any-model",
        dest="accept_any_model",
        action="store_true",
        help="serve OpenAI requests whatever `model` they name (by default another name is a 404)",
    )
    parser.add_argument(
        "--dashboard-show-prompts",
        dest="dashboard_show_prompts",
        action="store_true",
        help="show prompt text on /dashboard (by default only token counts)",
    )
    parser.add_argument(
        "--trace-file",
        dest="trace_file",
        default=None,
        help="record the engine's steps and requests while the server runs and write them to "
        "this file as a Chrome trace when it stops (open it in Perfetto; docs/observability.md) "
        "(default: no trace)",
    )
    parser.add_argument(
        "--role",
        default="both",
        choices=["both", "prefill", "decode"],
        help="prefill or decode: this server's half of prefill-decode disaggregation behind the "
        "router (prefill pushes the KV of prompts it prefills to a decode server); both: whole "
        "requests",
    )
    parser.add_argument(
        "--log-level",
        dest="log_level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the server's log messages",
    )
    add_engine_args(parser)
    from plait.server.data_parallel import add_router_args

    add_router_args(parser)
    parser.config_checks.append(server_config)
    parser.config_checks.append(check_role)
    parser.set_defaults(func=serve)
    return parser


def check_role(args: argparse.Namespace) -> None:
    """A prefill or decode server hands KV over through its radix cache, on one device."""
    if args.role != "both" and (args.disable_radix_cache or args.tp_size > 1):
        raise ValueError(f"role: {args.role} needs the radix cache and --tp 1")


def server_config(args: argparse.Namespace) -> ServerConfig:
    from plait.server.state import ServerConfig

    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        programs=tuple(args.programs),
        served_model_name=args.served_model_name,
        accept_any_model=args.accept_any_model,
        closed_finish_reason=args.closed_finish_reason,
        max_queue=args.max_queue,
        log_level=args.log_level,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        role=args.role,
    )


def serve(args: argparse.Namespace) -> int:
    import time

    import uvicorn

    from plait.runtime.config_flags import engine_kwargs
    from plait.runtime.engine import Engine
    from plait.runtime.tracing import EngineTrace
    from plait.server.app import create_app
    from plait.server.dashboard import DashboardConfig
    from plait.server.limits import KEEP_ALIVE_SECONDS, UVICORN_HTTP
    from plait.server.programs import load_programs

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if args.dp_size > 1 or args.replicas:
        from plait.server.data_parallel import serve_router

        return serve_router(args)
    from plait.runtime.tensor_parallel import run_worker, torchrun_rank

    if args.tp_size > 1 and torchrun_rank():  # under torchrun, ranks but 0 only run their shard
        from plait.runtime.config import EngineConfig

        run_worker(torchrun_rank(), None, EngineConfig.from_kwargs(**engine_kwargs(args)))
        return 0
    log = logging.getLogger("plait.server")
    config = server_config(args)
    registry = load_programs(config.programs) if config.programs else {}  # fail before loading
    start = time.perf_counter()
    engine = Engine(**engine_kwargs(args))
    log.info("engine ready in %.1f s: %s", time.perf_counter() - start, engine.model_path)
    trace = EngineTrace(engine.events) if args.trace_file else None
    stats = engine.stats()
    log.info(
        "execution: %s",
        ", ".join(
            f"{k.removeprefix('execution_')} {v}"
            for k, v in stats.items()
            if k.startswith("execution_")
        ),
    )
    # NOTE: uvicorn re-raises the SIGTERM it handled once it has shut down; as SystemExit it
    # reaches the `finally` below, so the engine (and any tensor-parallel ranks) stop cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        show = DashboardConfig(show_prompts=args.dashboard_show_prompts)
        app = create_app(engine, config, registry, show)
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            http=UVICORN_HTTP,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
    finally:
        if trace is not None:
            trace.close()
            log.info(
                "trace of %d events written to %s", trace.num_events, trace.write(args.trace_file)
            )
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m plait.server.cli ARGS` == `plait serve ARGS`."""
    from plait.runtime.config_flags import Parser

    root = Parser(prog="plait")
    sub = root.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = root.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
