"""The task messages the sender publishes: one job's (``ib.generate``) or a group's
(``ib.generate_group``), with what logs and Flower may show of them: a summary, never
the prompt (unless ``flower.show_text`` is on, a debugging aid)."""

from __future__ import annotations

from typing import Any

from celery import Celery

from core.celery_app import GENERATE_GROUP_TASK, GENERATE_TASK, GROUP_HEADER, message_priority
from core.jobs import GenerationJob, Selection
from core.settings import Priorities

Pair = tuple[GenerationJob, Selection]


class Publisher:
    def __init__(self, app: Celery, priorities: Priorities, show_text: bool = False) -> None:
        self.app = app
        self.priorities = priorities
        self.show_text = show_text

    def unit(self, unit_id: str, unit: list[Pair], producer: Any, declare: list[Any] | None = None) -> None:
        """One send unit's message (dispatcher.grouping): its one job's, or its group's."""
        if len(unit) == 1:
            self.job(*unit[0], producer, declare=declare)
        else:
            self.group(unit_id, unit, producer)

    def group(self, group_id: str, unit: list[Pair], producer: Any) -> None:
        """Publish one message for jobs of one queue and priority (dispatcher.grouping).
        Its header lists their ids: the worker's broker bookkeeping counts and records
        each job (core.celery_app.GROUP_HEADER) without parsing the body."""
        job, sel = unit[0]
        self.app.send_task(
            GENERATE_GROUP_TASK,
            args=[[j.model_dump(mode="json"), s.model_dump(mode="json")] for j, s in unit],
            task_id=group_id,
            queue=sel.queue,
            priority=self._priority(job),
            ignore_result=True,
            argsrepr=f"{len(unit)} jobs: model={job.model} backend={sel.backend}",
            kwargsrepr="{}",
            headers={GROUP_HEADER: [j.id for j, _ in unit]},
            producer=producer,
            declare=[],
        )

    def job(self, job: GenerationJob, sel: Selection, producer: Any = None, declare: list[Any] | None = None) -> None:
        """Publish the job's message. ``declare=[]`` skips kombu's per-publish queue
        declaration, which the Redis transport never needs: Celery publishes to the
        default exchange, which kombu's virtual transport delivers straight to the list
        named by the routing key (no binding read), and LPUSH creates the list. kombu still
        binds a copy of the queue to the channel and wraps the declare in its retry policy on
        every publish, its cache notwithstanding (~0.1 ms of the submit). RabbitMQ must
        declare (an undeclared queue drops the message): None keeps Celery's default."""
        self.app.send_task(
            GENERATE_TASK,
            args=[job.model_dump(mode="json"), sel.model_dump(mode="json")],
            task_id=job.id,
            queue=sel.queue,
            priority=self._priority(job),
            ignore_result=True,  # the outcome lives in the job record (core.store.jobstore)
            argsrepr=self._summary(job, sel),
            kwargsrepr="{}",
            producer=producer,
            declare=declare,
        )

    def _priority(self, job: GenerationJob) -> int:
        return message_priority(self.app, self.priorities.level(job.priority.value))

    def _summary(self, job: GenerationJob, sel: Selection) -> str:
        """What logs and Flower show of a job's arguments (argsrepr)."""
        summary = f"model={job.model} backend={sel.backend} max_tokens={job.sampling.max_tokens}"
        if job.batch_id:
            summary += f" batch={job.batch_id} custom_id={job.custom_id}"
        if self.show_text:  # flower.show_text: a debugging aid, off by default
            text = job.prompt if job.prompt is not None else " | ".join(m.content for m in job.messages or [])
            if job.prompt_ids is not None:
                text = f"<{len(job.prompt_ids)} token ids>"
            summary += f" prompt={text[:200]!r}"
        return summary
