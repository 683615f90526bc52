"""Print one training sample as the model sees it: the token ids the training forward receives, rendered, with the
image placeholders and the loss mask.

    python -m lavis_ds.show_sample --cfg-path projects/demo/tiny_zero2.yaml [--options k=v ...]
                                   [--index N] [--split train] [--dataset NAME] [--color auto|always|never]

It reads the run's real dataset (annotation files, image and text processors) and the
model's tokenizer and chat template, and builds no model weights. The ids come from the functions training
calls (the dataset's sample and collater, the model's tokenizing): the record's real image and video-frame
counts, its own system turn, a pair's two sides, and the packed layout when the run packs. Supervised tokens
(what the loss is computed on: each answer and its end-of-turn token) are shown
between ``[[`` and ``]]`` (in green on a terminal); each run of image placeholders is
collapsed to ``<image xN>``. The last line counts the tokens: total, image, supervised.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from typing import Any, Callable

from lavis_ds.common.errors import LavisDsError, message_of, report
from lavis_ds.models.chat_template import GENERATION_BLOCK, template_text
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt
from lavis_ds.models.vision_llm_batch import token_batch

OPEN, CLOSE = "[[", "]]"  # around supervised text when not in colour
GREEN, RESET = "\033[32m", "\033[0m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lavis-ds show-sample", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg-path", required=True, help="run YAML")
    parser.add_argument("--options", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    parser.add_argument("--index", type=int, default=0, help="sample index in the split (default 0)")
    parser.add_argument("--split", default="train", help="dataset split (default train)")
    parser.add_argument("--dataset", default=None, help="datasets section (default: the first with --split)")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                        help="supervised text in green instead of [[ ]] (auto: on a terminal)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 shown; 2 bad input (config, data, index)."""
    args = parse_args(argv)
    try:
        print(show(args))
    except (LavisDsError, ValueError, KeyError, IndexError) as e:
        report(message_of(e) if isinstance(e, LavisDsError) else str(e).strip("'\""))
        return 2
    return 0


@dataclasses.dataclass(frozen=True)
class ShownSample:
    """One sequence exactly as the training forward receives it (a pair gives two, its chosen and rejected side)."""

    where: str
    ids: list[int]
    labels: list[int]
    untruncated: int  # its length before the cut at max_txt_len
    packed: bool = False  # laid out by run.packing: positions restart at 0 where it starts in its row


def show(args: argparse.Namespace) -> str:
    """The text ``main`` prints for ``args``."""
    prompt, dataset, where, image, pack_to = sample_source(args)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    return "\n\n".join(describe(prompt, shown, image, color, pack_to)
                        for shown in training_sequences(prompt, dataset, args.index, where, pack_to))


def sample_source(args: argparse.Namespace) -> tuple[ChatPrompt, Any, str, str | None, int | None]:
    """``(prompt, dataset, where, image name, pack_to)`` of the sample ``args`` names: the run's prompt, the split of
    its section, and training's packing (its row length, None unpacked)."""
    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.build import prepare_datasets
    from lavis_ds.config import load_config
    from lavis_ds.datasets.loading import ParsedFiles

    parsed_files = ParsedFiles()
    cfg = load_config(args.cfg_path, args.options, parsed_files=parsed_files)
    prepare_datasets(cfg.datasets)  # the demo's tokenizer is generated with its data
    prompt = prompt_of(cfg)
    name, dataset = dataset_of(cfg, args.split, args.dataset, parsed_files)
    if not 0 <= args.index < len(dataset):
        raise IndexError(f"--index {args.index}: datasets.{name} split {args.split!r} has {len(dataset)} samples")
    # Training packs its own micro-batches only (runners.data): evaluation splits are padded.
    pack_to = cfg.run.get("max_seq_len") if cfg.run.get("packing") and args.split == "train" else None
    return prompt, dataset, f"datasets.{name} {args.split}[{args.index}]", _image_name(dataset, args.index), pack_to


def training_sequences(prompt: ChatPrompt, dataset: Any, index: int, where: str,
                       pack_to: int | None = None) -> list[ShownSample]:
    """The sequences sample ``index`` becomes in the training forward, built by the functions training calls: the
    dataset's sample and collater (its real image and video-frame counts, its own system turn), then the model's
    tokenizing (``models.vision_llm_batch.token_batch``; a pair's two sides by ``objectives.model_calls``, only
    each side's last answer supervised), packed when the run packs."""
    batch = dataset.collater([dataset[index]])
    # An image's count where it depends on the image's size: its processor's, the same function the model counts by.
    counting = None if prompt.num_image_tokens is not None else dataset.vis_processor.tokens_for_image
    if "chosen" in batch:
        from lavis_ds.objectives.model_calls import prepare_pairs

        rows = prepare_pairs(_Tokenizing(prompt, counting), batch)
        full = prepare_pairs(_Tokenizing(dataclasses.replace(prompt, max_len=sys.maxsize), counting), batch)
        names = [f"{where} ({side})" for side in ("chosen", "rejected")]
    else:
        rows = token_batch(prompt, batch, _pad_id(prompt), pack_to, counting)
        full = token_batch(dataclasses.replace(prompt, max_len=sys.maxsize), batch, _pad_id(prompt),
                           tokens_for_image=counting)
        names = [where]
    shown = []
    for row, name in enumerate(names):
        filled = rows["attention_mask"][row].bool()
        shown.append(ShownSample(name, rows["input_ids"][row][filled].tolist(), rows["labels"][row][filled].tolist(),
                                 int(full["attention_mask"][row].sum()), packed="position_ids" in rows))
    return shown


class _Tokenizing:
    """The model's ``prepare_batch`` without its weights: the token fields ``token_batch`` makes (the host-side
    fields of an image path, such as InstructBLIP's Q-Former text, are not shown)."""

    def __init__(self, prompt: ChatPrompt, tokens_for_image: Callable[[Any], int] | None):
        self.prompt, self.tokens_for_image = prompt, tokens_for_image

    def prepare_batch(self, samples: dict[str, Any]) -> dict[str, Any]:
        return {**samples, **token_batch(self.prompt, samples, _pad_id(self.prompt),
                                         tokens_for_image=self.tokens_for_image)}


def _pad_id(prompt: ChatPrompt) -> int:
    return prompt.tokenizer.pad_token_id  # models.tokenizer.prepare_tokenizer guarantees one, as for the model


def prompt_of(cfg) -> ChatPrompt:
    """The prompt builder of the run's model, from its tokenizer alone."""
    from omegaconf import OmegaConf

    from lavis_ds.common import registry as reg
    from lavis_ds.models.settings.base import model_settings

    cls = reg.models.get(cfg.model.arch)
    settings = model_settings(cls, OmegaConf.to_container(cfg.model, resolve=True))
    if not hasattr(settings, "prompt"):
        raise ValueError(f"model.arch {cfg.model.arch!r} ({cls.__name__}) has no SETTINGS(arch, section).prompt(), "
                         "so show_sample cannot render its prompts")
    return settings.prompt()


def dataset_of(cfg, split: str, name: str | None, parsed_files) -> tuple[str, Any]:
    """``(section name, dataset)`` of ``split``: that section only is built, with the run's processors."""
    from omegaconf import OmegaConf

    from lavis_ds.build import build_datasets

    names = [name] if name else list(cfg.datasets)
    if name is not None and name not in cfg.datasets:
        raise KeyError(f"--dataset {name!r}: the config's datasets are {', '.join(cfg.datasets)}")
    for candidate in names:
        built = build_datasets(OmegaConf.create({candidate: cfg.datasets[candidate]}), parsed_files)[candidate]
        if split in built:
            return candidate, built[split]
    raise KeyError(f"--split {split!r}: no split of that name in datasets {', '.join(names)}")


def describe(prompt: ChatPrompt, shown: ShownSample, image: str | None, color: bool,
             pack_to: int | None = None) -> str:
    """The header, the marked-up prompt and the token counts of one training sequence."""
    supervised = sum(label != IGNORE_INDEX for label in shown.labels)
    image_tokens = sum(shown.ids.count(token) for token in prompt.placeholder_ids)
    cut = shown.untruncated > len(shown.ids)
    lines = [f"sample: {shown.where}" + (f"  image: {image}" if image else ""),
             f"prompt: {_format_name(prompt)}",
             f"supervised: {'green' if color else f'between {OPEN} and {CLOSE}'}", "",
             render(prompt, shown.ids, shown.labels, color), "",
             f"tokens: {len(shown.ids)} total, {image_tokens} image, {supervised} supervised"
             + (f" (cut to max_txt_len={prompt.max_len} from {shown.untruncated})" if cut else "")]
    if shown.packed:
        lines.append(f"packed: positions 0-{len(shown.ids) - 1} in a row of up to run.max_seq_len={pack_to} tokens, "
                     f"beside the other samples of its micro-batch (each restarts at position 0)")
    return "\n".join(lines)


def render(prompt: ChatPrompt, ids: list[int], labels: list[int], color: bool) -> str:
    """The token ids as text: supervised runs marked, each run of image placeholders as ``<image xN>`` (a video's,
    where its placeholder token is its own, as ``<video xN>``)."""
    image_id, *video_id = prompt.placeholder_ids

    def kind(pair: tuple[int, int]) -> str:
        token, label = pair
        return "image" if token == image_id else "video" if token in video_id else \
            "answer" if label != IGNORE_INDEX else "context"

    pieces = []
    for what, run in itertools.groupby(zip(ids, labels), key=kind):
        tokens = [token for token, _ in run]
        if what in ("image", "video"):
            pieces.append(f"<{what} x{len(tokens)}>")
            continue
        text = prompt.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if what == "answer":
            text = f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"
        pieces.append(text)
    return "".join(pieces)


def _format_name(prompt: ChatPrompt) -> str:
    """Which format renders the prompt, and where its answer mask comes from."""
    tokenizer = getattr(prompt.tokenizer, "name_or_path", "") or type(prompt.tokenizer).__name__
    template = template_text(prompt.tokenizer)
    if template is None:
        return f"ChatML written by lavis_ds (tokenizer {tokenizer} has no chat template)"
    source = "its {% generation %} blocks" if GENERATION_BLOCK.search(template) else "prefix renders"
    variables = f", variables {dict(prompt.template_variables)}" if prompt.template_variables else ""
    return f"chat template of tokenizer {tokenizer}{variables}; answer mask from {source}"


def _image_name(dataset: Any, index: int) -> str | None:
    namer = getattr(dataset, "image_name", None)
    return namer(index) if namer is not None else None


if __name__ == "__main__":
    sys.exit(main())
