"""BLIP-2 and InstructBLIP as transformers classes: EVA ViT + ``ln_vision`` + Q-Former + queries + projection + LLM.

Two registered families (``blip2``, ``instructblip``). Both classes hold the same parts under the same names
(``vision_model`` with ``post_layernorm``, ``qformer``, ``query_tokens``, ``language_projection``,
``language_model`` built by ``AutoModelForCausalLM``); InstructBLIP's Q-Former also embeds the instruction's BERT
tokens, and its processor carries that BERT tokenizer (``qformer_tokenizer/``). :class:`BlipParts` names those parts
in a lavis_ds model: its ``vision_tower`` (``eva_vit_g``) and ``connector`` (``qformer`` / ``instruct_qformer``).

The key mapping (ours -> Hugging Face) is the inverse of the one ``lavis_ds.models.pretrained`` reads Hugging
Face BLIP-2 folders with: the timm EVA ViT becomes ``vision_model`` (its q/v biases one ``qkv.bias`` with a zero
k part), ``ln_vision`` its ``post_layernorm``; ``qformer`` and ``query_tokens`` keep their names (lavis_ds uses
transformers' Q-Formers); ``llm_proj`` becomes ``language_projection``, the LLM ``language_model``. Reading a
published InstructBLIP folder back: ``models.hf_keys`` (the tower and connector read their own keys).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.hf.blip_checks import activation_name, norm_problems, vit_problems
from lavis_ds.models.hf.blip_instruction import instruction_tokenizer, undeclare_image_token
from lavis_ds.models.hf.family import (TORCHVISION_BACKEND_NOTE, HfFamily, differences, image_processor_settings,
                                      llm_problems, part_name)
from lavis_ds.models.hf.family_parts import FolderReading, ProcessorExport, WeightsExport
from lavis_ds.models.llm_placement import empty_weights
from lavis_ds.models.pretrained import rename_key  # one renamer for both directions

# Ours -> Hugging Face, the inverse of pretrained.HF_RENAMES (a test checks that they agree). The q/v
# biases are not renamed but fused into qkv.bias, see `vision_state_dict`.
VISION_RENAMES = (
    (r"cls_token$", "embeddings.class_embedding"),
    (r"pos_embed$", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"blocks\.(\d+)\.norm([12])\.", r"encoder.layers.\1.layer_norm\2."),
    (r"blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
)


@dataclass(frozen=True)
class BlipParts:
    """A BLIP-family model's parts, and the names its messages give them (``vision_tower.vit``, ...)."""

    vit: nn.Module
    ln_vision: nn.Module
    qformer: nn.Module
    query_tokens: nn.Parameter
    llm_proj: nn.Linear
    llm: nn.Module
    vit_name: str = "vision_tower.vit"
    ln_name: str = "connector.ln_vision"
    proj_name: str = "connector.llm_proj"

    @classmethod
    def of(cls, model: nn.Module) -> "BlipParts":
        """The parts of an eva_vit_g + Q-Former architecture (``blip2_qwen``, ``instructblip``, ...)."""
        tower, connector = model.vision_tower, model.connector
        return cls(tower.vit, connector.ln_vision, connector.qformer, connector.query_tokens, connector.llm_proj,
                   model.llm_model)


def vision_config(vit: nn.Module) -> dict:
    """Blip2VisionConfig / InstructBlipVisionConfig arguments of a timm EVA ViT (checked by ``vit_problems``)."""
    block = vit.blocks[0]
    return {"hidden_size": vit.embed_dim, "intermediate_size": block.mlp.fc1.out_features,
            "num_hidden_layers": len(vit.blocks), "num_attention_heads": block.attn.num_heads,
            "image_size": vit.patch_embed.img_size[0], "patch_size": vit.patch_embed.patch_size[0],
            "hidden_act": activation_name(block.mlp.act), "layer_norm_eps": block.norm1.eps,
            "qkv_bias": block.attn.q_bias is not None}


def blip_config(model: nn.Module, dtype: torch.dtype, config_class: type):
    """The Blip2Config (or InstructBlipConfig) of ``model``: the LLM's own config as text_config, the image token's
    id as image_token_index."""
    parts = BlipParts.of(model)
    # The LLM's generate reads its stop and pad ids from text_config (see export_hf_processor.generation_config).
    text = parts.llm.config.to_dict() | {"eos_token_id": model.llm.stop_token_ids(), "pad_token_id": model.llm.pad_id}
    config = config_class(vision_config=vision_config(parts.vit), qformer_config=parts.qformer.config.to_dict(),
                          text_config=text, num_query_tokens=parts.query_tokens.shape[1],
                          image_token_index=model.llm.prompt.image_token_id)
    config.dtype = dtype
    for sub in (config.vision_config, config.qformer_config, config.text_config):
        sub.dtype = dtype
    return config


def to_hf_model(model: nn.Module, dtype: torch.dtype, hf_class: type, config_class: type):
    """An ``hf_class`` (Blip2ForConditionalGeneration, InstructBlipForConditionalGeneration) holding ``model``'s
    weights in ``dtype``, every key accounted for."""
    # Parameters on the meta device: they come from `model`, so no memory and no time for a random init.
    # Buffers stay real: rotary tables are computed at construction and are in no state dict.
    with empty_weights():
        hf_model = hf_class(blip_config(model, dtype, config_class))
    state = {name: tensor.detach().to(dtype) for name, tensor in hf_state_dict(BlipParts.of(model)).items()}
    expected = set(hf_model.state_dict())
    missing, unknown = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unknown:  # the mapping and transformers' class disagree: a bug here, not the user's
        raise RuntimeError(f"key mapping to {hf_class.__name__}: missing {missing[:8]}, unknown {unknown[:8]}")
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()  # a text_config with tie_word_embeddings shares one matrix again
    return hf_model.eval()


def hf_state_dict(parts: BlipParts) -> dict[str, torch.Tensor]:
    """The parts' weights under Blip2ForConditionalGeneration's (and InstructBLIP's) names."""
    state = {f"vision_model.{k}": v for k, v in vision_state_dict(parts.vit).items()}
    state |= {f"vision_model.post_layernorm.{k}": v for k, v in parts.ln_vision.state_dict().items()}
    # position_ids: a buffer InstructBLIP's Q-Former embeddings hold, in no transformers state dict.
    state |= {f"qformer.{k}": v for k, v in parts.qformer.state_dict().items() if not k.endswith("position_ids")}
    state["query_tokens"] = parts.query_tokens
    state |= {f"language_projection.{k}": v for k, v in parts.llm_proj.state_dict().items()}
    state |= {f"language_model.{k}": v for k, v in parts.llm.state_dict().items()}
    return state


def vision_state_dict(vit: nn.Module) -> dict[str, torch.Tensor]:
    """The EVA ViT's weights under Blip2VisionModel's names (without ``post_layernorm``: that is ln_vision).

    timm keeps EVA's q and v biases as parameters and a zero k bias as a buffer; Blip2Attention has one
    qkv bias of [q, k, v], built the same way, so the three are concatenated in that order.
    """
    state = {}
    for key, value in vit.state_dict().items():
        if re.search(r"\.attn\.[qkv]_bias$", key):
            continue
        new = rename_key(key, VISION_RENAMES)
        if new == key:
            raise RuntimeError(f"vision_tower.vit.{key}: no Blip2VisionModel name for it")  # checked layout: a bug
        state[new] = value
    for i, block in enumerate(vit.blocks):
        attn = block.attn
        if attn.q_bias is not None:
            k_bias = attn.k_bias if attn.k_bias is not None else torch.zeros_like(attn.q_bias)
            bias = torch.cat((attn.q_bias, k_bias.to(attn.q_bias.dtype), attn.v_bias))
            state[f"encoder.layers.{i}.self_attn.qkv.bias"] = bias
    return state


def ln_vision_note(parts: BlipParts) -> list[str]:
    """The one difference no weight carries: ``ln_vision``'s eps against the ViT blocks' (one eps in HF's config)."""
    vit_eps, ln_eps = parts.vit.blocks[0].norm1.eps, parts.ln_vision.eps
    if vit_eps == ln_eps:
        return []
    # Blip2VisionConfig has one layer_norm_eps for the blocks and post_layernorm; BLIP-2's ln_vision is torch's
    # default 1e-5, EVA's blocks 1e-6. transformers' script that converted LAVIS's BLIP-2 maps ln_vision onto
    # post_layernorm the same way. Not refused: every LAVIS BLIP-2 model has it.
    return [f"{parts.ln_name}'s LayerNorm eps {ln_eps:g} becomes post_layernorm with the ViT blocks' eps "
            f"{vit_eps:g} (the vision config has one layer_norm_eps): each image feature changes by a factor "
            f"sqrt((v + {ln_eps:g}) / (v + {vit_eps:g})), about {abs(ln_eps - vit_eps) / 2:g} / v relative, v being "
            "its token's feature variance"]


# ----------------------------------------------------------------------------- the families' parts
class BlipWeights(WeightsExport):
    """The class's model and config (``Blip2ForConditionalGeneration`` / ``Blip2Config``, InstructBLIP's alike)."""

    def classes(self) -> tuple[type, type]:
        """The transformers model and config classes."""
        import transformers

        hf_class = self.family.hf_class
        return (getattr(transformers, hf_class),
                getattr(transformers, hf_class.replace("ForConditionalGeneration", "Config")))

    def export_problems(self, model: nn.Module) -> list[str]:
        """The EVA layout, LayerNorms, the LLM class, the projection's bias."""
        parts = BlipParts.of(model)
        problems = (vit_problems(parts.vit, parts.vit_name) + norm_problems(parts.ln_name, parts.ln_vision)
                    + llm_problems(parts.llm, f"{self.classes()[1].__name__}'s text_config"))
        if parts.llm_proj.bias is None:
            problems.append(f"{parts.proj_name} has no bias; language_projection has one")
        return problems

    def to_hf_model(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:
        return to_hf_model(model, dtype, *self.classes())

    def export_notes(self, model: nn.Module, dtype: torch.dtype) -> list[str]:
        return ln_vision_note(BlipParts.of(model))


class Blip2Processors(ProcessorExport):
    square_images_only = True  # BlipImageProcessor: a square resize, no crop, no padding
    processor_keeps_chat_template = False  # Blip2Processor's __init__ drops it; the tokenizer keeps it

    def one_call_notes(self, model: nn.Module) -> list[str]:
        return ["`processor.apply_chat_template` fails (\"this processor does not have a chat template\"): the "
                "processor class drops the template it is saved with; `processor.tokenizer.apply_chat_template` "
                "renders it",
                "`model.generate(**inputs)` without `generation_config=model.generation_config` generates with the "
                "language model's own settings (the class hands over to `model.language_model.generate`): "
                "transformers' default of 20 new tokens, the image token not suppressed; pass `max_new_tokens=` "
                "or the folder's generation config",
                TORCHVISION_BACKEND_NOTE]

    def image_processor(self, processing):
        """``BlipImageProcessor``: the square resize ``export_problems`` and the image checks allow."""
        from transformers import BlipImageProcessorPil

        size = processing.size
        return BlipImageProcessorPil(**image_processor_settings(processing), size={"height": size, "width": size})

    def processor(self, model: nn.Module, image_processor, tokenizer, template: str):
        from transformers import Blip2Processor

        # num_query_tokens=None: the processor then adds no image tokens of its own (BLIP-2's OPT layout puts
        # them in front of everything); the chat template writes them where lavis_ds's prompt has them.
        return Blip2Processor(image_processor, tokenizer, num_query_tokens=None, chat_template=template)


class InstructBlipProcessors(Blip2Processors):
    """``InstructBlipProcessor`` with the Q-Former's BERT tokenizer (``qformer_tokenizer/``)."""

    def processor(self, model: nn.Module, image_processor, tokenizer, template: str):
        from transformers import AutoTokenizer, InstructBlipProcessor

        connector = model.connector
        # LAVIS's settings, which lavis_ds's connector uses: truncate on the left at max_instruction_len.
        bert = AutoTokenizer.from_pretrained(connector.qformer_tokenizer_path, truncation_side="left",
                                             model_max_length=connector.max_instruction_len)
        # The processor gives the Q-Former the whole prompt: this one reads the image's user turn out of it.
        qformer_tokenizer = instruction_tokenizer(bert, model.llm.prompt.image_token)
        # num_query_tokens=0: the template writes the image tokens where lavis_ds's prompt has them, and the
        # processor prepends none (None, as for BLIP-2, fails in InstructBlipProcessor's call).
        return InstructBlipProcessor(image_processor, tokenizer, qformer_tokenizer, num_query_tokens=0,
                                     chat_template=template)

    def one_call_notes(self, model: nn.Module) -> list[str]:
        connector = model.connector
        notes = super().one_call_notes(model) + [
            "the Q-Former reads the words of the first user turn that holds an image, its image markup removed, "
            f"truncated on the left at {connector.max_instruction_len} tokens, as in training: the tokenizer under "
            "`qformer_tokenizer/` cuts that turn out of the whole prompt the processor hands it",
            "one image per prompt: the processor gives the Q-Former one instruction per prompt, lavis_ds one per "
            "image; for several images in a prompt pass `qformer_input_ids` with one row per image (docs/export-hf.md)",
            "a batch of prompts: the processor pads the Q-Former's instructions on the side the LLM's tokenizer pads "
            "(the left), lavis_ds on the right, which moves the Q-Former's positions where instructions differ in "
            "length; one prompt per call (lmms-eval's default `batch_size=1`) is exact",
            "the processor adds a token `<image>` of its own to the tokenizer it loads (it writes none: "
            "`num_query_tokens` is 0); a prompt holding the text `<image>` gets an id outside the trained vocabulary"]
        if model.llm.prompt.record_system_prompt == "fold":
            notes.append("a system message is folded into the first user turn (`record_system_prompt: fold`), so "
                         "the Q-Former reads its text too; in training it reads the turn's own words only")
        return notes

    def finish_processor_folder(self, model: nn.Module, folder: Path) -> None:
        undeclare_image_token(folder)  # the processor's call reads a declared one as an AddedToken (blip_instruction)


class InstructBlipFolders(FolderReading):
    """A published folder loads into a composed model (tower, Q-Former with queries, projection, LLM) and brings the
    Q-Former tokenizer and ``ln_vision`` eps."""

    reads_published = True

    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """The folder's ``qformer_tokenizer/`` (unless the section names one) and its ``post_layernorm`` eps as the
        connector's ``ln_vision_eps``; for a Q-Former connector only (another one: ``fit_problems`` says)."""
        connector = dict(section.get("connector") or {})
        if connector.get("name") not in ("instruct_qformer", "qformer"):
            return section
        if not connector.get("qformer_tokenizer") and (folder / "qformer_tokenizer").is_dir():
            connector["qformer_tokenizer"] = str(folder / "qformer_tokenizer")
        connector["ln_vision_eps"] = config.vision_config.layer_norm_eps  # transformers' post_layernorm
        return {**section, "connector": connector}

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        """The connector, the EVA tower's width, depth and image size, the Q-Former's queries and size."""
        tower, connector = model.vision_tower, model.connector
        differ = self.connector_problems(model)
        if not hasattr(tower, "vit"):
            differ.append(f"vision tower: the folder's is eva_vit_g, the model's {part_name(tower, reg.vision_towers)}")
        else:
            ours = {"hidden_size": tower.num_features, "num_hidden_layers": len(tower.blocks()),
                    "image_size": tower.image_size}
            differ += differences("vision tower", config.vision_config, ours, tuple(ours))
        if hasattr(connector, "query_tokens"):
            differ += differences("Q-Former", config, {"num_query_tokens": connector.query_tokens.shape[1]},
                                  ("num_query_tokens",))
            differ += differences("Q-Former", config.qformer_config, connector.qformer.config,
                                  ("hidden_size", "num_hidden_layers", "vocab_size"))
        return differ


# ----------------------------------------------------------------------------- the families
class Blip2Family(HfFamily):
    """``Blip2ForConditionalGeneration`` + ``Blip2Processor``: an ``eva_vit_g`` + ``qformer`` (``blip2_qwen``)."""

    hf_class, model_type = "Blip2ForConditionalGeneration", "blip-2"
    pairs = (("eva_vit_g", "qformer"),)
    exportable = "eva_vit_g + qformer (blip2_qwen)"

    def __init__(self):
        super().__init__(BlipWeights, Blip2Processors, FolderReading)  # its folders load into no composed model


class InstructBlipFamily(HfFamily):
    """``InstructBlipForConditionalGeneration`` + ``InstructBlipProcessor`` (the Q-Former's BERT tokenizer under
    ``qformer_tokenizer/``): an ``eva_vit_g`` + ``instruct_qformer``. Its published folders load into a composed
    model."""

    hf_class, model_type = "InstructBlipForConditionalGeneration", "instructblip"
    pairs = (("eva_vit_g", "instruct_qformer"),)
    exportable = "eva_vit_g + instruct_qformer"

    def __init__(self):
        super().__init__(BlipWeights, InstructBlipProcessors, InstructBlipFolders)


reg.hf_families.register("blip2")(Blip2Family())
reg.hf_families.register("instructblip")(InstructBlipFamily())
