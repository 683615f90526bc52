"""The registered architectures and a tiny config of each, in one place: tests parametrize over ``ARCHITECTURES``.

Every ``registry.models`` entry that is a ``VisionLLM`` is an architecture; each has a ``tiny`` preset. What a
test needs beyond that preset is written here once, from what the preset says (a connector that reads the
instruction gets a Q-Former tokenizer folder), so a newly registered architecture is covered by every
parametrized test without an entry of its own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lavis_ds.models  # noqa: F401  (registers the architectures)
from lavis_ds.common.registry import connectors, models, registry
from lavis_ds.models.vision_llm import VisionLLM

ARCHITECTURES = sorted(name for name in models
                       if issubclass(registry.get_model_class(name), VisionLLM))
# Architectures whose images keep their own sizes (Qwen-VL: flat patches and a grid per image). They take a square
# [N, 3, S, S] pixel tensor too (each a still image, S a multiple of a merged token's side), which these tests make.
FLAT_ARCHITECTURES = [name for name in ARCHITECTURES if registry.get_model_class(name).SETTINGS.FLAT_FEATURES]


def image_side(model: VisionLLM) -> int:
    """The side of the square test images ``model`` takes: its tower's, or for images of any size 2 x 2 merged
    tokens, the smallest image a Qwen-VL tower takes whole (56 px at Qwen2-VL's 14 px patches, 64 px at
    Qwen3-VL's 16 px)."""
    if model.vision_tower.image_size:
        return model.vision_tower.image_size
    layout = model.vision_tower.layout
    return 2 * layout.patch_size * layout.merge_size
BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "in", "the", "image", "?", "a", "shape",
              "colour", "color", "which", "of", "and", "are", "same", "describe", "picture", "ball", "cat"]


def bert_tokenizer_folder(folder: Path) -> Path:
    """A tiny BERT tokenizer plus ``[DEC]``, saved as InstructBLIP's ``qformer_tokenizer/`` (made once per folder)."""
    from transformers import BertTokenizer

    target = folder / "qformer_tokenizer"
    if not target.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vocab.txt").write_text("\n".join(BERT_WORDS) + "\n")
        tokenizer = BertTokenizer(str(folder / "vocab.txt"))
        tokenizer.add_special_tokens({"bos_token": "[DEC]"})  # as LAVIS and InstructBLIP's qformer_tokenizer
        tokenizer.save_pretrained(target)
    return target


def tiny_model_section(arch: str, tokenizer: str | Path, files: Path, **overrides: Any) -> dict[str, Any]:
    """The ``model:`` section of ``arch``'s tiny preset pointed at ``tokenizer`` (the LLM's), with the files its parts
    read made under ``files``, and ``overrides`` on top (a run config's short form: the preset fills the rest)."""
    section: dict[str, Any] = {"arch": arch, "model_type": "tiny", "tokenizer": str(tokenizer)}
    connector = registry.get_model_class(arch).default_config("tiny").get("connector")
    if connector and connectors.get(connector["name"]).NEEDS_INSTRUCTION:
        section["connector"] = {"qformer_tokenizer": str(bert_tokenizer_folder(files))}
    return merged(section, overrides)


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` on top, nested sections merged key by key (as the config loader merges a run's
    ``model:`` section over its preset)."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny_model_config(arch: str, tokenizer: str | Path, files: Path, **overrides: Any) -> dict[str, Any]:
    """The whole tiny preset of ``arch`` as a plain dict (``from_config``'s input), as ``tiny_model_section``."""
    cls = registry.get_model_class(arch)
    return merged(cls.default_config("tiny"), tiny_model_section(arch, tokenizer, files, **overrides))


def build_tiny(arch: str, tokenizer: str | Path, files: Path, **overrides: Any) -> VisionLLM:
    """``arch``'s tiny preset built in this process."""
    return registry.get_model_class(arch).from_config(tiny_model_config(arch, tokenizer, files, **overrides))


# Parameter-name prefixes of each part: every architecture holds `vision_tower`, `connector` and `llm_model`.
PART_PREFIXES = {"tower": ("vision_tower.",), "connector": ("connector.",), "llm": ("llm_model.",)}


def set_trainable(model: VisionLLM, arch: str, **parts: bool) -> None:
    """Make the parameters of ``tower``, ``connector`` and ``llm`` train or not, as ``parts`` says (others as built)."""
    for name, parameter in model.named_parameters():
        for part, trains in parts.items():
            if name.startswith(PART_PREFIXES[part]):
                parameter.requires_grad_(trains)


def mixed_batch(model: VisionLLM) -> dict[str, Any]:
    """A text-only sample, a one-image sample and a two-turn two-image sample (0..N images per sample)."""
    import torch

    side = image_side(model)
    return {"image": torch.randn(3, 3, side, side), "num_images": [0, 1, 2],
            "instruction": [["What color is the ball?"],
                            ["<Img><ImageHere></Img> What is in the image?"],
                            ["<Img><ImageHere></Img> <Img><ImageHere></Img> Are they the same?",
                             "Describe the picture."]],
            "output": [["It is red."], ["A cat sitting on a mat."],
                       ["No, the second one is darker.", "A dog runs on the grass next to a red ball."]]}


def without_dropout(arch: str) -> dict[str, Any]:
    """Overrides that turn off the dropout a tiny preset has (a Q-Former connector's), so that runs on other
    engines or numbers of processes draw no different masks."""
    preset = registry.get_model_class(arch).default_config("tiny")
    connector = preset.get("connector") or {}
    off = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if "qformer" in preset:  # a Q-Former set by the model section's own key (blip2_qwen's MiniGPT4Qwen keys)
        return {"qformer": off}
    if connector.get("name") in ("qformer", "instruct_qformer"):
        return {"connector": {"qformer": off}}
    return {}


def loss_and_grads(model, batch: dict, pack_to: int | None) -> tuple[dict, Any, dict]:
    """``(prepared batch, summed loss, gradients by parameter name)`` of one forward and backward on ``batch``, padded
    (``pack_to`` None) or packed: the two sides of a packed-equals-padded check."""
    model.zero_grad(set_to_none=True)
    prepared = model.prepare_batch(dict(batch), pack_to=pack_to)
    out = model(prepared)
    out["loss_sum"].backward()
    return prepared, out["loss_sum"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}

