"""Cancel announcements: a worker's subscription to the fleet's cancel channel.

Every cancel sets its flag and publishes the flagged id on ``ib:cancels`` in one
transaction (JobStore.request_cancel). A worker's cancel watcher blocks on this
subscription instead of waking on a timer to ask Redis whether anything changed: an idle
subscription costs neither the worker nor Redis anything, and a cancel reaches the
watcher in one round trip instead of up to a polling interval later.

Pub/sub keeps nothing for a subscriber that is not connected, so an announcement made
while the subscription was down is lost; the watcher covers that by reading its flags
every few seconds whatever it hears (workers.running.cancel_watch). redis-py subscribes again by
itself when it reconnects.
"""

from __future__ import annotations

import redis

from core.store import keys


class CancelAnnouncements:
    def __init__(self, client: redis.Redis) -> None:
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._subscribed = False

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a cancel: True when one was announced
        (every announcement waiting is consumed: one read of the flags answers them all).
        False may also come early (a subscription confirmation). Raises when Redis cannot
        be reached."""
        if not self._subscribed:
            self._pubsub.subscribe(keys.CANCELS)  # lazily: a worker may start while Redis is down
            self._subscribed = True
        if self._pubsub.get_message(timeout=timeout) is None:
            return False
        while self._pubsub.get_message(timeout=0.0) is not None:
            pass
        return True

    def close(self) -> None:
        self._pubsub.close()
