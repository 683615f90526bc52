"""LLaVA's connectors: ``mlp2x_gelu`` (Linear, GELU, Linear) and ``linear``, one LLM token per tower token."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lavis_ds.common import registry as reg
from lavis_ds.models.connectors.base import Connector
from lavis_ds.models.flops import Flops, Tally
from lavis_ds.models.parts import PartError, read_safetensors


def load_projector(connector: nn.Module, path: str) -> None:
    """Weights of a LLaVA projector: a stage-1 ``mm_projector.bin`` (``model.mm_projector[.0/.2].*``) or a
    ``LlavaForConditionalGeneration`` folder's ``multi_modal_projector``; checked key for key and shape for shape."""
    from lavis_ds.models import hf_keys
    from lavis_ds.models.pretrained import CheckpointError, load_torch_file, load_checked

    file = Path(path).expanduser()
    if not file.exists():
        raise PartError(f"connector.pretrained: {file} not found")
    if file.is_dir():
        keep = ("multi_modal_projector.", "model.multi_modal_projector.")
        state = read_safetensors(file, lambda key: key.startswith(keep), "connector.pretrained")
        ours, fmt = hf_keys.llava_projector(state), "LlavaForConditionalGeneration folder"
    else:
        ours, fmt = hf_keys.mm_projector(load_torch_file(file)), "LLaVA mm_projector.bin"
    if not ours:
        raise PartError(f"connector.pretrained: {file} holds no projector weights (expected "
                        "model.mm_projector.0/2.* or multi_modal_projector.linear_1/2.*)")
    try:
        load_checked(connector, ours, connector.state_dict().keys(), file, fmt)
    except CheckpointError as e:
        raise PartError(str(e)) from None


@reg.connectors.register("mlp2x_gelu")
class Mlp2xGelu(Connector):
    """LLaVA-1.5's projector: ``linear_1`` (vision -> LLM width), GELU, ``linear_2`` (transformers' names)."""

    def __init__(self, *, vision_width: int, llm_width: int, multimodal_projector_bias: bool = True,
                 projector_hidden_act: str = "gelu"):
        """
        Args:
            vision_width: The tower's ``num_features`` (given by the architecture).
            llm_width: The LLM's hidden size (given by the architecture).
            multimodal_projector_bias: Biases on both linear layers (transformers' LlavaConfig key).
            projector_hidden_act: Activation between them, a transformers ``ACT2FN`` name.
        """
        super().__init__(vision_width=vision_width, llm_width=llm_width)
        from transformers.activations import ACT2FN

        if projector_hidden_act not in ACT2FN:
            raise PartError(f"connector.projector_hidden_act: {projector_hidden_act!r} is not a transformers "
                            f"activation; e.g. gelu, gelu_pytorch_tanh, silu, quick_gelu")
        self.linear_1 = nn.Linear(vision_width, llm_width, bias=multimodal_projector_bias)
        self.projector_hidden_act = projector_hidden_act  # its name, which LlavaConfig takes (export)
        self.act = ACT2FN[projector_hidden_act]
        self.linear_2 = nn.Linear(llm_width, llm_width, bias=multimodal_projector_bias)

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        features = features.to(self.linear_1.weight.dtype)
        return self.linear_2(self.act(self.linear_1(features)))

    def flops(self, vision_tokens: int, features_grad: bool, text_tokens: int = 0) -> tuple[Flops, bool]:
        tally = Tally()
        hidden = tally.linear(self.linear_1, vision_tokens, features_grad)
        out = tally.linear(self.linear_2, vision_tokens, hidden)
        return tally.flops(), out

    def load_pretrained(self, path: str) -> None:
        load_projector(self, path)


@reg.connectors.register("linear")
class LinearConnector(Connector):
    """One linear layer (LLaVA-1.0's projector)."""

    def __init__(self, *, vision_width: int, llm_width: int, bias: bool = True):
        super().__init__(vision_width=vision_width, llm_width=llm_width)
        self.proj = nn.Linear(vision_width, llm_width, bias=bias)

    def forward(self, features: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> torch.Tensor:
        return self.proj(features.to(self.proj.weight.dtype))

    def flops(self, vision_tokens: int, features_grad: bool, text_tokens: int = 0) -> tuple[Flops, bool]:
        tally = Tally()
        out = tally.linear(self.proj, vision_tokens, features_grad)
        return tally.flops(), out

    def load_pretrained(self, path: str) -> None:
        """LLaVA-1.0's ``mm_projector.bin`` (one Linear, ``model.mm_projector.*``)."""
        load_projector(self, path)
