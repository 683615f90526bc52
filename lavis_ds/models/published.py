"""Published vision-LLM checkpoints into a composed model (``pretrained:`` with ``load_pretrained: true``).

Four formats, told apart by their contents:

- a transformers ``LlavaForConditionalGeneration`` folder: tower, projector and LLM (any layout
  ``models.hf_keys`` reads), plus its tokenizer and the image token its prompts use;
- a transformers ``InstructBlipForConditionalGeneration`` folder: EVA tower, Q-Former with queries,
  projection and LLM, plus its tokenizer and ``qformer_tokenizer/``;
- LAVIS's InstructBLIP ``.pth`` (``blip2_vicuna_instruct``): Q-Former, queries, ``ln_vision``, projection, and
  the ViT when the file has it (LAVIS saves only what trained);
- LLaVA's stage-1 ``mm_projector.bin``: the projector.

A folder's class is a registered Hugging Face family (``lavis_ds.models.hf``), found by its config.json
``model_type``; the family says what else the folder brings and how its parts compare. A folder brings the settings
that come with its weights before the model is built (``settings_from_published``, which the config check applies
too): its LLM architecture (unless ``llm_model`` names one), its tokenizer (unless ``tokenizer`` or ``llm_model``
names one), its image token, and what its family adds (InstructBLIP: its Q-Former tokenizer and ``ln_vision``
epsilon). The parts the config chose (tower, connector, feature layer, query count) are checked against the
folder's: what differs is one ``lavis_ds:`` line.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.models.hf.family import HfFamily, accepted_formats, differences, published_family
from lavis_ds.models.llm import TokenRowsEmbedding, TokenRowsHead, base_llm
from lavis_ds.models.llm_placement import current_placement
from lavis_ds.models.parts import PartError, read_safetensors

logger = logging.getLogger(__name__)


def settings_from_published(section: dict[str, Any]) -> dict[str, Any]:
    """The ``model:`` section (its part sections filled in) with what a published folder fixes (module docstring)."""
    path = section.get("pretrained")
    family = published_family(path) if section.get("load_pretrained") and path else None
    if family is None:
        return section
    from transformers import AutoConfig

    folder = Path(path).expanduser()
    config = AutoConfig.from_pretrained(folder)
    section = dict(section)
    if not section.get("llm_model"):
        logger.info("model.llm_config is replaced by the LLM architecture of %s", folder)
        text = {k: v for k, v in config.text_config.to_dict().items() if not k.startswith("_")}
        section["llm_config"] = text
        if not section.get("tokenizer") and (folder / "tokenizer_config.json").is_file():
            section["tokenizer"] = str(folder)
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is not None and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        section["image_token"] = AutoTokenizer.from_pretrained(folder).convert_ids_to_tokens(image_token_id)
    return family.folders.published_settings(section, folder, config)


def load_published(model: nn.Module, path: str) -> None:
    """Load ``path`` (any format of the module docstring) into a composed model's parts, each checked."""
    file = Path(path).expanduser()
    if not file.exists():
        raise PartError(f"model.pretrained: {file} not found; it takes {accepted_formats()}")
    family = published_family(file)
    if family is not None:
        check_fit(model, file, family)
        model.vision_tower.load_pretrained(str(file))
        model.connector.load_pretrained(str(file))
        load_llm(model, file, family)
        return
    from lavis_ds.models.pretrained import load_torch_file

    state = load_torch_file(file)
    state = state.get("model", state) if isinstance(state, dict) else {}
    keys = list(state) if isinstance(state, dict) else []
    if any("mm_projector." in k for k in keys):
        model.connector.load_pretrained(str(file))
    elif any(k.startswith(("Qformer.", "query_tokens")) for k in keys):
        if not hasattr(model.connector, "qformer"):
            raise PartError(f"model.pretrained: {file} is a LAVIS Q-Former checkpoint, but model.connector is "
                            f"{type(model.connector).__name__}; use connector name instruct_qformer (or qformer)")
        if any(k.startswith("visual_encoder.") for k in keys):
            model.vision_tower.load_pretrained(str(file))
        model.connector.load_pretrained(str(file))
    else:
        raise PartError(f"model.pretrained: {file} holds neither model.mm_projector.* nor Qformer.* / query_tokens "
                        f"(first keys: {keys[:4]}); it takes {accepted_formats()}")


def check_fit(model: nn.Module, folder: Path, family: HfFamily) -> None:
    """One ``PartError`` naming the folder and every setting in which its parts differ from the model's: the image
    path as the family compares it, then the LLM and the image token."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    differ = family.folders.fit_problems(model, config)
    differ += differences("LLM", config.text_config, base_llm(model.llm_model).config,
                          ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is not None and image_token_id != model.llm.prompt.image_token_id:
        differ.append(f"image token id: folder {image_token_id}, model {model.llm.prompt.image_token_id} "
                      f"({model.llm.prompt.image_token!r})")
    if differ:
        raise PartError(f"model.pretrained: {folder} ({family.hf_class}) does not fit the configured model: "
                        + "; ".join(differ))


def load_llm(model: nn.Module, folder: Path, family: HfFamily) -> None:
    """The folder's language model into ``model.llm_model`` (under LoRA, into its base weights; with trainable token
    rows, into the embedding and head they sit on, the rows then taken from the loaded matrices); embedding rows the
    model's tokenizer added past the folder's vocabulary become the mean of the folder's rows."""
    folders = family.folders
    state = folders.llm_state(read_safetensors(folder, lambda key: key.startswith(folders.llm_prefixes),
                                               "model.pretrained"))
    llm = base_llm(model.llm_model)
    own = _plain_names(llm)
    tied = llm.config.tie_word_embeddings and "lm_head.weight" not in state
    missing = sorted(k for k in own if k not in state and ".lora_" not in k and not k.endswith(".rows")
                     and not (tied and k == "lm_head.weight"))
    unexpected = sorted(k for k in state if k not in own)
    if missing or unexpected:
        raise PartError(f"model.pretrained: {folder}: its language model does not fit the model's LLM: missing "
                        f"{missing[:5]}, unexpected {unexpected[:5]}")
    params = dict(llm.named_parameters())
    placement = current_placement()
    with placement.gathered(list(llm.parameters()), modifier_rank=0), torch.no_grad():
        for key, value in state.items():
            target = params.get(own[key]) if own[key] in params else llm.get_buffer(own[key])
            if target.is_meta:
                continue  # this process receives its shard from process 0 (Rank0Placement)
            rows = value.shape[0]
            if value.shape != target.shape and (value.dim() != 2 or value.shape[1:] != target.shape[1:]
                                                or rows > target.shape[0]):
                raise PartError(f"model.pretrained: {folder}: {key} is {tuple(value.shape)} in the folder, "
                                f"{tuple(target.shape)} in the model's LLM")
            target[:rows].copy_(value)
            if rows < target.shape[0]:  # rows of tokens the model's tokenizer added
                target[rows:] = value.mean(dim=0, keepdim=True).to(target.dtype)
        for module in llm.modules():  # trainable token rows start as the loaded rows, as they start at build
            if isinstance(module, (TokenRowsEmbedding, TokenRowsHead)) and not module.rows.is_meta:
                module.rows.copy_(module.base.weight[module.token_ids].to(module.rows.dtype))
    logger.info("Loaded the language model of %s (%d tensors)", folder, len(state))


def _plain_names(llm: nn.Module) -> dict[str, str]:
    """``{the plain model's key: the LLM's key}``: LoRA's ``q_proj.base_layer.weight`` is ``q_proj.weight``, and
    trainable token rows' ``embed_tokens.base.weight`` is ``embed_tokens.weight`` (their ``rows`` are no folder key)."""
    wrapped = [name for name, module in llm.named_modules() if isinstance(module, (TokenRowsEmbedding, TokenRowsHead))]
    names = {}
    for key in llm.state_dict():
        plain = key.replace(".base_layer.", ".")
        for name in wrapped:
            if plain.startswith(f"{name}.base."):
                plain = f"{name}.{plain.removeprefix(f'{name}.base.')}"
        names[plain] = key
    return names
