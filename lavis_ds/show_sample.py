"""Print one training sample as the model sees it: the rendered prompt, the image placeholders, the loss mask.

    python -m lavis_ds.show_sample --cfg-path projects/demo/tiny_zero2.yaml [--options k=v ...]
                                   [--index N] [--split train] [--dataset NAME] [--color auto|always|never]

It reads the run's real dataset (annotation files, image and text processors) and the
model's tokenizer and chat template, and builds no model weights. Supervised tokens
(what the loss is computed on: each answer and its end-of-turn token) are shown
between ``[[`` and ``]]`` (in green on a terminal); each run of image placeholders is
collapsed to ``<image xN>``. The last line counts the tokens: total, image, supervised.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from typing import Any

from lavis_ds.common.errors import LavisDsError, message_of, report
from lavis_ds.models.chat_template import GENERATION_BLOCK, template_text
from lavis_ds.models.prompt import IGNORE_INDEX, ChatPrompt

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


def show(args: argparse.Namespace) -> str:
    """The text ``main`` prints for ``args``."""
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
    sample = dataset[args.index]
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    where, image = f"datasets.{name} {args.split}[{args.index}]", _image_name(dataset, sample)
    if "chosen" in sample:  # a preference pair: both sides, each with its last answer supervised (as DPO scores it)
        return "\n\n".join(describe(prompt, {"instruction": sample["instruction"],
                                               "output": [*sample["output"], sample[side]]},
                                      f"{where} ({side})", image, color, last_answer_only=True)
                             for side in ("chosen", "rejected"))
    return describe(prompt, sample, where, image, color)


def prompt_of(cfg) -> ChatPrompt:
    """The prompt builder of the run's model, from its tokenizer alone."""
    from omegaconf import OmegaConf

    from lavis_ds.common import registry as reg

    cls = reg.models.get(cfg.model.arch)
    if not hasattr(cls, "prompt_from_config"):
        raise ValueError(f"model.arch {cfg.model.arch!r} ({cls.__name__}) has no prompt_from_config(section), "
                         "so show_sample cannot render its prompts")
    return cls.prompt_from_config(OmegaConf.to_container(cfg.model, resolve=True))


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


def describe(prompt: ChatPrompt, sample: dict[str, Any], where: str, image: str | None, color: bool,
             last_answer_only: bool = False) -> str:
    """The header, the marked-up prompt and the token counts of one sample. ``last_answer_only``: only the last
    answer supervised, the earlier ones prompt (a side of a preference pair)."""
    ids, labels = prompt.training_example(sample["instruction"], sample["output"])
    if last_answer_only:
        import torch

        from lavis_ds.objectives.model_calls import last_answer_labels

        turns = [len(sample["output"])]
        labels = last_answer_labels(torch.tensor([labels]), turns, [where])[0].tolist()
    full, _ = dataclasses.replace(prompt, max_len=sys.maxsize).training_example(sample["instruction"], sample["output"])
    supervised = sum(label != IGNORE_INDEX for label in labels)
    image_tokens = ids.count(prompt.image_token_id)
    lines = [f"sample: {where}" + (f"  image: {image}" if image else ""),
             f"prompt: {_format_name(prompt)}",
             f"supervised: {'green' if color else f'between {OPEN} and {CLOSE}'}", "",
             render(prompt, ids, labels, color), "",
             f"tokens: {len(ids)} total, {image_tokens} image, {supervised} supervised"
             + (f" (cut to max_txt_len={prompt.max_len} from {len(full)})" if len(full) > len(ids) else "")]
    return "\n".join(lines)


def render(prompt: ChatPrompt, ids: list[int], labels: list[int], color: bool) -> str:
    """The token ids as text: supervised runs marked, each run of image placeholders as ``<image xN>``."""
    def kind(pair: tuple[int, int]) -> str:
        token, label = pair
        return "image" if token == prompt.image_token_id else "answer" if label != IGNORE_INDEX else "context"

    pieces = []
    for what, run in itertools.groupby(zip(ids, labels), key=kind):
        tokens = [token for token, _ in run]
        if what == "image":
            pieces.append(f"<image x{len(tokens)}>")
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


def _image_name(dataset: Any, sample: dict[str, Any]) -> str | None:
    namer = getattr(dataset, "image_name", None)
    return namer(int(sample["index"])) if namer is not None and "index" in sample else None


if __name__ == "__main__":
    sys.exit(main())
