"""Serve the engine over HTTP (SGLang native + OpenAI routes).

    python -m sglang_tpu_backend.launch_server [--model-path DIR] [--host 127.0.0.1] [--port 30000] ...

Flags are SGLang's (see ``ServerArgs.add_cli_args``); without ``--model-path`` the embedded
tiny model is served. Prints ``The server is fired up and ready to roll! URL: http://...``
once the port accepts connections; binding a non-loopback ``--host`` with neither ``--api-key``
nor ``--admin-api-key`` logs a loud warning first (``entrypoints/auth.py``). With ``--nnodes N`` run it once per node (the same flags,
``--node-rank 0..N-1``, ``--dist-init-addr`` of node 0); only node 0 serves HTTP.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from sglang_tpu_backend.entrypoints.auth import exposure_warning
from sglang_tpu_backend.server_args import ServerArgs

log = logging.getLogger(__name__)
READY_MESSAGE = "The server is fired up and ready to roll!"


class _Server(uvicorn.Server):
    """uvicorn.Server that announces the URL once its sockets listen."""

    def __init__(self, config: uvicorn.Config, url: str):
        super().__init__(config)
        self.url = url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"{READY_MESSAGE} URL: {self.url}", flush=True)


def serve(args: ServerArgs, engine=None) -> None:
    """Build the engine (unless given), serve it until interrupted, then shut it down."""
    from sglang_tpu_backend.entrypoints.http_server import create_app

    if engine is None:
        from sglang_tpu_backend.engine import Engine

        engine = Engine(args)
    app = create_app(engine)
    if (warning := exposure_warning(args.host, args.api_key, args.admin_api_key)) is not None:
        log.warning(warning)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_keep_alive=5, access_log=args.log_level == "debug")
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        _Server(config, f"http://{host}:{args.port}").run()
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_tpu_backend.launch_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank > 0:  # a follower node: runs node 0's steps, serves no HTTP
        from sglang_tpu_backend.parallel.node import run_follower

        run_follower(args)
        return
    from sglang_tpu_backend.engine import Engine

    try:
        engine = Engine(args)
    except ValueError as e:  # a checkpoint or --dp-size/--ep-size that the host cannot serve
        parser.error(str(e))
    serve(args, engine)


if __name__ == "__main__":
    main()
