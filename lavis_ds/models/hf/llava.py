"""LLaVA as a transformers class (the ``llava`` family): a CLIP/SigLIP tower + ``mlp2x_gelu`` + LLM as
``LlavaForConditionalGeneration`` + ``LlavaProcessor``; its published folders load into a composed model.

The parts map module for module, not key for key, because the class builds each part with the same
transformers class lavis_ds holds (``AutoModel.from_config`` of the tower's and the LLM's configs):

    vision_tower.model (CLIPVisionModel / SiglipVisionModel)   -> model.vision_tower
    connector.linear_1, connector.linear_2                      -> model.multi_modal_projector.linear_1 / linear_2
    llm_model's base model (Qwen2Model, ...)                    -> model.language_model
    llm_model's output embeddings                               -> lm_head

``save_pretrained`` then writes whatever key layout the installed transformers writes (``models.hf_keys`` reads them
all back: ``tower_state``, the projector's ``load_pretrained``, ``llm_state``).
The tower's feature selection becomes ``vision_feature_layer`` / ``vision_feature_select_strategy``, its
tokens per image ``image_seq_length``, the connector's activation ``projector_hidden_act``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.hf.family import (TORCHVISION_BACKEND_NOTE, HfFamily, State, differences, image_processor_settings,
                                      llm_problems, part_name)
from lavis_ds.models.hf.family_parts import FolderReading, ProcessorExport, WeightsExport
from lavis_ds.models.llm import base_llm
from lavis_ds.models.llm_placement import empty_weights

# ACT2FN names tried for a connector that does not record its activation's name.
COMMON_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu", "silu", "relu")


def projector_act_name(connector: nn.Module) -> str | None:
    """The ACT2FN name of the connector's activation (the ``projector_hidden_act`` it was built with)."""
    from transformers.activations import ACT2FN

    name = getattr(connector, "projector_hidden_act", None)
    if name is not None:
        return name
    # A connector that does not record its name: the common ACT2FN entry that builds the same module.
    act = connector.act
    return next((n for n in COMMON_ACTIVATIONS if type(ACT2FN[n]) is type(act) and repr(ACT2FN[n]) == repr(act)), None)


def llava_config(model: nn.Module, dtype: torch.dtype):
    """The LlavaConfig of a composed clip/siglip + mlp2x_gelu model (checked by export_hf_checks)."""
    from transformers import LlavaConfig

    tower, connector, llm = model.vision_tower, model.connector, base_llm(model.llm_model)
    # generate reads its stop and pad ids from the generation config built from text_config too.
    text = llm.config.to_dict() | {"eos_token_id": model.llm.stop_token_ids(), "pad_token_id": model.llm.pad_id}
    config = LlavaConfig(vision_config=tower.model.config.to_dict(), text_config=text,
                         image_token_index=model.llm.prompt.image_token_id, image_seq_length=tower.num_tokens,
                         projector_hidden_act=projector_act_name(connector),
                         vision_feature_select_strategy=tower.strategy, vision_feature_layer=tower.layers,
                         multimodal_projector_bias=connector.linear_1.bias is not None,
                         tie_word_embeddings=bool(llm.config.tie_word_embeddings))
    config.dtype = dtype
    for sub in (config.vision_config, config.text_config):
        sub.dtype = dtype
    return config


def to_hf_model(model: nn.Module, dtype: torch.dtype):
    """A LlavaForConditionalGeneration holding ``model``'s weights in ``dtype``, every parameter accounted for."""
    from transformers import LlavaForConditionalGeneration

    with empty_weights():  # parameters on the meta device: every one is assigned from `model` below
        hf_model = LlavaForConditionalGeneration(llava_config(model, dtype))
    llm = base_llm(model.llm_model)
    decoder = getattr(llm, llm.base_model_prefix)
    connector = model.connector
    pairs = [(hf_model.model.vision_tower, model.vision_tower.model),
             (hf_model.model.multi_modal_projector.linear_1, connector.linear_1),
             (hf_model.model.multi_modal_projector.linear_2, connector.linear_2),
             (hf_model.model.language_model, decoder),
             (hf_model.lm_head, llm.get_output_embeddings())]
    for theirs, ours in pairs:
        state = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in ours.state_dict().items()}
        theirs.load_state_dict(state, strict=True, assign=True)  # strict: the classes agree key for key
    if hf_model.config.tie_word_embeddings:
        hf_model.tie_weights()
    left = [name for name, p in hf_model.named_parameters() if p.is_meta]
    if left:  # the module pairs above and transformers' class disagree: a bug here, not the user's
        raise RuntimeError(f"LlavaForConditionalGeneration parameters left unassigned: {left[:8]}")
    return hf_model.eval()


def llava_problems(model: nn.Module) -> list[str]:
    """transformers builds the tower and the LLM's base model with AutoModel from their configs, and computes the
    logits as ``lm_head(hidden states)``; the projector's activation is an ACT2FN name."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    problems = []
    tower_model = model.vision_tower.model
    if MODEL_MAPPING.get(type(tower_model.config), None) is not type(tower_model):
        problems.append(f"vision_tower.model: {type(tower_model).__name__}, which AutoModel does not build from its "
                        f"config ({type(tower_model.config).__name__})")
    connector = model.connector
    if projector_act_name(connector) is None:
        problems.append(f"connector.act: {connector.act!r} is no transformers ACT2FN activation (projector_hidden_act)")
    if (connector.linear_1.bias is None) != (connector.linear_2.bias is None):
        problems.append("connector: one linear layer with a bias and one without; multimodal_projector_bias is one "
                        "setting for both")
    llm = base_llm(model.llm_model)
    decoder = getattr(llm, getattr(llm, "base_model_prefix", ""), None)
    if decoder is None or MODEL_MAPPING.get(type(llm.config), None) is not type(decoder):
        problems.append(f"llm_model: {type(llm).__name__}, whose base model AutoModel (what LlavaConfig's text_config "
                        "is built with) does not build as the same class")
    head = llm.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        problems.append(f"llm_model's output layer: {head!r}; LLaVA's lm_head is a Linear without bias")
    softcap, scale = getattr(llm.config, "final_logit_softcapping", None), getattr(llm.config, "logit_scale", None)
    if softcap or (scale is not None and scale != 1):
        problems.append(f"llm_model: its logits are {'soft-capped' if softcap else f'scaled by {scale}'} after "
                        "lm_head; LlavaForConditionalGeneration computes lm_head(hidden states) only")
    return problems + llm_problems(model.llm_model, "LlavaConfig's text_config")


class LlavaWeights(WeightsExport):
    def export_problems(self, model: nn.Module) -> list[str]:
        return llava_problems(model)

    def to_hf_model(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:
        return to_hf_model(model, dtype)


class LlavaProcessors(ProcessorExport):
    def image_processor(self, processing):
        """LLaVA-1.5's pad-to-square is ``LlavaImageProcessor``'s ``do_pad`` (the mean colour ``int(x * 255)``, the
        image centred, as LLaVA's ``expand2square``); otherwise CLIP's processor (``shortest_edge`` resize + centre
        crop) or SigLIP's (square resize)."""
        from transformers import CLIPImageProcessorPil, LlavaImageProcessorPil, SiglipImageProcessorPil

        size, common = processing.size, image_processor_settings(processing)
        square = dict(size={"height": size, "width": size})
        if processing.resize == "shortest_edge":
            common |= dict(size={"shortest_edge": size}, do_center_crop=True, crop_size={"height": size, "width": size})
            if processing.pad_to_square:
                return LlavaImageProcessorPil(do_pad=True, **common)
            return CLIPImageProcessorPil(**common)
        if processing.pad_to_square:
            return LlavaImageProcessorPil(do_pad=True, do_center_crop=False, **common, **square)
        return SiglipImageProcessorPil(**common, **square)

    def one_call_notes(self, model: nn.Module) -> list[str]:
        return [TORCHVISION_BACKEND_NOTE]

    def template_image_tokens(self, model: nn.Module) -> int:
        return 1  # LlavaProcessor expands each image token into the tower's tokens per image, as vLLM does too

    def processor(self, model: nn.Module, image_processor, tokenizer, template: str):
        from transformers import LlavaProcessor

        tower = model.vision_tower
        return LlavaProcessor(image_processor, tokenizer, patch_size=tower.model.config.patch_size,
                              vision_feature_select_strategy=tower.strategy, chat_template=template,
                              image_token=model.llm.prompt.image_token, num_additional_image_tokens=int(tower.HAS_CLS))


class LlavaFolders(FolderReading):
    reads_published = True
    tower_prefixes = ("vision_tower.", "model.vision_tower.")

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        """The connector, the tower's class and size, its feature selection, the image tokens per image."""
        tower, vision = model.vision_tower, config.vision_config
        differ = self.connector_problems(model)
        tower_config = getattr(getattr(tower, "model", None), "config", None)
        if tower_config is None or tower_config.model_type != vision.model_type:
            differ.append(f"vision tower: the folder's is {vision.model_type}, the model's "
                          f"{part_name(tower, reg.vision_towers)}")
            return differ
        differ += differences("vision tower", vision, tower_config, ("hidden_size", "num_hidden_layers",
                              "intermediate_size", "num_attention_heads", "image_size", "patch_size"))
        layer, strategy = config.vision_feature_layer, config.vision_feature_select_strategy
        if (layer, strategy) != (tower.layers, tower.strategy):
            differ.append(f"vision_feature_layer/select_strategy: folder {layer}/{strategy}, model "
                          f"{tower.layers}/{tower.strategy}")
        if not differ and config.image_seq_length != model.image_path.layout.tokens_per_image:
            differ.append(f"image tokens per image: folder image_seq_length {config.image_seq_length}, model "
                          f"{model.image_path.layout.tokens_per_image}")
        return differ

    def tower_state(self, state: State) -> dict[str, torch.Tensor]:
        from lavis_ds.models import hf_keys

        return hf_keys.llava_tower(state)


class LlavaFamily(HfFamily):
    """``LlavaForConditionalGeneration`` + ``LlavaProcessor``: a ``clip`` or ``siglip`` tower + ``mlp2x_gelu``."""

    hf_class, model_type = "LlavaForConditionalGeneration", "llava"
    pairs = (("clip", "mlp2x_gelu"), ("siglip", "mlp2x_gelu"))
    exportable = "a clip or siglip tower + mlp2x_gelu"
    why_not = {"linear": "LlavaConfig's projector is always linear_1 -> projector_hidden_act -> linear_2, two layers: "
                         "a single linear connector has no place in it"}

    def __init__(self):
        super().__init__(LlavaWeights, LlavaProcessors, LlavaFolders)


reg.hf_families.register("llava")(LlavaFamily())
