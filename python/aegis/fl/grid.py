"""Flower's transport in this process: a Grid that hands each message to a ClientApp here (no Ray, no SuperLink).

* :class:`InProcessGrid` hands each message to a ClientApp in this process; it is also the
  honest-but-curious server's wire (every reply is kept), which :func:`aegis.fl.run_rounds` reads.
* :class:`SerialisingGrid` also passes every message and reply through Flower's protobuf serde, as a
  transport does (secure rounds need it: ``secaggplus_mod`` edits the record the workflow shares
  between nodes, so without a copy every client after the first fails).
* :func:`flower_runtime` stands in for Flower's ServerApp runtime: it sets the task identity that
  instruction Messages read. It is the one place that touches a Flower internal (``flwr.supercore``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.serverapp import Grid

from .client import CLIENT_APP_RAISED_EXCEPTION, server_round_of

SUPERLINK_NODE_ID = 1  # Flower's node id for the server side (flwr.common.constant, not public API)
FIRST_NODE_ID = 1000  # in-process SuperNodes get ids 1000, 1001, ...


@contextlib.contextmanager
def flower_runtime(run_id: int = 0) -> Iterator[None]:
    """Give this process the task identity that Flower's ServerApp runtime sets before running a ServerApp.

    Instruction Messages (``Message(content, dst_node_id, message_type)``) read it. An in-process run
    stands in for that runtime, so it sets the identity itself, as Flower's own legacy ``start_grid``
    does with a dummy one. The setter lives in ``flwr.supercore`` (not public API): this is the only
    internal import of ``aegis.fl``, kept here.
    """
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@dataclass(frozen=True)
class Delivery:
    """One reply as the server received it, with the round and node it answered."""

    server_round: int
    node_id: int
    reply: Message


class InProcessGrid(Grid):
    """A Grid that hands each message to a ClientApp in this process, one after another (no Ray, no SuperLink).

    It is also the honest-but-curious server's wire: every reply lands in ``deliveries``. A node whose app
    raises answers with an error reply, as Flower's runtime does; ``absent(node_id, message) -> True``
    makes a node drop the message (a client that never answers).
    """

    def __init__(
        self,
        apps: Mapping[int, Callable[[Message, Context], Message]],
        contexts: Mapping[int, Context],
        *,
        absent: Callable[[int, Message], bool] | None = None,
    ) -> None:
        self.apps, self.contexts, self.absent = dict(apps), dict(contexts), absent
        self.deliveries: list[Delivery] = []
        self._pending: dict[str, Delivery] = {}
        self._sent = 0
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.apps)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.apps:
                raise ValueError(f"InProcessGrid: no node {node} (nodes: {sorted(self.apps)})")
            self._sent += 1
            ids.append(str(self._sent))
            if self.absent is not None and self.absent(node, msg):
                continue
            try:
                reply = self.apps[node](msg, self.contexts[node])
            except Exception as err:  # a crashing client must not take the round down
                error = Error(code=CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}")
                reply = Message(error, reply_to=msg)
            self._pending[ids[-1]] = Delivery(server_round_of(msg.content), node, reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        delivered = [self._pending.pop(i) for i in message_ids if i in self._pending]
        self.deliveries.extend(delivered)
        return [d.reply for d in delivered]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


class SerialisingGrid(InProcessGrid):
    """An :class:`InProcessGrid` that serialises every message and reply (Flower's protobuf serde).

    ``wire`` keeps the serialised replies as the server received them: (node, stage, bytes), the stage as
    ``stage_of(reply)`` names it (:func:`aegis.fl.secure.guard.reply_stage` for SecAgg+; default: "error" or
    ""); ``instruction_bytes`` counts the serialised messages it sent."""

    def __init__(self, *args, stage_of: Callable[[Message], str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stage_of = stage_of or (lambda reply: "error" if reply.has_error() else "")
        self.wire: list[tuple[int, str, bytes]] = []
        self.instruction_bytes = 0
        self.set_run(SimpleNamespace(run_id=0))  # the legacy client manager reads grid.run.run_id only

    def push_messages(self, messages):
        sent = []
        for msg in messages:
            proto = message_to_proto(msg)
            self.instruction_bytes += proto.ByteSize()
            sent.append(message_from_proto(proto))
        return super().push_messages(sent)

    def pull_messages(self, message_ids):
        replies = []
        for reply in super().pull_messages(message_ids):
            data = message_to_proto(reply).SerializeToString()
            self.wire.append((reply.metadata.src_node_id, self.stage_of(reply), data))
            replies.append(_round_trip(reply))
        return replies


def _round_trip(msg: Message) -> Message:
    return message_from_proto(message_to_proto(msg))


@contextlib.contextmanager
def flower_log_level(level: int | None) -> Iterator[None]:
    """Set the ``flwr`` logger's level for the block (None: leave it)."""
    logger = logging.getLogger("flwr")
    saved = logger.level
    if level is not None:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(saved)
