"""``dspark-core serve``: check everything, load, start HTTP, then warm up and calibrate before ready.

With ``--nnodes`` > 1 every rank runs this command; see docs/multi-rank.md.

The HTTP server comes up as soon as the models are loaded, so ``/health``
answers while warmup and calibration run; ``/ready`` (and generation) stay
503 until the cost table is installed on the engine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark_core.audit import configure_logging, get_logger
from dspark_core.config import add_serve_arguments, config_from_args

NAME = "serve"
HELP = "Serve a target model with a DSpark draft over an OpenAI-compatible HTTP API."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_serve_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from dspark_core.calibration.install import bring_up
    from dspark_core.server.app import build_app
    from dspark_core.server.http import bind_http_socket, serve_http
    from dspark_core.server.service import AsyncEngineService
    from dspark_core.startup import build_engine, resolve_launch
    from dspark_core.validate import check_config

    configure_logging()
    log = get_logger("serve")
    config = config_from_args(args)
    name = config.served_model_name or Path(str(config.model)).name

    check_config(config)  # flag errors first (resolve_launch checks them again, cheaply)
    # rank 0 holds its HTTP port before anything is loaded: a port in use fails here, at once
    sock = bind_http_socket(config.host, config.port) if config.node_rank == 0 else None
    port = sock.getsockname()[1] if sock is not None else config.port  # --port=0: the one the system chose

    def serve(engine, startup_work) -> int:
        service = AsyncEngineService(engine, max_pending=config.max_pending_requests)
        app = build_app(service, model_name=name, log_requests=config.log_requests)
        startup = service.prepare(lambda e: startup_work())
        startup.add_done_callback(lambda f: log.info("serving", model=name, host=config.host, port=port)
                                  if f.exception() is None else None)
        serve_http(app, config.host, port, sock=sock)
        return 0

    try:
        if config.nnodes > 1:
            from dspark_core.distributed.launch import serve_distributed

            # every rank runs this command; rank 0 serves HTTP, the others replay its steps
            return serve_distributed(config, lambda handle: serve(handle.engine, lambda: handle.bring_up(progress=True)))
        launch = resolve_launch(config)  # every rule and input file checked before any work
        engine = build_engine(launch)
        return serve(engine, lambda: bring_up(engine, launch))
    finally:
        if sock is not None:
            sock.close()
