"""The Prometheus port: ``GET /metrics`` and nothing else (every other path is 404), on its own listener."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import ServerSettings
from ..metrics import Metrics
from ..ports import host_port
from .site import start_site

METRICS_MAX_CONNECTIONS = 64  # a scraper or two, and a person with curl
METRICS_IDLE_TIMEOUT_S = 30.0


async def start_metrics(settings: ServerSettings, exposition: Callable[[], Awaitable[bytes]], own_statistics=None):
    """The Prometheus port, its /metrics the text ``exposition()`` makes: (its runner, "host:port"), or (None,
    "off"). A worker of --workers also answers ``GET /statistics`` there, its own model_stats
    (``own_statistics()``), for the other workers to add up."""
    if settings.metrics_port < 0:
        return None, "off"
    runner, port = await start_site(
        metrics_application(exposition, own_statistics),
        settings.metrics_host,
        settings.metrics_port,
        max_connections=METRICS_MAX_CONNECTIONS,
        idle_timeout_s=METRICS_IDLE_TIMEOUT_S,
        what="metrics",
    )
    return runner, host_port(settings.metrics_host, port)


def exposition_of(metrics: Metrics) -> Callable[[], Awaitable[bytes]]:
    """One process's metrics in Prometheus' text format."""

    async def exposition() -> bytes:
        return generate_latest(metrics.registry)

    return exposition


def metrics_application(exposition: Callable[[], Awaitable[bytes]], own_statistics=None) -> web.Application:
    async def scrape(request: web.Request) -> web.Response:
        return web.Response(body=await exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def elsewhere(request: web.Request) -> web.Response:
        # A client sent here by mistake (the inference API is another port) is told where to go.
        error = (
            f"{request.path}: this is the metrics port, which serves /metrics only; the HTTP/REST API is on --http-port"
        )
        return web.json_response({"error": error}, status=404)

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    if own_statistics is not None:  # a worker's port, on loopback: the parent and the other workers read it

        async def statistics(request: web.Request) -> web.Response:
            return web.json_response({"model_stats": own_statistics()})

        app.router.add_get("/statistics", statistics)
    app.router.add_route("*", "/{anything:.*}", elsewhere)
    return app
