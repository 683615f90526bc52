"""Read a W&B offline run back with wandb's own record type, for the tracker tests.

wandb >= 0.2x dropped its Python reader of the run file (``wandb.sdk.internal.datastore``); the file is
still its transaction log: a 7-byte header (``:W&B``, a magic number, a version), then records in
LevelDB's log format (32 KiB blocks; each chunk a 4-byte CRC, 2-byte length, 1-byte type: full, first,
middle, last), each record a serialized ``wandb_internal_pb2.Record``.
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK, CHUNK_HEADER, FULL, FIRST, LAST = 32768, 7, 1, 2, 4
WRITTEN_WITHIN_S = 120


def records(path: Path) -> list:
    """Every ``Record`` of a ``run-<id>.wandb`` file, in order, once the file is complete.

    ``run.finish()`` returns before W&B's service process has written the run's file out (it closes the
    file when the service shuts down, at the process's exit), so a test that reads it in the same process
    waits for the last record, the run's ``exit``, to be on disk.
    """
    deadline = time.monotonic() + WRITTEN_WITHIN_S
    while True:
        found = list(_parse(Path(path).read_bytes(), path))
        if any(record.WhichOneof("record_type") == "exit" for record in found):
            return found
        assert time.monotonic() < deadline, f"{path}: no exit record within {WRITTEN_WITHIN_S} s of the run's end"
        time.sleep(0.2)


def _parse(data: bytes, path: Path):
    from wandb.proto import wandb_internal_pb2

    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, parts = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0:  # zero padding to the block's end (a preallocated or torn tail)
            pos += room
            continue
        chunk = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def history(path: Path) -> list[dict]:
    """The logged rows: ``{"_step": N, "train/loss": ..., ...}`` per step."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_info(path: Path) -> tuple[str, dict]:
    """(run id, config) of the run record (the config as first sent, with its later updates)."""
    run_id, config, found = None, {}, records(path)
    for record in found:
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        if kind == "run":
            run_id = record.run.run_id
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    kinds = [record.WhichOneof("record_type") for record in found]
    assert run_id is not None, f"{path} ({path.stat().st_size} bytes) holds no run record: {kinds}"
    return run_id, config
