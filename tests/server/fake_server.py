"""TEST DOUBLE launcher: ``python -m tests.server.fake_server [launch_server flags]`` serves the
real HTTP layer over :class:`tests.server.fake_engine.FakeEngine`.

Only for developing the live-server tests without the model (``STB_SERVER_TEST_ENGINE=fake``);
the shipped path is ``python -m sglang_tpu_backend.launch_server``.
"""

from __future__ import annotations

import argparse

from sglang_tpu_backend.launch_server import serve
from sglang_tpu_backend.server_args import ServerArgs
from tests.server.fake_engine import FakeEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args())
    serve(args, engine=FakeEngine(args, step_delay=0.002))


if __name__ == "__main__":
    main()
