"""KV transfer between serving processes with JAX's transfer server (``jax.experimental.transfer``).

The prefill server *offers* a handed-over slot (``swap.SwappedSlot``: KV pages of every layer,
slot rows) under a random id with ``TransferServer.await_pull``; the decode server connects to
the prefill server's transfer address once and *pulls* the arrays straight onto its own
placement (``TransferConnection.pull``: asynchronous, the arrays are ready when their bytes
are). The ids, shapes and dtypes travel in the gRPC control message
(``disaggregation.proto``). Both sides must hold the same slot layout (same model, page size,
``max_seq_len``, KV dtype and tp): the decode side checks the specs before pulling.
"""

from __future__ import annotations

import secrets
import threading

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import Sharding, SingleDeviceSharding

ArraySpecs = list[tuple[tuple[int, ...], str]]  # (shape, dtype name) per leaf, pytree order


def specs_of(tree) -> ArraySpecs:
    return [(tuple(a.shape), np.dtype(a.dtype).name) for a in jax.tree.leaves(tree)]


class KvTransfer:
    """This process's transfer server: offers slots to peers and pulls theirs."""

    def __init__(self, host: str = "127.0.0.1"):
        client = jax.devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.address: str = self.server.address()
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, saved) -> tuple[int, ArraySpecs]:
        """Make ``saved``'s arrays pullable once; their id and specs for the control message."""
        uuid = secrets.randbits(63)
        self.server.await_pull(uuid, jax.tree.leaves(saved))
        return uuid, specs_of(saved)

    def pull(self, address: str, uuid: int, specs: ArraySpecs, template, shardings):
        """The arrays ``address`` offered under ``uuid``, as a pytree shaped like ``template``
        and placed with ``shardings`` (a matching pytree, or one device). ValueError if
        ``specs`` do not match the template (a peer with another model or layout)."""
        want = specs_of(template)
        if [(tuple(s), d) for s, d in specs] != want:
            raise ValueError(
                f"the handed-over arrays {specs[:3]}... do not match this engine's slot layout "
                f"{want[:3]}... (model, page_size, max_seq_len, kv_cache_dtype and tp must agree)"
            )
        leaves, tree = jax.tree.flatten(template)
        placed = jax.tree.leaves(shardings) if not isinstance(shardings, jax.Device) else None
        if placed is None:
            placed = [SingleDeviceSharding(shardings)] * len(leaves)
        assert all(isinstance(s, Sharding) for s in placed) and len(placed) == len(leaves)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(leaves, placed)]
        arrays = self._connection(address).pull(uuid, avals)
        return jax.tree.unflatten(tree, arrays)

    def withdraw(self, uuid: int, saved) -> None:
        """Take back an offer no peer pulled (jax 0.10.2 has no call for it: this process pulls
        its own offer and drops the copy, so the transfer server lets go of the arrays).
        Blocks until done; if a peer did pull the offer after all, blocks forever: call it
        from a thread of its own."""
        avals = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
            for a in jax.tree.leaves(saved)
        ]
        jax.block_until_ready(self._connection(self.address).pull(uuid, avals))

    def _connection(self, address: str):
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self.server.connect(address)
            return conn
