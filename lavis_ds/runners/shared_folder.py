"""Whether every process of a job sees the same ``run.output_dir``.

Checkpoints assume one folder shared by every node (NFS, Lustre, ...): each rank writes its
shard into it and rank 0 writes the completion marker once all have. An output_dir that is
node-local on some nodes (``${oc.env:TMPDIR}/run`` on a cluster, a path that is a local disk on
one node and a mount on another) would leave each node with a part of every checkpoint and no
resumable one, found out only when resuming. Rank 0 writes a token there at start and every
rank reads it back.
"""
from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from lavis_ds.common import comm, dist
from lavis_ds.common.errors import InputError

PROBE = ".lavis_ds_shared_probe"


def not_shared_error(folder: Path) -> InputError | None:
    """Collective (every rank calls it after rank 0 created ``folder``): on rank 0, the error naming the ranks
    and hosts that do not see rank 0's files there; None when all do, and on the other ranks."""
    if dist.world_size() == 1:
        return None
    rank = dist.rank()
    token = comm.broadcast_object(secrets.token_hex(8) if rank == 0 else None)
    probe = folder / PROBE
    if rank == 0:
        probe.write_text(token)
    comm.barrier()
    try:
        sees = probe.read_text() == token
    except OSError:
        sees = False
    views = comm.all_gather_object((sees, socket.gethostname(), os.environ.get("GROUP_RANK")))
    if rank != 0:
        return None
    probe.unlink(missing_ok=True)  # every rank has read it: the all_gather came after
    blind = [(r, host, node) for r, (seen, host, node) in enumerate(views) if not seen]
    if not blind:
        return None
    who = ", ".join(f"rank {r} (host {host}" + (f", node {node})" if node is not None else ")")
                    for r, host, node in blind)
    verb = "does" if len(blind) == 1 else "do"
    return InputError(
        f"run.output_dir: {folder} is not one folder shared by every process: {who} {verb} not see the file rank 0 "
        f"(host {views[0][1]}) wrote there. Checkpoints need it: every rank writes its shard into it and rank 0 "
        "marks it complete. Give run.output_dir on a filesystem every node mounts at the same path (NFS, Lustre, "
        "...), not a node-local one such as $TMPDIR.")
