"""The config side of Qwen3-VL and Qwen3.5 (``models.qwen3_vl``, ``models.qwen3_5``): DeepStack's counts (one
merger per tapped tower block, no more taps than LLM layers; none at all for Qwen3.5), the rule the constructor
enforces too (``deepstack_problems``), and the frame groups a video is written in."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lavis_ds.models.llm_families import llm_text_config
from lavis_ds.models.settings.composed import structure_on_meta
from lavis_ds.models.settings.qwen_vl import QwenVLSettings


class Qwen3VLSettings(QwenVLSettings):
    """Qwen3-VL's section: the ``qwen3_vl`` tower and ``qwen3_vl_merger``, their DeepStack taps and mergers."""

    DEFAULT_PARTS = {"vision_tower": {"name": "qwen3_vl"}, "connector": {"name": "qwen3_vl_merger"}}
    # Qwen3-VL's processor writes a video frame group by frame group (models.frame_groups), two frames a group: the
    # prompt (also built without weights, by show_sample) times its groups by this temporal patch size.
    PROMPT_LAYOUT = dataclasses.replace(QwenVLSettings.PROMPT_LAYOUT, video_frame_groups=2)

    def problems(self) -> list[str]:
        """The parts' and the LLM's problems, then DeepStack's (``deepstack_problems``) from the tower and connector
        built on the meta device and the LLM's config: what the build would refuse, before anything is built."""
        problems = super().problems()
        if problems:
            return problems  # DeepStack's counts are read from parts that build
        settings = self
        if self.section.get("load_pretrained") and self.section.get("pretrained"):
            settings = self._for_section(self.with_published())  # as the build sees it (checked above)
        tower, connector = structure_on_meta(*settings.part_sections())
        return self.deepstack_problems(list(getattr(tower, "tap_layers", ())), getattr(connector, "deepstack_taps", 0),
                                       _llm_layers(settings.section))

    @staticmethod
    def deepstack_problems(taps: list[int], mergers: int, llm_layers: int | None) -> list[str]:
        """One DeepStack merger per tapped tower block, and no more taps than the LLM has layers to add them after
        (tap i's tokens are added after decoder layer i). ``llm_layers`` None: unknown (reported elsewhere)."""
        problems = []
        if len(taps) != mergers:
            problems.append(f"model.connector.deepstack_taps: {mergers} DeepStack mergers, but the tower taps "
                            f"{len(taps)} blocks (vision_tower.vision_config.deepstack_visual_indexes {taps}); valid: "
                            f"{len(taps)}")
        if llm_layers is not None and len(taps) > llm_layers:
            problems.append(f"model.vision_tower.vision_config.deepstack_visual_indexes: {taps} feed the LLM after "
                            f"its first {len(taps)} decoder layers, but it has {llm_layers}; valid: at most "
                            f"{llm_layers} taps, added after decoder layers 0..{llm_layers - 1}")
        return problems


class Qwen35Settings(Qwen3VLSettings):
    """Qwen3.5's section: Qwen3-VL's parts without DeepStack."""

    @staticmethod
    def deepstack_problems(taps: list[int], mergers: int, llm_layers: int | None) -> list[str]:
        """Qwen3.5 has no DeepStack: a tapped tower block or a DeepStack merger is refused, naming the setting."""
        problems = []
        if taps:
            problems.append(f"model.vision_tower.vision_config.deepstack_visual_indexes: {taps}; Qwen3.5 has no "
                            "DeepStack (transformers' Qwen3_5VisionModel taps no block); valid: [] (or use "
                            "model.arch: qwen3_vl for DeepStack)")
        if mergers:
            problems.append(f"model.connector.deepstack_taps: {mergers}; Qwen3.5 has no DeepStack mergers; valid: 0")
        return problems


def _llm_layers(section: Mapping[str, Any]) -> int | None:
    """The LLM's decoder layers: its folder's config.json (a vision-language folder's text config), else
    ``llm_config`` with transformers' defaults; None where neither reads (the LLM's own checks say why)."""
    try:
        return llm_text_config(section.get("llm_model") or None, section.get("llm_config")).num_hidden_layers
    except (OSError, ValueError, TypeError):
        return None
