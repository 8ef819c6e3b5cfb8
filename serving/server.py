"""Server: the engine thread, the gRPC server, the HTTP server and metrics, wired together.

Lifecycle:
1. :meth:`Server.start` binds and starts both front ends; health is NOT_SERVING and generation
   requests get UNAVAILABLE / 503 while the model loads.
2. :meth:`Server.attach` starts the engine thread over a loaded, warm engine; health turns
   SERVING.
3. :meth:`Server.stop` (``jbatch serve`` calls it on SIGTERM / SIGINT): health NOT_SERVING, new
   requests get UNAVAILABLE / 503, in-flight ones finish for up to ``shutdown_timeout`` seconds,
   the rest are aborted, the servers close. With ``snapshot_dir`` the in-flight work is
   snapshotted at once instead and restored by the next server (``serving/resumable.py``).

:func:`serve` is the ``jbatch serve`` main; :class:`BackgroundServer` runs a server on its own
event loop in a daemon thread (tests, notebooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client as prom
import uvicorn

from jbatch.engine.interface import EngineClient
from serving.auth import ApiKeys
from serving.context import ServingContext
from serving.engine_thread import EngineThread
from serving.grpc_server import build_grpc_server, set_health
from serving.http_server import build_app
from serving.limits import RequestLimits
from serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServeConfig:
    """Network and admission settings (``jbatch serve`` flags); port 0 picks a free port."""

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    metrics_port: int | None = None  # /metrics is always on the HTTP port as well
    max_queue: int = 1024  # requests waiting for a slot before RESOURCE_EXHAUSTED / 429
    shutdown_timeout: float = 30.0  # seconds in-flight requests get on shutdown
    snapshot_dir: str | None = None  # snapshot in-flight work there on shutdown; restore on start
    resume_ttl: float = 300.0  # seconds a restored request waits for its client to resume
    model_name: str = "jbatch"
    api_keys: ApiKeys = dataclasses.field(default_factory=ApiKeys)  # its repr hides the keys
    tls_cert: str | None = None  # PEM certificate chain; with tls_key: both servers use TLS
    tls_key: str | None = None  # PEM private key
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    stream_buffer: int = 256  # outputs buffered per stream for a client that is not reading
    stream_stall_timeout: float = 30.0  # seconds a full buffer may go unread before the abort
    tool_call_parser: str = "auto"  # the chat output's tool-call format (serving/tool_parsers.py)

    def tls(self) -> tuple[bytes, bytes] | None:
        """(private key, certificate chain) PEM bytes, or None without TLS."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.tls_cert is None:
            return None
        files = {"tls_key": self.tls_key, "tls_cert": self.tls_cert}
        for name, path in files.items():
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{name} {path}: no such file")
        with open(self.tls_key, "rb") as key, open(self.tls_cert, "rb") as cert:
            return key.read(), cert.read()


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: :func:`serve` owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Server:
    """Both front ends over one engine thread; every method runs on the server's event loop."""

    def __init__(self, config: ServeConfig, metrics: ServingMetrics | None = None):
        self.config = config
        self.ctx = ServingContext(
            config.model_name, metrics, limits=config.limits, api_keys=config.api_keys,
            tool_call_parser=config.tool_call_parser,
        )  # fmt: skip
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._grpc: Any = None
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task | None = None
        self._metrics_httpd: Any = None

    @property
    def engine_thread(self) -> EngineThread | None:
        return self.ctx.engine_thread

    async def start(self) -> None:
        cfg = self.config
        if cfg.metrics_port is not None and cfg.api_keys.protect_metrics:
            raise ValueError(
                "metrics_port serves /metrics without authentication: leave it out when "
                "/metrics is protected by the API keys"
            )
        await set_health(self.ctx, False)
        tls = cfg.tls()
        self._grpc, self.grpc_port = build_grpc_server(self.ctx, cfg.host, cfg.grpc_port, tls)
        await self._grpc.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.host, cfg.http_port))
        self.http_port = sock.getsockname()[1]
        ssl = {} if tls is None else {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
        config = uvicorn.Config(
            build_app(self.ctx), log_level="warning", lifespan="off", access_log=False, **ssl
        )
        self._http = _Uvicorn(config)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        for _ in range(500):  # bounded wait for uvicorn's startup (it fails fast on errors)
            if self._http.started or self._http_task.done():
                break
            await asyncio.sleep(0.01)
        if not self._http.started:
            raise RuntimeError(f"the HTTP server did not start on {cfg.host}:{self.http_port}")
        if cfg.metrics_port is not None:
            registry = self.ctx.metrics.registry
            tls_files = {} if tls is None else {"certfile": cfg.tls_cert, "keyfile": cfg.tls_key}
            self._metrics_httpd, _ = prom.start_http_server(
                cfg.metrics_port, addr=cfg.host, registry=registry, **tls_files
            )
            self.metrics_port = self._metrics_httpd.server_port
        log.info("gRPC on %s:%s, HTTP on %s:%s", cfg.host, self.grpc_port, cfg.host, self.http_port)

    async def attach(self, engine: EngineClient) -> None:
        """Serve ``engine`` (loaded and warm); from now on only the engine thread touches it."""
        cfg = self.config
        thread = EngineThread(
            engine,
            max_queue=cfg.max_queue,
            metrics=self.ctx.metrics,
            stream_buffer=cfg.stream_buffer,
            stream_stall_timeout=cfg.stream_stall_timeout,
            snapshot_dir=cfg.snapshot_dir,
            resume_ttl=cfg.resume_ttl,
        )
        thread.start()
        self.ctx.engine_thread = thread
        await set_health(self.ctx, True)

    async def stop(self, timeout: float | None = None) -> None:
        """Graceful shutdown; see the module docstring."""
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        thread = self.ctx.engine_thread
        if thread is not None:
            thread.begin_drain()  # first: once health says NOT_SERVING, nothing is admitted
        await set_health(self.ctx, False)
        if thread is not None:
            await asyncio.to_thread(thread.shutdown, timeout)
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            await self._http_task
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()


class BackgroundServer:
    """A :class:`Server` on its own event loop in a daemon thread."""

    def __init__(self, engine: EngineClient, config: ServeConfig):
        self.server = Server(config)
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        self.run(self.server.start(), timeout)
        self.run(self.server.attach(self._engine), timeout)
        return self

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self.run(self.server.stop(timeout), timeout + 60.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)


async def _serve(load: Callable[[], EngineClient], config: ServeConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = Server(config)
    await server.start()
    print(
        f"[jbatch] gRPC on {config.host}:{server.grpc_port}, HTTP on "
        f"{config.host}:{server.http_port}"
        + (f", metrics on {config.host}:{server.metrics_port}" if server.metrics_port else "")
        + "; loading the model...",
        file=sys.stderr,
        flush=True,
    )
    loaded: asyncio.Future = loop.create_future()

    def load_in_thread() -> None:  # a daemon thread: a SIGTERM during warm-up need not wait
        try:
            engine = load()
        except BaseException as e:
            loop.call_soon_threadsafe(loaded.set_exception, e)
        else:
            loop.call_soon_threadsafe(loaded.set_result, engine)

    threading.Thread(target=load_in_thread, name="jbatch-load", daemon=True).start()
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loaded, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loaded.done() and loaded.exception() is not None:
        await server.stop(0)
        stopping.cancel()
        raise loaded.exception()
    if loaded.done() and not stop.is_set():
        await server.attach(loaded.result())
        print("[jbatch] ready (health: SERVING)", file=sys.stderr, flush=True)
        await stopping
    print("[jbatch] shutting down...", file=sys.stderr, flush=True)
    await server.stop()
    print("[jbatch] stopped", file=sys.stderr, flush=True)
    return 0


def serve(load: Callable[[], EngineClient], config: ServeConfig) -> int:
    """Run until SIGTERM / SIGINT, then shut down gracefully; returns the exit status (0)."""
    return asyncio.run(_serve(load, config))
