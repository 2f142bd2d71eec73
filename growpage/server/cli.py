"""``growpage serve``: the engine behind an OpenAI-compatible HTTP server (uvicorn).

The address is taken before the model loads: the command binds and listens on every address
``--host`` names, so a port in use or a host that does not resolve ends it at once with
``cannot listen on HOST:PORT (reason)``; connections that come while the model loads wait.

SIGTERM (or Ctrl-C) drains: new requests get a 503 and the listening socket closes, requests
in flight run on for up to ``--shutdown-timeout`` seconds, those still running are then aborted
(their streams end with finish reason ``abort``), and the command exits with status 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from growpage._argtypes import positive_int
from growpage.engine.cli_flags import add_engine_flags, engine_settings
from growpage.errors import GrowPageError

if TYPE_CHECKING:
    from fastapi import FastAPI

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install 'growpage[serve]'"
MAX_PORT = 65535
SHUTDOWN_BACKSTOP_S = 5.0  # after the shutdown timeout, how long uvicorn waits for the streams
#: Engine settings ``serve`` has no flag for, and why.
NO_FLAG = dict.fromkeys(
    ("record_traces", "record_layers", "record_values"), "traces are recorded by growpage record"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    s = subparsers.add_parser(
        "serve",
        help="serve the engine over HTTP with the OpenAI API (completions, chat, streaming), "
        "plus /health and Prometheus /metrics",
    )
    s.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the name clients pass as 'model' (default: SmolLM2-135M-Instruct, or the model "
        "file's or directory's name)",
    )
    s.add_argument(
        "--policy",
        default="growpage",
        help="policy name, 'module:Class' or 'file.py:Class' (default growpage)",
    )
    s.add_argument(
        "--param",
        dest="policy_arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy hyperparameter, e.g. budget_tokens=512 (repeatable; read as the "
        "simulator's --param)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument(
        "--port",
        type=port_number,
        default=8000,
        help="port to listen on, 0 to 65535 (0: one the system picks; default 8000)",
    )
    s.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="most requests queued for admission; one more gets HTTP 429 (default 256)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may run on before they are aborted "
        "(default 30)",
    )
    s.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=512,
        help="max_tokens of a chat request that gives none (completions: 16, as OpenAI's; "
        "default 512)",
    )
    s.add_argument(
        "--page-size", type=positive_int, default=64, help="tokens per KV page (default 64)"
    )
    s.add_argument(
        "--recent-window",
        type=int,
        default=None,
        help="protected recent tokens (default 16, or page size / 4 for pages of 16 or fewer)",
    )
    s.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: torch's)",
    )
    add_engine_flags(s, NO_FLAG)
    s.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="info",
        help="uvicorn's log level (default info: one line per request)",
    )
    s.set_defaults(func=run_serve)


def port_number(text: str) -> int:
    """A TCP port, 0 to ``MAX_PORT`` (argparse reports anything else naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(
            f"expected a port number from 0 to {MAX_PORT}, got {text!r}"
        )
    return value


def _require_serve_extras() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as exc:
        raise GrowPageError(
            f"growpage serve needs {exc.name}, which is not installed: run `{INSTALL_HINT}`"
        ) from None


def served_model_name(model: str | None, given: str | None) -> str:
    if given:
        return given
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def build_llm(args: argparse.Namespace) -> Any:
    """The ``LLM`` the flags describe."""
    from growpage.engine.llm import LLM
    from growpage.policies.registry import parse_policy_params

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    window = {} if args.recent_window is None else {"recent_window": args.recent_window}
    return LLM(
        args.model,
        policy=args.policy,
        policy_kwargs=parse_policy_params(args.policy_arg, "--param"),
        page_size=args.page_size,
        **window,
        **engine_settings(args, NO_FLAG),
    )


def run_serve(args: argparse.Namespace) -> int:
    _require_serve_extras()
    from growpage.server.app import ServerConfig, create_app

    config = ServerConfig(
        model_name=served_model_name(args.model, args.served_model_name),
        max_waiting=args.max_waiting,
        default_max_tokens=args.default_max_tokens,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    sockets = listen(args.host, args.port)
    try:
        app = create_app(build_llm(args), config)
        serve_app(app, sockets, args.log_level)
    finally:
        for sock in sockets:
            sock.close()
    return 0


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names, bound as asyncio's ``create_server``
    binds them (``SO_REUSEADDR``; IPv6 sockets IPv6 only); ``GrowPageError`` ``cannot listen on
    HOST:PORT (reason)`` when one cannot be, with none left open."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen()
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name IDNA cannot encode
        for sock in sockets:
            sock.close()
        reason = getattr(exc, "strerror", None) or str(exc)
        raise GrowPageError(f"cannot listen on {where} ({reason})") from None
    return sockets


def serve_app(app: FastAPI, sockets: list[socket.socket], log_level: str = "info") -> None:
    """Run ``app`` under uvicorn on ``sockets`` (``listen``'s) until SIGTERM or SIGINT, then
    drain (module docstring)."""
    import uvicorn

    from growpage.server.app import begin_draining

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn says where it runs only on sockets it bound itself
                for sock in sockets or []:
                    logging.getLogger("uvicorn.error").info(
                        "Uvicorn running on %s (Press CTRL+C to quit)", _url(sock)
                    )

        def handle_exit(self, sig: int, frame: Any) -> None:
            begin_draining(app)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        log_level=log_level,
        # The engine aborts what still runs at the shutdown timeout, and the streams end;
        # uvicorn's own timeout (it cancels the handlers) is a backstop behind it.
        timeout_graceful_shutdown=app.state.config.shutdown_timeout_s + SHUTDOWN_BACKSTOP_S,
        lifespan="on",
    )
    # NOTE: uvicorn raises the signal it caught again once it has shut down, under the handler
    # it found installed; this one ignores it, so a drained server exits with status 0.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        DrainingServer(config).run(sockets)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"
