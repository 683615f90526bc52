"""Qwen2-VL and Qwen2.5-VL as transformers classes (the ``qwen2_vl`` and ``qwen2_5_vl`` families): their published
folders load into the ``qwen2_vl`` / ``qwen2_5_vl`` architectures, part for part.

    visual.* (without merger)            <- vision_tower (``towers.qwen_vl``: transformers' names)
    visual.merger.*                      <- connector (``patch_merger``: ``ln_q``, ``mlp.0``, ``mlp.2``)
    model.* (embed_tokens, layers, norm) <- llm_model.model (``qwen_vl_text``: the text model alone)
    lm_head.*                            <- llm_model.lm_head

A folder may hold them as the Hub's files do (``visual.*``, ``model.layers.*``) or as transformers 5 names the
modules (``model.visual.*``, ``model.language_model.*``); both are read. A folder brings its vision config (the
tower's architecture), its processor's ``min_pixels`` / ``max_pixels``, its text config (with the top level's
``tie_word_embeddings``), its tokenizer and image token; its chat template must write the family's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``), which lavis_ds's prompt writes around each image.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.hf.family import HfFamily, State, differences, part_name
from lavis_ds.models.hf.family_parts import FolderReading, ProcessorExport, WeightsExport
from lavis_ds.models.parts import PartError

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
VIDEO_TOKEN = "<|video_pad|>"
# The text model's keys in the two layouts: the Hub's (model.layers.*) and transformers 5's (model.language_model.*).
TEXT_PREFIXES = ("model.language_model.", "model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")


class QwenVLWeights(WeightsExport):
    """The class holding the tower and merger as ``model.visual``, the text model and its head."""

    def export_problems(self, model: nn.Module) -> list[str]:
        """The class builds the text model of its own kind, with ``lm_head(hidden states)`` on top, and its
        processor needs the vision tokens as single tokens of the tokenizer."""
        from lavis_ds.models.llm import base_llm

        hf_class = self.family.hf_class
        llm = base_llm(model.llm_model)
        problems = []
        wanted = f"{self.family.model_type}_text"
        if getattr(llm.config, "model_type", None) != wanted:
            problems.append(f"llm_model: {type(llm).__name__} (model_type {getattr(llm.config, 'model_type', None)!r})"
                            f"; {hf_class} holds the {wanted} text model (llm_config: {{model_type: {wanted}}})")
        head = llm.get_output_embeddings()
        if type(head) is not nn.Linear or head.bias is not None:
            problems.append(f"llm_model's output layer: {head!r}; {hf_class}'s lm_head is a Linear without bias")
        tokenizer = model.llm.tokenizer
        missing = [t for t in (*VISION_TOKENS, VIDEO_TOKEN) if tokenizer.convert_tokens_to_ids(t) in
                   (None, tokenizer.unk_token_id)]
        if missing:
            problems.append(f"the tokenizer lacks {', '.join(missing)}, which {hf_class}'s processor writes")
        return problems

    def to_hf_model(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:
        """The class holding the tower and merger as ``model.visual``, the text model and head; strict per part."""
        import transformers

        from lavis_ds.models.llm import base_llm
        from lavis_ds.models.llm_placement import empty_weights

        llm = base_llm(model.llm_model)
        with empty_weights():  # parameters on the meta device: every one is assigned below
            hf_model = getattr(transformers, self.family.hf_class)(self.hf_config(model, dtype))
        visual = {**model.vision_tower.state_dict(), **self.merger_state(model.connector)}
        pairs = [(hf_model.model.visual, visual), (hf_model.model.language_model, llm.model.state_dict()),
                 (hf_model.lm_head, llm.lm_head.state_dict())]
        for module, state in pairs:
            state = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            module.load_state_dict(state, strict=True, assign=True)
        if hf_model.config.tie_word_embeddings:
            hf_model.tie_weights()
        left = [name for name, p in hf_model.named_parameters() if p.is_meta]
        if left:  # the parts above and transformers' class disagree: a bug here, not the user's
            raise RuntimeError(f"{self.family.hf_class} parameters left unassigned: {left[:8]}")
        return hf_model.eval()

    def hf_config(self, model: nn.Module, dtype: torch.dtype):
        """The class's config: the tower's vision config (its output width the LLM's), the text model's config with
        the stop and pad ids, the vision token ids."""
        import transformers

        from lavis_ds.models.llm import base_llm

        llm, tokenizer = base_llm(model.llm_model), model.llm.tokenizer
        vision = self.hf_vision_config(model)
        vision[self.family.out_width_key] = llm.config.hidden_size
        text = llm.config.to_dict() | {"eos_token_id": model.llm.stop_token_ids(), "pad_token_id": model.llm.pad_id}
        ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in (
            ("image_token_id", model.llm.prompt.image_token), ("video_token_id", VIDEO_TOKEN),
            ("vision_start_token_id", VISION_TOKENS[0]), ("vision_end_token_id", VISION_TOKENS[2]))}
        config_class = getattr(transformers, self.family.hf_class.replace("ForConditionalGeneration", "Config"))
        config = config_class(vision_config=vision, text_config=text,
                              tie_word_embeddings=bool(getattr(llm.config, "tie_word_embeddings", False)), **ids)
        config.dtype = dtype
        for sub in (config.vision_config, config.text_config):
            sub.dtype = dtype
        return config

    def hf_vision_config(self, model: nn.Module) -> dict[str, Any]:
        """The class's vision config as a dict: the tower's own config."""
        return model.vision_tower.config.to_dict()

    def merger_state(self, connector: nn.Module) -> dict[str, torch.Tensor]:
        """The connector's weights as the class's ``model.visual`` names them (``merger.*``; Qwen3-VL's differ)."""
        return {f"merger.{k}": v for k, v in connector.state_dict().items()}


class QwenVLProcessors(ProcessorExport):
    """The class's processor: Qwen2-VL's image and video processors with the tower's processing, the vision span
    written by the chat template and expanded by the processor."""

    def image_processor(self, processing):
        """``Qwen2VLImageProcessor`` (torchvision backend, as ``lavis_ds.processors.qwen_vl`` reproduces it) with the
        tower's pixel bounds, mean, std and patch sizes."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(**processor_settings(processing))

    def template_image_tokens(self, model: nn.Module) -> int:
        return 1  # the processor expands each <|image_pad|> into the image's tokens_for_grid

    def template_image_run(self, model: nn.Module) -> str:
        return VISION_TOKENS[0] + model.llm.prompt.image_token + VISION_TOKENS[2]

    def template_video_run(self, model: nn.Module) -> str:
        return VISION_TOKENS[0] + VIDEO_TOKEN + VISION_TOKENS[2]  # expanded by the processor into the video's tokens

    def processor(self, model: nn.Module, image_processor, tokenizer, template: str):
        import transformers
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        processing = model.vision_tower.processing
        processor_class = getattr(transformers, self.family.hf_class.replace("ForConditionalGeneration", "Processor"))
        return processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                               video_processor=Qwen2VLVideoProcessor(**processor_settings(processing)))

    def check_exported_processor(self, model: nn.Module, out: Path, processing) -> None:
        """The processor read back from ``out`` reserves training's placeholder count for images of a sweep of sizes
        (``qwen_vl_sweep``)."""
        from transformers import AutoProcessor

        from lavis_ds.models.hf.qwen_vl_sweep import check_placeholder_sweep

        check_placeholder_sweep(AutoProcessor.from_pretrained(out), processing, str(out))


class QwenVLFolders(FolderReading):
    """A published folder into the family's architecture: its vision config, pixel bounds, tied head, the merger's
    settings; the text model's keys in both layouts."""

    reads_published = True
    tower_prefixes = ("visual.", "model.visual.")
    llm_prefixes = TEXT_PREFIXES

    def published_settings(self, section: dict[str, Any], folder: Path, config: Any) -> dict[str, Any]:
        """The tower's architecture and pixel bounds, the text model's tied head; the architecture's tower and the
        chat template's vision tokens checked."""
        family = self.family
        tower = dict(section.get("vision_tower") or {})
        if tower.get("name") != family.tower:
            raise PartError(f"model.pretrained: {folder} is a {family.hf_class} folder (config.json model_type "
                            f"{family.model_type!r}), but the model's vision tower is {tower.get('name')!r}; load it "
                            f"with model.arch: {family.tower} ({family.exportable})")
        own = vision_keys(config.vision_config, reg.vision_towers.get(family.tower).SPEC.config_keys())
        tower["vision_config"] = {**own, **(tower.get("vision_config") or {})}
        # The folder's processor bounds where the section sets none (a smaller max_pixels saves memory: the user's).
        tower.update({k: v for k, v in pixel_bounds(folder).items() if tower.get(k) is None})
        connector = {**(section.get("connector") or {}), **self.connector_settings(config)}
        section = {**section, "vision_tower": tower, "connector": connector}
        if isinstance(section.get("llm_config"), dict):
            section["llm_config"] = {**section["llm_config"],
                                     "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}
        check_template(section.get("tokenizer") or section.get("llm_model"), folder)
        return section

    def fit_problems(self, model: nn.Module, config: Any) -> list[str]:
        """The tower kind and architecture, the merger's norm and widths."""
        tower = model.vision_tower
        name = part_name(tower, reg.vision_towers)
        if name != self.family.tower:
            return [f"vision tower: the folder's is {self.family.tower}, the model's {name}"]
        differ = self.connector_problems(model)
        ours = tower.config.to_dict()
        keys = tuple(k for k in vision_keys(config.vision_config, type(tower).SPEC.config_keys()) if k in ours)
        differ += differences("vision tower", config.vision_config, ours, keys)
        return differ + self.merger_problems(model, config)

    def connector_settings(self, config: Any) -> dict[str, Any]:
        """What a folder fixes of the connector's section: the patch_merger's norm (Qwen3-VL's merger differs)."""
        return {"norm": self.family.norm}

    def merger_problems(self, model: nn.Module, config: Any) -> list[str]:
        """The patch_merger's norm against the folder's."""
        norm, wanted = type(model.connector.ln_q).__name__.lower(), self.family.norm
        return [] if norm == wanted else [f"patch_merger norm: folder {wanted}, model {norm}"]

    def llm_state(self, state: State) -> dict[str, torch.Tensor]:
        """The text model's keys as ``qwen_vl_text``'s causal LM names them (``model.*``, ``lm_head.*``)."""
        return {("model." + key.removeprefix("model.language_model.") if key.startswith("model.language_model.")
                 else key): value for key, value in state.items()}


class QwenVLFamily(HfFamily):
    """A ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` folder; the subclasses below
    are data only."""

    tower: str = ""  # the registry name of the tower (and the architecture) its folders need
    norm: str = ""  # the patch_merger's norm
    out_width_key = "hidden_size"  # the vision config's key of the merger's output width (the LLM's)

    def __init__(self, weights: type[QwenVLWeights] = QwenVLWeights,
                 processors: type[QwenVLProcessors] = QwenVLProcessors, folders: type[QwenVLFolders] = QwenVLFolders):
        super().__init__(weights, processors, folders)


def processor_settings(processing) -> dict[str, Any]:
    """A ``QwenVLProcessing`` as transformers' Qwen2-VL image and video processors' keyword arguments."""
    return dict(min_pixels=processing.min_pixels, max_pixels=processing.max_pixels, image_mean=list(processing.mean),
                image_std=list(processing.std), patch_size=processing.patch_size, merge_size=processing.merge_size,
                temporal_patch_size=processing.temporal_patch_size)


def vision_keys(vision_config: Any, valid: list[str]) -> dict[str, Any]:
    """The vision config's own keys that the tower takes (``depth``, ``hidden_size``, ...)."""
    values = vision_config.to_dict() if hasattr(vision_config, "to_dict") else dict(vision_config)
    return {k: v for k, v in values.items() if k in valid and k not in ("model_type", "dtype")}


def saved_processor(folder: Path, own_file: str, key: str) -> dict[str, Any]:
    """The settings of one of the folder's processors: its own file (``own_file``, as the Hub's folders have them)
    or the ``key`` entry of processor_config.json (transformers 5's save_pretrained); empty where it has neither."""
    if (folder / own_file).is_file():
        return json.loads((folder / own_file).read_text())
    if (folder / "processor_config.json").is_file():
        return json.loads((folder / "processor_config.json").read_text()).get(key) or {}
    return {}


def pixel_bounds(folder: Path) -> dict[str, int]:
    """``min_pixels`` / ``max_pixels`` of the folder's image processor, where it has one (``saved_processor``)."""
    saved = saved_processor(folder, "preprocessor_config.json", "image_processor")
    size = saved.get("size") or {}
    bounds = {"min_pixels": saved.get("min_pixels", size.get("shortest_edge")),
              "max_pixels": saved.get("max_pixels", size.get("longest_edge"))}
    return {k: int(v) for k, v in bounds.items() if v is not None}


def check_template(tokenizer_folder: str | None, folder: Path) -> None:
    """A chat template (of the tokenizer the model uses) that does not write the vision tokens is refused: it is
    not a Qwen-VL template, and its prompts would not be the ones the published model was trained on."""
    from transformers import AutoTokenizer

    from lavis_ds.models.chat_template import template_text

    source = Path(tokenizer_folder).expanduser() if tokenizer_folder else folder
    if not (source / "tokenizer_config.json").is_file():
        return  # reported by the file check (or the folder has no tokenizer: model.tokenizer names one)
    template = template_text(AutoTokenizer.from_pretrained(source))
    missing = [token for token in VISION_TOKENS if template is not None and token not in template]
    if missing:
        raise PartError(f"model.tokenizer: the chat template of {source} does not write {', '.join(missing)}; a "
                        "Qwen-VL model takes each image as <|vision_start|><|image_pad|>...<|vision_end|>, as the "
                        "published chat template writes it; use the published folder's tokenizer (with its "
                        "chat_template) or a template that writes these tokens")


class Qwen2VLFamily(QwenVLFamily):
    hf_class, model_type, tower, norm = "Qwen2VLForConditionalGeneration", "qwen2_vl", "qwen2_vl", "layernorm"
    pairs = (("qwen2_vl", "patch_merger"),)
    exportable = "a qwen2_vl tower + patch_merger (norm layernorm) + the qwen2_vl_text model"


class Qwen25VLFamily(QwenVLFamily):
    hf_class, model_type, tower, norm = "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen2_5_vl", "rmsnorm"
    out_width_key = "out_hidden_size"
    pairs = (("qwen2_5_vl", "patch_merger"),)
    exportable = "a qwen2_5_vl tower + patch_merger (norm rmsnorm) + the qwen2_5_vl_text model"


reg.hf_families.register("qwen2_vl")(Qwen2VLFamily())
reg.hf_families.register("qwen2_5_vl")(Qwen25VLFamily())
