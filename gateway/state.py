"""What every request handler reaches through ``request.app.state.fleet``: the fleet's
client, an asyncio Redis client for waiting, the gateway's settings and its stores. All
state is in Redis and the file store; the process holds only connections."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio
from fastapi import Request

from core.settings import GatewaySettings
from dispatcher.client import Client
from gateway.files import FileStore
from gateway.quota import Quota


@dataclass
class Fleet:
    client: Client
    aredis: redis.asyncio.Redis
    cfg: GatewaySettings
    quota: Quota
    files: FileStore


def fleet_of(request: Request) -> Fleet:
    return request.app.state.fleet
