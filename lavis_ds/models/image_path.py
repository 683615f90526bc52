"""The image path of a vision-LLM: ``connector(vision_tower(images), inputs)``, the flat features of a batch, and
their splice into the LLM's input embeddings at the image placeholders.

The model holds one (``model.image_path``), made from its tower, its connector, its image layout (how many tokens
each image takes: ``lavis_ds.models.image_layout``) and its LLM part. ``ImagePath`` is every architecture's whose
tower takes fixed-size images (LLaVA, BLIP-2, InstructBLIP: an instruction connector's inputs follow the images);
a family whose tower differs is a subclass named by the architecture's ``IMAGE_PATH`` (``models.qwen_vl``: flat
patches and a grid per image; ``models.qwen3_vl``: DeepStack features added inside the LLM).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lavis_ds.models.chat_llm import ChatLLM
from lavis_ds.models.flops import FlopModel, Flops, compose
from lavis_ds.models.image_layout import ImageLayout
from lavis_ds.models.image_tokens import batch_images, flat_features, images_per_sample
from lavis_ds.models.prompt import image_counts
from lavis_ds.models.vision_llm_batch import packed_image_order

# The fields of an instruction connector's inputs that travel in a prepared batch (one row per image).
CONNECTOR_INPUT_KEYS = ("qformer_input_ids", "qformer_attention_mask")


class ImagePath:
    """``connector(vision_tower(images), inputs)`` spliced into the LLM's embeddings at the placeholders."""

    LAYOUT: type[ImageLayout] = ImageLayout  # how its images become LLM tokens on the host
    # Keys ``host_inputs`` adds that hold one row per image, in image order (an instruction connector's BERT tokens):
    # a batch whose samples share images (a preference pair's two sides) keeps one row per distinct image.
    PER_IMAGE_FIELDS = CONNECTOR_INPUT_KEYS

    def __init__(self, tower: nn.Module, connector: nn.Module, tokens_per_image: int | None, llm: ChatLLM,
                 owner: str = "the model"):
        """``tokens_per_image``: what the connector makes of the tower's tokens (None: each image's own count);
        ``owner``: the architecture, as messages name it."""
        # The parts are the model's registered modules (``vision_tower``, ``connector``); held here to run them.
        self.tower, self.connector, self.llm = tower, connector, llm
        self.layout = self.LAYOUT(tower, tokens_per_image, owner)

    # ----------------------------------------------------------------- features
    def encode(self, images: torch.Tensor, samples: dict[str, Any]) -> torch.Tensor:
        """``images`` (the batch's ``image``; ``samples`` holds its grid, if any) -> the features of every image:
        ``[N, tokens_per_image, llm_hidden]``, or flat ``[sum of counts, llm_hidden]`` where the count depends on the
        image. An instruction connector's inputs follow the images into packed order."""
        inputs = None
        if self.connector.NEEDS_INSTRUCTION:
            inputs = {k: samples[k] for k in CONNECTOR_INPUT_KEYS if k in samples} or self.host_inputs(samples)
            rows = inputs["qformer_input_ids"].shape[0]
            if rows != images.shape[0]:
                raise ValueError(f"{rows} instruction rows for {images.shape[0]} images: prepare_batch makes one per "
                                 "image (the blank stand-in image of an image-free batch has one too)")
            if "position_ids" in samples and rows == sum(image_counts(samples)) and rows > 1:
                order = packed_image_order(samples)
                inputs = {k: v[order.to(v.device)] for k, v in inputs.items()}
            inputs = {k: v.to(images.device) for k, v in inputs.items()}
        return self.connector(self.tower(images), inputs)

    def host_inputs(self, samples: dict[str, Any]) -> dict[str, Any]:
        """An instruction connector's inputs, tokenized on the host: one row per image in sample order, or one
        empty instruction for the blank stand-in image of a batch without images; none for other connectors."""
        if not self.connector.NEEDS_INSTRUCTION:
            return {}
        if sum(image_counts(samples)):
            return self.connector.prepare(samples)
        blank = self.layout.blank(torch.device("cpu"))  # what features() feeds the tower
        return self.connector.prepare({"instruction": [""], "num_images": [1], **blank})

    def features(self, image: torch.Tensor | None, dummy: bool, samples: dict[str, Any] | None = None
                 ) -> torch.Tensor:
        """Features of every image of a batch, flat: ``[sum of counts, llm_hidden]`` in the LLM embedding dtype,
        each image's rows a block in image order (``image`` holds all samples' images in order, with the batch's
        grid in ``samples`` where it has one; the tower runs once on it).

        A batch with no image (text-only samples only) gives ``[0, hidden]``, or with ``dummy`` the features of
        one blank image (``layout.blank``), which the caller adds to its embeddings times zero. Why run
        the towers for nothing: ZeRO-3 and FSDP gather a module's parameters when it runs, as a collective, so every
        rank must run the same modules in each forward or the ranks wait for each other forever; and the trainable
        parts (projection, queries) then get a gradient - zero - on every rank, as the engines' gradient
        reduction expects. Skipping the towers only where no rank has an image would need a collective per
        micro-batch; the blank image costs one image's tower pass, only in image-free micro-batches.
        """
        view = {**(samples or {}), "image": image}
        embedding = self.llm.model.get_input_embeddings().weight
        if image is not None and batch_images(view):
            counts = self.layout.counts(view)
            return flat_features(self.encode(image, view), counts, images_per_sample(view, counts),
                                 f"{self.layout.owner}'s image path").to(embedding.dtype)
        device = embedding.device if image is None else image.device
        if not dummy:
            return torch.zeros((0, self.llm.config.hidden_size), device=device, dtype=embedding.dtype)
        blank = {**view, **self.layout.blank(device)}
        features = self.encode(blank["image"], blank)
        return (features.flatten(0, 1) if features.dim() == 3 else features).to(embedding.dtype)

    # ----------------------------------------------------------------- the splice
    def splice(self, input_ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The LLM's input embeddings with each placeholder run replaced by its image's features, and what more of
        the features the LLM's forward takes as arguments (Qwen3-VL's DeepStack). Here: the embeddings alone."""
        return self.embed(input_ids, features), {}

    def embed(self, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Token embeddings with each placeholder run replaced by its image's features."""
        embeds = self.llm.model.get_input_embeddings()(input_ids)
        image_id, *video_id = self.llm.prompt.placeholder_ids  # an image's run, or a video's (its own token)
        is_image = input_ids == image_id
        for token in video_id:
            is_image = is_image | (input_ids == token)
        # masked_scatter fills positions in row-major order: sample by sample, left to right, and the prompt
        # reserved exactly the layout's count of placeholders per image, the rows ``features`` checked the image
        # path gave, so the flat features (in sample order, each sample's images in marker order) land in their
        # runs; a sample without images has no run.
        return embeds.masked_scatter(is_image.unsqueeze(-1), features.to(embeds.dtype))

    # ----------------------------------------------------------------- what a sharding engine and the MFU read
    def blocks(self) -> list[nn.Module]:
        """The tower's blocks, then the connector's (a Q-Former's layers): units a sharding engine gathers one at a
        time."""
        return [*self.tower.blocks(), *self.connector.blocks()]

    def flop_model(self) -> FlopModel | None:
        """Training FLOPs per sample by part (tower, connector, LLM), for the parameters that train now
        (``lavis_ds.models.flops``); None if a part does not say (a user's part without ``flops``: no MFU logged)."""
        image_path = self.flops()
        if image_path is None:
            return None
        tower, connector, image_grad = image_path
        return compose(tower, connector, image_grad, self.llm.model, not self.llm.head_at_supervised_positions())

    def flops(self) -> tuple[Flops, Callable[[int], Flops], bool] | None:
        """The image path's FLOPs per image: the tower's, the connector's given its instruction tokens per image,
        and whether the connector's output needs a gradient; None if a part does not say (``VisionTower.flops``,
        ``Connector.flops``)."""
        tower = self.tower.flops()
        tokens = self.tower.num_tokens
        connector = None if tower is None else self.connector.flops(tokens, tower[1])
        if connector is None:
            return None
        return tower[0], lambda text_tokens: self.connector.flops(tokens, tower[1], text_tokens)[0], connector[1]
