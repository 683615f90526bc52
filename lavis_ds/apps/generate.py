"""Run an exported model without DeepSpeed: one prompt, or a whole annotation file.

    lavis-ds generate --model exports/demo --image a.png --prompt "Describe the image in a few words."
    lavis-ds generate --model exports/demo --image a.png b.png --prompt "..." --json
    lavis-ds generate --model exports/demo --data test.json --images data/images --out preds.jsonl
    torchrun --nproc_per_node=4 -m lavis_ds.apps.generate --model exports/demo --data test.json --out preds.jsonl

Images go through the eval image processor of the export's first dataset section
(if there is none: the model's own, its tower's processing for llava and instructblip, else
``blip2_image_eval`` at the model's ``image_size``), the prompt
through its eval text processor, as in the run's evaluation. A prompt without
``<ImageHere>`` gets the image in front (``<Img><ImageHere></Img> prompt``).

With ``--data``, the file is read by the parser of one of the training formats
(``--format``, or detected from the file), every record checked as a training run
checks it, and the last instruction of every record answered, earlier turns with
their answers as history. COCO-caption files give one sample per image with all of
its captions as references. Each output line is
``{"index", "id", "image", "prompt", "references", "generated"}`` (plus ``history``
for multi-turn records), in input order. Under ``torchrun`` every process answers
a share and writes ``<out>.rank<N>``; at the end the shares are merged into
``--out``. An interrupted run started again with the same command only answers
the samples that are not in ``--out`` or a share yet.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lavis_ds.apps.export import ExportError, load_exported, read_export_config
from lavis_ds.apps.generation import (GenerationSettings, add_generation_arguments, eval_processors, generate,
                                      open_image, settings_from_args)
from lavis_ds.apps.predictions_file import finished_lines, merge, open_for_append, share_path, share_paths

# Annotation formats --data reads: the builders whose parser reads one JSON file.
FORMATS = ("minigpt4qwen_instruction", "llava_conversation", "chat_messages", "coco_caption")


# ----------------------------------------------------------------------------- annotation files
@dataclass(frozen=True)
class Sample:
    """One line of the predictions file to produce: a record (or, for captions, an image) to answer."""

    index: int
    record: int  # position in the dataset's records; its image and turns are what the model sees
    references: tuple[str, ...]  # reference answers of the last turn (every caption of a captioned image)

    def describe(self, dataset) -> dict[str, Any]:
        """The output line without ``generated``."""
        record = dataset.records[self.record]
        line = {"index": self.index, "id": record.record_id, "image": record.image,
                "prompt": record.instructions[-1], "references": list(self.references)}
        if record.system is not None:  # the record's own system turn: what the model is asked with
            line["system"] = record.system
        if len(record.instructions) > 1:
            line["history"] = [list(turn) for turn in zip(record.instructions[:-1], record.outputs[:-1])]
        return line


def detect_format(path: Path) -> str:
    """The annotation format of ``path``, from its layout and its first record's keys."""
    from lavis_ds.datasets.loading import read_json

    raw = read_json(path)
    if isinstance(raw, dict) and {"images", "annotations"} <= raw.keys():
        return "coco_caption"
    first = raw[0] if isinstance(raw, list) and raw else None
    keys = set(first) if isinstance(first, dict) else set()
    # LLaMA-Factory's sharegpt records have `conversations` as LLaVA's do, with `images` or `system` beside them
    if "messages" in keys or ("conversations" in keys and keys & {"images", "system"}):
        return "chat_messages"
    for format_name, marker in (("llava_conversation", "conversations"),
                                ("minigpt4qwen_instruction", "instruction"), ("coco_caption", "caption")):
        if marker in keys:
            return format_name
    found = f"first record has keys {sorted(keys)}" if keys else f"content is {type(raw).__name__}"
    raise ValueError(f"{path}: cannot tell its annotation format ({found}); expected records with 'conversations' "
                     f"(LLaVA), 'messages' (ms-swift, LLaMA-Factory), 'instruction'/'output' (MiniGPT4Qwen) or "
                     f"'caption' (COCO), or pass --format "
                     f"({', '.join(FORMATS)})")


def run_image_root(model: str | Path, data: Path) -> Path | None:
    """The image folder of the training run's dataset that read ``data`` (one of its annotation files, as the
    export's config.yaml records them); None if ``data`` is none of them, or the folder is not here."""
    from lavis_ds.common.registry import builders as builder_registry
    from lavis_ds.datasets import builders  # noqa: F401  (registers the builders)

    for name, section in (read_export_config(model).get("datasets") or {}).items():
        if "build_info" not in section or section.get("builder") not in builder_registry:
            continue  # an export from before build_info was kept, or a user's builder not imported here
        try:
            builder = builder_registry.get(section.builder)(section, section_name=name)
        except ValueError:  # a section today's builder no longer reads: --images (or the file's folder) it is
            continue
        files = [path.resolve() for paths in builder.annotation_files().values() for path in paths]
        root = builder.image_root()
        if data.resolve() in files and root is not None and root.is_dir():
            print(f"images from {root} ({builder.image_root_key()} of the run, whose annotations include {data})",
                  file=sys.stderr)
            return root
    return None


def load_samples(path: Path, format_name: str, image_root: Path, image_processor: Callable,
                 text_processor: Callable | None, caption_prompt: str | None = None,
                 skip_bad_records: bool = False):
    """``(dataset, samples)``: the file's records read and checked by its training builder's parser.

    COCO-caption records of one image become one sample holding every caption as a
    reference (the parser makes one record per caption, as training wants); every
    other record is one sample.
    """
    from lavis_ds.common import registry as reg
    from lavis_ds.datasets import builders  # noqa: F401  (registers the builders)
    from lavis_ds.datasets.instruction import InstructionDataset
    from lavis_ds.datasets.loading import ALL_KINDS, BadRecordsError, RecordLoader, describe_bad

    if format_name not in FORMATS:
        raise ValueError(f"--format {format_name!r} is not one of {', '.join(FORMATS)}")
    options = {"prompt": caption_prompt} if caption_prompt is not None else {}
    builder = reg.builders.get(format_name)(options, section_name=f"--format {format_name}")
    loader = RecordLoader(builder.parse_file(), skip=ALL_KINDS if skip_bad_records else ())
    try:
        dataset = InstructionDataset([path], image_root, image_processor, text_processor, loader=loader)
    except BadRecordsError as e:  # its own hint names the YAML key; here it is a flag
        raise ValueError("\n".join(describe_bad(e.bad)) + "\n(pass --skip-bad-records to leave such records out; "
                         "they are counted)") from None
    if dataset.skip_summary:
        print(f"{path}: {dataset.skip_summary}", file=sys.stderr)
    groups: dict[tuple, list[int]] = {}
    for i, record in enumerate(dataset.records):
        key = ((record.source, record.image) if format_name == "coco_caption"
               else (record.source, record.list_name, record.position))
        groups.setdefault(key, []).append(i)
    samples = [Sample(n, members[0], tuple(dataset.records[i].outputs[-1] for i in members))
               for n, members in enumerate(groups.values())]
    return dataset, samples


# ----------------------------------------------------------------------------- the predictions file
class _Share(torch.utils.data.Dataset):
    """This process's samples, loaded (image decoded and processed) by DataLoader workers."""

    def __init__(self, dataset, samples: list[Sample]):
        self.dataset, self.samples = dataset, samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        try:
            return {**self.dataset[self.samples[i].record], "sample": self.samples[i].index}
        except OSError as e:  # an image that does not decode: its message names it and the record
            # Handed over as text: a worker's exception would reach the user wrapped in its traceback.
            return {"error": str(e)}

    @staticmethod
    def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
        from lavis_ds.datasets.instruction import InstructionDataset

        errors = [item["error"] for item in items if "error" in item]
        if errors:
            return {"error": errors[0]}
        return {**InstructionDataset.collater(items), "sample": [item["sample"] for item in items]}


# ----------------------------------------------------------------------------- processes
class Processes:
    """This process's rank among ``torchrun``'s (barriers and the failure vote go through ``common.comm``), or
    alone. Under a launcher each process binds its own GPU first, so ``--device cuda`` is that GPU."""

    def __init__(self) -> None:
        from lavis_ds.common import comm
        from lavis_ds.common.device import bind_local_device

        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        if self.world > 1:
            bind_local_device()
            comm.init_process_group()

    def barrier(self) -> None:
        from lavis_ds.common import comm

        comm.barrier()

    def any_failed(self, failed: bool) -> bool:
        """Whether some process failed; every process must call it (so none waits for a dead one)."""
        from lavis_ds.common import comm

        return bool(comm.all_reduce(torch.tensor([int(failed)]), op="max").item())

    def close(self) -> None:
        from lavis_ds.common import comm

        comm.destroy()


def run_file(args: argparse.Namespace, processes: Processes) -> int:
    """Answer every sample of ``args.data`` into ``args.out``; the return value is the exit code.

    Over 50 lines: reading the file, skipping what is answered, answering this process's share and merging are
    one sequence whose steps share the samples, the share and the output file; apart they would pass all three."""
    from torch.utils.data import DataLoader
    from tqdm import tqdm
    from transformers import set_seed

    data, out = Path(args.data), Path(args.out)
    image_root = Path(args.images) if args.images else run_image_root(args.model, data) or data.parent
    if not image_root.is_dir():
        raise ValueError(f"--images {image_root}: not a folder (the folder the records' image paths are relative to)")
    format_name = args.format if args.format != "auto" else detect_format(data)
    if args.prompt is not None and format_name != "coco_caption":
        raise ValueError(f"--prompt with --data sets the caption instruction of coco_caption files; {data} is "
                         f"{format_name}, whose records carry their own instructions")
    settings = settings_from_args(args)
    model = load_exported(args.model, device=args.device, dtype=args.dtype)
    image_processor, text_processor = eval_processors(args.model)
    dataset, samples = load_samples(data, format_name, image_root, image_processor, text_processor,
                                    caption_prompt=args.prompt, skip_bad_records=args.skip_bad_records)
    expected = [sample.describe(dataset) for sample in samples]

    is_main = processes.rank == 0
    if args.overwrite and is_main:
        for path in [out, *share_paths(out)]:
            path.unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    processes.barrier()  # nobody reads what rank 0 is deleting
    done = finished_lines(out, expected)
    processes.barrier()  # everybody has read the shares before anybody appends to them
    todo = [sample for sample in samples if sample.index not in done]
    mine = todo[processes.rank::processes.world]
    if is_main:
        print(f"{data} ({format_name}): {len(samples)} sample(s); {len(done)} already in {out} and its shares, "
              f"{len(todo)} to answer on {processes.world} process(es)", file=sys.stderr)
    loader = DataLoader(_Share(dataset, mine), batch_size=args.batch_size, num_workers=args.num_workers,
                        collate_fn=_Share.collate)
    writer = open_for_append(out if processes.world == 1 else share_path(out, processes.rank))
    failure = None
    try:
        with writer, tqdm(total=len(mine), disable=not is_main, unit="sample", file=sys.stderr,
                          desc="generate" if processes.world == 1 else f"generate (rank 0 of {processes.world})") as bar:
            for batch in loader:
                if "error" in batch:
                    raise OSError(batch["error"])
                # Seeded by the batch's first sample: sampling gives the same text when the run is resumed.
                set_seed(args.seed + batch["sample"][0])
                texts = generate(model, batch["image"], batch["instruction"], batch["output"],
                                 num_images=batch["num_images"], systems=batch["system"], **settings.to_kwargs())
                writer.writelines(json.dumps({**expected[index], "generated": text}, ensure_ascii=False) + "\n"
                                  for index, text in zip(batch["sample"], texts))
                writer.flush()
                bar.update(len(texts))
    except OSError as e:  # an image that is missing or does not decode; the message names it and its record
        failure = e
        print(f"lavis_ds generate: {e}", file=sys.stderr)
    if processes.any_failed(failure is not None):
        if is_main:
            print(f"lavis_ds generate: stopped; the answers so far are kept in {out} and its shares, and the same "
                  "command resumes", file=sys.stderr)
        return 2
    if is_main:
        missing = merge(out, len(samples))
        print(f"wrote {len(samples) - missing} answer(s) to {out}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- command line
def run_prompt(args: argparse.Namespace) -> int:
    """Today's single-prompt mode: one prompt over the given images, printed."""
    from lavis_ds.datasets.instruction import process_text

    missing = [path for path in args.image if not Path(path).is_file()]
    if missing:
        raise ValueError(f"image file(s) not found: {', '.join(missing)}")
    settings = settings_from_args(args)
    model = load_exported(args.model, device=args.device, dtype=args.dtype)
    image_processor, text_processor = eval_processors(args.model)
    images = []
    for path in args.image:
        images.append(image_processor(open_image(path)))
    prompt = process_text(args.prompt, text_processor) if text_processor else args.prompt
    kwargs = settings.to_kwargs()
    if args.min_new_tokens is not None:
        kwargs["min_new_tokens"] = args.min_new_tokens
    texts = generate(model, torch.stack(images), [prompt] * len(images), **kwargs)
    if args.json:
        print(json.dumps([{"image": path, "generated": text} for path, text in zip(args.image, texts)]))
    else:
        for path, text in zip(args.image, texts):
            print(text if len(args.image) == 1 else f"{path}: {text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lavis-ds generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="export folder (lavis-ds export ... --out <folder>)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", nargs="+", help="image file(s), answered with --prompt; one batch")
    source.add_argument("--data", help="an annotation file to answer record by record (needs --out)")
    parser.add_argument("--prompt", help="with --image: the question or instruction; with --data: the caption "
                                         "instruction of a coco_caption file (default: the builder's)")
    parser.add_argument("--json", action="store_true", help="with --image: print one JSON list of {image, generated}")
    parser.add_argument("--min-new-tokens", type=int, default=None, help="with --image")
    data = parser.add_argument_group("annotation files (--data)")
    data.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                      help="annotation format (default: detected from the file)")
    data.add_argument("--images", help="folder the records' image paths are relative to "
                                       "(default: the annotation file's folder)")
    data.add_argument("--out", help="predictions file (JSON lines); an unfinished one is resumed")
    data.add_argument("--overwrite", action="store_true", help="start --out over instead of resuming it")
    data.add_argument("--batch-size", type=int, default=8, help="samples per generate call (per process)")
    data.add_argument("--num-workers", type=int, default=0, help="DataLoader workers reading images (per process)")
    data.add_argument("--skip-bad-records", action="store_true",
                      help="leave malformed records and records whose image is missing out (counted) instead of "
                           "stopping")
    data.add_argument("--seed", type=int, default=42, help="seeds sampling (--do-sample), per batch")
    add_generation_arguments(parser, GenerationSettings())
    parser.add_argument("--dtype", default="auto", help="auto (the dtype it trained in), fp32, bf16 or fp16")
    parser.add_argument("--device", default="cpu")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.image is not None and args.prompt is None:
        parser.error("--image needs --prompt")
    if args.data is not None and args.out is None:
        parser.error("--data needs --out (the predictions file)")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.image is not None:
        try:
            return run_prompt(args)
        except (ExportError, ValueError) as e:
            print(f"lavis_ds generate: {e}", file=sys.stderr)
            return 2
    processes = Processes()
    try:
        return run_file(args, processes)
    except (ExportError, ValueError, OSError) as e:  # a bad model folder, data file, format or output path
        print(f"lavis_ds generate: {e}", file=sys.stderr)
        return 2
    finally:
        processes.close()


if __name__ == "__main__":
    from lavis_ds.common.dist import exit_now

    exit_now(main())
