"""Published vision-LLM checkpoints into a composed model (``pretrained:`` with ``load_pretrained: true``).

Four formats, told apart by their contents:

- a transformers ``LlavaForConditionalGeneration`` folder: tower, projector and LLM (any layout
  ``models.hf_keys`` reads), plus its tokenizer and the image token its prompts use;
- a transformers ``InstructBlipForConditionalGeneration`` folder: EVA tower, Q-Former with queries,
  projection and LLM, plus its tokenizer and ``qformer_tokenizer/``;
- LAVIS's InstructBLIP ``.pth`` (``blip2_vicuna_instruct``): Q-Former, queries, ``ln_vision``, projection, and
  the ViT when the file has it (LAVIS saves only what trained);
- LLaVA's stage-1 ``mm_projector.bin``: the projector.

A folder brings the settings that come with its weights before the model is built (``settings_from_published``):
its LLM architecture (unless ``llm_model`` names one), its tokenizer (unless ``tokenizer`` or ``llm_model`` names
one), its image token, its Q-Former tokenizer and ``ln_vision`` epsilon. The parts the config chose (tower,
connector, feature layer, query count) are checked against the folder's: what differs is one ``lavis_ds:`` line.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.common.registry import Registry, connectors, vision_towers
from lavis_ds.models.llm import base_llm
from lavis_ds.models.llm_placement import current_placement
from lavis_ds.models.parts import PartError, read_safetensors

logger = logging.getLogger(__name__)

LLAVA, INSTRUCTBLIP = "llava", "instructblip"
CLASS_OF = {LLAVA: "LlavaForConditionalGeneration", INSTRUCTBLIP: "InstructBlipForConditionalGeneration"}
# What model.pretrained takes, for messages.
ACCEPTED = ("a LlavaForConditionalGeneration or InstructBlipForConditionalGeneration folder (save_pretrained), "
            "LAVIS's InstructBLIP .pth, or LLaVA's stage-1 mm_projector.bin")


def folder_kind(path: str | Path) -> str | None:
    """``llava`` / ``instructblip`` for a published folder of that class, None for a file."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    config = folder / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if model_type not in CLASS_OF:
        raise PartError(f"model.pretrained: {folder} is {'a ' + repr(model_type) if model_type else 'not a'} "
                        f"transformers folder{' without config.json' if not config.is_file() else ''}; it takes "
                        f"{ACCEPTED}")
    return model_type


def settings_from_published(section: dict[str, Any]) -> dict[str, Any]:
    """The ``model:`` section (its part sections filled in) with what a published folder fixes (module docstring)."""
    path = section.get("pretrained")
    kind = folder_kind(path) if section.get("load_pretrained") and path else None
    if kind is None:
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
    connector = dict(section.get("connector") or {})
    if kind == INSTRUCTBLIP and connector.get("name") in ("instruct_qformer", "qformer"):  # else check_fit says
        if not connector.get("qformer_tokenizer") and (folder / "qformer_tokenizer").is_dir():
            connector["qformer_tokenizer"] = str(folder / "qformer_tokenizer")
        connector["ln_vision_eps"] = config.vision_config.layer_norm_eps  # transformers' post_layernorm
        section["connector"] = connector
    return section


def load_published(model: nn.Module, path: str) -> None:
    """Load ``path`` (any format of the module docstring) into a composed model's parts, each checked."""
    file = Path(path).expanduser()
    if not file.exists():
        raise PartError(f"model.pretrained: {file} not found; it takes {ACCEPTED}")
    kind = folder_kind(file)
    if kind is not None:
        check_fit(model, file, kind)
        model.vision_tower.load_pretrained(str(file))
        model.connector.load_pretrained(str(file))
        load_llm(model, file)
        return
    from lavis_ds.models.pretrained import _torch_load

    state = _torch_load(file)
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
                        f"(first keys: {keys[:4]}); it takes {ACCEPTED}")


def check_fit(model: nn.Module, folder: Path, kind: str) -> None:
    """One ``PartError`` naming the folder and every setting in which its parts differ from the model's."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    tower, connector = model.vision_tower, model.connector
    differ = []
    want_connector = "mlp2x_gelu" if kind == LLAVA else "instruct_qformer"
    if _name(connectors, connector) != want_connector:
        differ.append(f"connector: the folder's is {want_connector}, the model's {_name(connectors, connector)}")
    vision = config.vision_config
    if kind == LLAVA:
        tower_config = getattr(getattr(tower, "model", None), "config", None)
        if tower_config is None or tower_config.model_type != vision.model_type:
            differ.append(f"vision tower: the folder's is {vision.model_type}, the model's {_name(vision_towers, tower)}")
        else:
            differ += _differences("vision tower", vision, tower_config, ("hidden_size", "num_hidden_layers",
                                   "intermediate_size", "num_attention_heads", "image_size", "patch_size"))
            layer, strategy = config.vision_feature_layer, config.vision_feature_select_strategy
            if (layer, strategy) != (tower.layers, tower.strategy):
                differ.append(f"vision_feature_layer/select_strategy: folder {layer}/{strategy}, model "
                              f"{tower.layers}/{tower.strategy}")
        if not differ and config.image_seq_length != model.tokens_per_image:
            differ.append(f"image tokens per image: folder image_seq_length {config.image_seq_length}, model "
                          f"{model.tokens_per_image}")
    elif not hasattr(tower, "vit"):
        differ.append(f"vision tower: the folder's is eva_vit_g, the model's {_name(vision_towers, tower)}")
    else:
        ours = {"hidden_size": tower.num_features, "num_hidden_layers": len(tower.blocks()),
                "image_size": tower.image_size}
        differ += _differences("vision tower", vision, ours, tuple(ours))
    if hasattr(connector, "query_tokens") and kind == INSTRUCTBLIP:
        ours = {"num_query_tokens": connector.query_tokens.shape[1]}
        differ += _differences("Q-Former", config, ours, ("num_query_tokens",))
        differ += _differences("Q-Former", config.qformer_config, connector.qformer.config,
                               ("hidden_size", "num_hidden_layers", "vocab_size"))
    differ += _differences("LLM", config.text_config, base_llm(model.llm_model).config,
                           ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads"))
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is not None and image_token_id != model.prompt.image_token_id:
        differ.append(f"image token id: folder {image_token_id}, model {model.prompt.image_token_id} "
                      f"({model.prompt.image_token!r})")
    if differ:
        raise PartError(f"model.pretrained: {folder} ({CLASS_OF[kind]}) does not fit the configured model: "
                        + "; ".join(differ))


def _name(kind: Registry, part: nn.Module) -> str:
    """The registered name of a part (its class name if registered under none)."""
    return next((name for name in kind if kind.get(name) is type(part)), type(part).__name__)


def _differences(part: str, theirs: Any, ours: Any, keys: tuple[str, ...]) -> list[str]:
    get = (lambda c, k: c.get(k)) if isinstance(ours, dict) else getattr
    return [f"{part} {key}: folder {getattr(theirs, key, None)}, model {get(ours, key)}" for key in keys
            if getattr(theirs, key, None) != get(ours, key)]


def load_llm(model: nn.Module, folder: Path) -> None:
    """The folder's language model into ``model.llm_model`` (under LoRA, into its base weights); embedding rows the
    model's tokenizer added past the folder's vocabulary become the mean of the folder's rows."""
    from lavis_ds.models import hf_keys

    keep = ("language_model.", "model.language_model.", "lm_head.")
    state = hf_keys.llava_llm(read_safetensors(folder, lambda key: key.startswith(keep), "model.pretrained"))
    llm = base_llm(model.llm_model)
    own = {_plain_name(k): k for k in llm.state_dict()}
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
    logger.info("Loaded the language model of %s (%d tensors)", folder, len(state))


def _plain_name(key: str) -> str:
    """A LoRA-wrapped LLM's key as the plain model names it (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return key.replace(".base_layer.", ".")
