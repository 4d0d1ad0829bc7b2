"""Flower without Ray or a SuperLink: :func:`simulate` runs :mod:`~aegis.fl.server_app` with ``n`` copies of
:mod:`~aegis.fl.client_app` in this process over the grid of :mod:`aegis.fl.grid`, what ``flwr run`` does with a
simulation federation, minus the transport.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, RecordDict

from .grid import FIRST_NODE_ID, SUPERLINK_NODE_ID, InProcessGrid, SerialisingGrid, flower_log_level, flower_runtime

_RUN_IDS = itertools.count(1)  # simulate()'s runs in this process


def simulate(num_supernodes: int = 2, run_config: Mapping[str, Any] | None = None, *,
             node_config: Mapping[str, Any] | None = None, quiet: bool = True) -> tuple[Context, InProcessGrid]:
    """Run ``server_app`` with ``num_supernodes`` copies of ``client_app`` in this process (no Ray).

    What ``flwr run`` does with a simulation federation, minus the transport. The clients are simulated
    (:func:`aegis.fl.node.simulated`): each counts its exposures for this call only, unless the run config
    sets ``aegis-exposure-counts = "across-runs"`` (then the machine's state file counts, as a real client's
    does), and replies without a reply floor.

    run_config:   the server's keys (:data:`aegis.fl.task.DEFAULT_RUN_CONFIG`, the secure keys, ``aegis-*``);
                  ``min-nodes`` defaults to ``num_supernodes``.
    node_config:  keys added to every node's own config, the node's choices, never the server's:
                  ``aegis-preset`` (the preset the node runs at least; the run config may only tighten it),
                  ``aegis-min-survivors`` and ``aegis-peers`` (secure rounds), ``aegis-max-runs``,
                  ``aegis-reply-floor`` (:mod:`aegis.fl.node`). Each node also gets ``partition-id`` and
                  ``num-partitions``.
    quiet:        silence Flower's INFO logging.

    Returns the server's Context (``state["evaluation"]`` holds the validation curve) and the grid (every
    delivered reply). Raises ``RuntimeError`` when no client reply was accepted in any round.
    """
    from .client_app import app as client_app
    from .node import in_process_simulation
    from .secure.app import is_secure
    from .secure.guard import reply_stage
    from .server_app import app as server_app
    from .task import DEFAULT_RUN_CONFIG

    config = {**DEFAULT_RUN_CONFIG, "min-nodes": num_supernodes, **(run_config or {})}
    run_id = next(_RUN_IDS)  # a run of its own: the nodes keep nothing of an earlier call
    nodes = [FIRST_NODE_ID + i for i in range(num_supernodes)]
    contexts = {
        node: Context(
            run_id=run_id, node_id=node, node_config={"partition-id": i, "num-partitions": num_supernodes,
                                                 **(node_config or {})},
            state=RecordDict(), run_config=config,
        )
        for i, node in enumerate(nodes)
    }
    # secaggplus_mod edits the record the workflow shares between nodes: a secure run needs serialising
    apps = {node: client_app for node in nodes}
    grid = SerialisingGrid(apps, contexts, stage_of=reply_stage) if is_secure(config) else InProcessGrid(apps, contexts)
    server_context = Context(run_id=run_id, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(),
                             run_config=config)
    with flower_runtime(run_id), flower_log_level(logging.ERROR if quiet else None), in_process_simulation():
        server_app(grid, server_context)
    return server_context, grid
