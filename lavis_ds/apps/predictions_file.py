"""The predictions file of ``lavis-ds generate --data``: every process's share (``<out>.rank<N>``), the lines
already written (so a run started again answers only the rest), and the merge of the shares into ``--out`` in
input order. A line is one JSON object ending in a newline; a torn last line (a run killed mid-write) is cut and
its sample answered again."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """``(complete lines, their length in bytes)``; a torn last line (a run killed mid-write) is left out."""
    if not path.is_file():
        return [], 0
    lines, length = [], 0
    data = path.read_bytes()
    for number, line in enumerate(data.splitlines(keepends=True), 1):
        if not line.endswith(b"\n"):
            break  # json.dumps escapes newlines, so only an unfinished write lacks its "\n"
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {number} is not JSON ({e}); it is not a predictions file this "
                             "command wrote: use another --out, or --overwrite to replace it") from None
        length += len(line)
    return lines, length


def share_path(out: Path, rank: int) -> Path:
    """Where process ``rank`` of a multi-process run writes its share."""
    return out.with_name(f"{out.name}.rank{rank}")


def share_paths(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.glob(f"{out.name}.rank*") if p.name[len(out.name) + 5:].isdigit())


def finished_lines(out: Path, expected: Sequence[dict]) -> dict[int, dict]:
    """Lines already written to ``out`` and every share, by index, each checked against the sample it names."""
    done = {}
    for path in [out, *share_paths(out)]:
        for line in read_jsonl(path)[0]:
            index = line.get("index") if isinstance(line, dict) else None
            ok = isinstance(index, int) and 0 <= index < len(expected) and all(
                line.get(key) == expected[index][key] for key in ("image", "prompt"))
            if not ok:
                wanted = expected[index] if isinstance(index, int) and 0 <= index < len(expected) else None
                raise ValueError(f"{path} holds a line for another annotation file or format: {json.dumps(line)[:200]}"
                                 + (f" (sample {index} here is image {wanted['image']!r}, prompt {wanted['prompt']!r})"
                                    if wanted else "") + "; use another --out, or --overwrite to start over")
            done.setdefault(index, line)
    return done


def open_for_append(path: Path):
    """``path`` opened for appending after cutting a torn last line (its sample is answered again)."""
    _, length = read_jsonl(path)
    if path.is_file() and path.stat().st_size != length:
        with path.open("r+b") as f:
            f.truncate(length)
    return path.open("a", encoding="utf-8")


def merge(out: Path, total: int) -> int:
    """Write every line of ``out`` and the shares into ``out`` in input order; remove the shares.

    Returns the number of samples still missing (0 when the file is complete).
    """
    shares = share_paths(out)
    lines = {}
    for path in [out, *shares]:
        for line in read_jsonl(path)[0]:
            lines.setdefault(line["index"], line)
    ordered = [lines[i] for i in sorted(lines)]
    current, length = read_jsonl(out)
    if shares or current != ordered or (out.is_file() and out.stat().st_size != length):
        tmp = out.with_name(f".{out.name}.merging")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in ordered)
        os.replace(tmp, out)  # atomic: a crash here leaves the old file and the shares
        for path in shares:
            path.unlink()
    return total - len(ordered)
