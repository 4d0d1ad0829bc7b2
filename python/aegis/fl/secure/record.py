"""What each side of a secure app saw, written under ``$AEGIS_FL_RECORD_DIR`` (a diagnostic for tests).

Each process reads the variable from its own environment; unset (the default), nothing is written.

* :class:`ServerRecord` (ServerApp process): ``setup.json`` (the SecAgg+ parameters and whether the
  cipher masks are installed); per round and stage ``round{r}-{stage}.json`` (the nodes that answered
  and those that failed), written as the replies arrive; ``round{r}-masked-node{id}.npy`` (a node's
  masked vector as the server received it, before unmasking) and ``round{r}-sum.npz`` (the unmasked
  sum over the survivors, in the trainable parameters' order).
* :class:`ClientRecord` (ClientApp process): ``client-node{id}-round{r}.npz``, the node's own update
  before quantisation and masking. It never leaves the client's machine, and is a copy of its
  private update: set the variable only on test machines.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
from flwr.app import Message
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.serverapp import Grid
from torch import Tensor

RECORD_ENV = "AEGIS_FL_RECORD_DIR"


def _directory() -> Path | None:
    value = os.environ.get(RECORD_ENV)
    if not value:
        return None
    path = Path(value)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _dump(value, f) -> None:
    f.write(json.dumps(value).encode())


def _savez(arrays: Mapping[str, np.ndarray], f) -> None:
    np.savez(f, **cast(dict[str, Any], arrays))


def _write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary name, so a reader polling for ``path`` never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


class ServerRecord:
    """The server's view of a secure run (see the module docstring)."""

    def __init__(self, directory: Path, names: Sequence[str]) -> None:
        self.directory, self.names = directory, list(names)

    @classmethod
    def from_env(cls, names: Sequence[str], **setup) -> ServerRecord | None:
        directory = _directory()
        if directory is None:
            return None
        record = cls(directory, names)
        _write(directory / "setup.json", partial(_dump, {**setup, "names": list(names)}))
        return record

    def replies(self, server_round: int, stage: str, sent: Sequence[int], replies: Iterable[Message]) -> None:
        nodes: dict[str, list[int]] = {"ok": [], "failed": []}
        for reply in replies:
            node = reply.metadata.src_node_id
            nodes["failed" if reply.has_error() else "ok"].append(node)
            if stage == Stage.COLLECT_MASKED_VECTORS and not reply.has_error():
                arrays = cast(list[bytes], reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS])
                masked = np.concatenate([bytes_to_ndarray(b).ravel() for b in arrays])
                _write(self.directory / f"round{server_round}-masked-node{node}.npy", partial(np.save, arr=masked))
        nodes["missing"] = sorted(set(sent) - set(nodes["ok"]) - set(nodes["failed"]))
        _write(self.directory / f"round{server_round}-{stage}.json", partial(_dump, nodes))

    def round_sum(self, server_round: int, mean: Sequence[np.ndarray], survivors: int) -> None:
        sums = {n: np.asarray(m, dtype=np.float64) * survivors for n, m in zip(self.names, mean)}
        _write(self.directory / f"round{server_round}-sum.npz", partial(_savez, sums))


class ClientRecord:
    """A node's own updates (see the module docstring); each round written once."""

    def __init__(self, directory: Path, node_id: int) -> None:
        self.directory, self.node_id = directory, node_id
        self.written: set[int] = set()

    @classmethod
    def from_env(cls, node_id: int) -> ClientRecord | None:
        directory = _directory()
        return None if directory is None else cls(directory, node_id)

    def updates(self, updates: Mapping[int, list[Tensor]]) -> None:
        for server_round in sorted(set(updates) - self.written):
            arrays = [u.double().numpy() for u in updates[server_round]]
            path = self.directory / f"client-node{self.node_id}-round{server_round}.npz"
            _write(path, partial(_savez, {f"arr_{i}": a for i, a in enumerate(arrays)}))
            self.written.add(server_round)


def _stage_of(message: Message):
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if configs is None else configs.get(Key.STAGE)


class RecordingGrid(Grid):
    """A Grid that passes everything to ``grid`` and shows each batch of replies to a :class:`ServerRecord`."""

    def __init__(self, grid: Grid, record: ServerRecord) -> None:
        self.grid, self.record = grid, record

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        # SecAgg+ sends each stage as one batch, grouped by its round, with the stage in its record
        rounds = {m.metadata.group_id for m in messages}
        stages = {str(_stage_of(m)) for m in messages}
        if len(rounds) == 1 and len(stages) == 1 and next(iter(rounds)).isdigit():
            sent = [m.metadata.dst_node_id for m in messages]
            self.record.replies(int(next(iter(rounds))), next(iter(stages)), sent, replies)
        return replies
