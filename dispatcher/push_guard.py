"""Guarded pushes: a message pushed only if a script's own checks pass, in its push.

The submitting side's channel takes a *push guard* per message (``guard_push``): a Lua
script run in place of the message's LPUSH, which pushes only if its checks pass, all of
them in one pipeline (``push_held``) whose replies come back. The sender claims a job's
record and checks its decision's premise (the fleet it decided on is unchanged) that
way, in the push itself instead of round trips before it (dispatcher.sender). Installed
over the fleet's transport (core.transport) when the submitting side's parts are made
(dispatcher.parts); a channel without it (another broker, kombu's own ``rediss://``)
makes the sender claim first and publish after.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from celery import Celery
from kombu.transport import redis as kombu_redis

from core.transport import Channel, Transport, install


class PushGuard(NamedTuple):
    """A script that pushes the message (ARGV[1]) onto the queue's list (KEYS[1]) only if
    its own checks on the rest of its keys and arguments pass; its reply says which."""

    script: str
    keys: list[str]
    args: list[Any]


class PushGuardMixin:
    """Holds a guarded message's push (its guard's script in place of LPUSH) until
    ``push_held`` runs them all in one pipeline and returns their replies, which kombu's
    own publish path would drop."""

    _guards: dict[str, PushGuard] | None = None
    _held: list[tuple[str, tuple[Any, ...]]] | None = None
    _expires: dict[str, int]

    def guard_push(self, task_id: str, guard: PushGuard) -> None:
        """Guard the next message published with this task id (one thread per channel:
        kombu's producer pool hands a channel to one thread at a time)."""
        if self._guards is None:
            self._guards = {}
        self._guards[task_id] = guard

    def push_held(self) -> list[tuple[str, Any]]:
        """Run the held pushes, in order, in one round trip: (task id, its script's reply,
        an exception object where the script failed) for each. A connection error raises: which
        pushes ran is then unknown (a guard that claims the id makes a resend safe)."""
        held, self._held = self._held or [], None
        if not held:
            return []
        with self.conn_or_acquire() as client:  # type: ignore[attr-defined]
            pipe = client.pipeline(transaction=False)
            for _, command in held:
                pipe.eval(*command)
            replies = pipe.execute(raise_on_error=False)
        return [(task_id, reply) for (task_id, _), reply in zip(held, replies)]

    def drop_guards(self, task_ids: list[str]) -> list[str]:
        """Forget these ids' guards and held pushes (a send that failed before pushing);
        returns the ids whose guard was never used: published without it."""
        guards = self._guards or {}
        if self._held:
            self._held = [h for h in self._held if h[0] not in set(task_ids)]
        return [task_id for task_id in task_ids if guards.pop(task_id, None) is not None]

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        task_id = message.get("headers", {}).get("id")
        guard = self._guards.pop(task_id, None) if self._guards else None
        if guard is None:
            return super()._put(queue, message, **kwargs)  # type: ignore[misc]
        if self._expires and queue in self._expires:  # kombu's queue expiry: the fleet sets none
            raise ValueError(f"queue {queue} expires: a guarded push is not supported there")
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))  # type: ignore[attr-defined]
        if self._held is None:
            self._held = []
        self._held.append(
            (task_id, (guard.script, 1 + len(guard.keys), key, *guard.keys, kombu_redis.dumps(message), *guard.args))
        )
        return None


class GuardedChannel(PushGuardMixin, Channel):
    pass


class GuardedTransport(Transport):
    Channel = GuardedChannel


def install_guarded(app: Celery) -> bool:
    """Make this process's ``redis://`` connections guard pushes (the submitting side, at
    start); returns whether ``app``'s broker does (False: another broker, or kombu's own
    transport for ``rediss://``)."""
    install(GuardedTransport)
    with app.connection_for_write() as conn:  # the transport's class: no connection made
        return hasattr(getattr(conn.transport, "Channel", None), "guard_push")
