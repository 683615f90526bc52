"""The config side of every vision-LLM (``models.vision_llm.VisionLLM``): its chat LLM's keys, the prompt they build
and the layout of the image placeholders in it."""
from __future__ import annotations

from typing import Any

from lavis_ds.models.llm import lora_problem, prepare_tokenizer
from lavis_ds.models.llm_families import llm_config_problems
from lavis_ds.models.prompt import ChatPrompt, PromptLayout
from lavis_ds.models.settings.base import ModelSettings


class VisionLLMSettings(ModelSettings):
    """A vision-LLM's ``model:`` section: the LLM, its tokenizer, LoRA, the prompt; the image path says its own
    tokens per image (subclasses)."""

    # Keys of a `model:` section naming local files or folders the model reads, checked before any rank loads them.
    FILE_KEYS: tuple[str, ...] = ("tokenizer", "llm_model")
    PACKS = True  # prepare_batch(samples, pack_to=N) packs samples into rows (lavis_ds.models.packing)
    CUTS_IMAGE_SAMPLES = True  # prepare_batch(samples, on_image_cut="drop") leaves out image-cut samples
    # What the family's chat template writes besides text and image placeholders: the tokens around each image's
    # placeholders (Qwen-VL's vision start and end; None: they stand inside the data's <Img>...</Img>), the special
    # tokens added to a tokenizer that lacks them, a video's own placeholder token where the family's processor
    # writes one (Qwen-VL's <|video_pad|>), and the frames per temporal patch where it writes a video frame group by
    # frame group, each after its time (Qwen3-VL: models.frame_groups).
    PROMPT_LAYOUT = PromptLayout()

    def tokens_per_image(self) -> int | None:
        """Image placeholders per image in the prompt the section builds. Subclasses say."""
        raise NotImplementedError(f"{type(self).__name__} does not say how many tokens an image takes")

    def image_size(self) -> int | None:
        """The image side the vision tower takes: ``image_size`` (subclasses whose tower fixes it say otherwise)."""
        return self.arguments().get("image_size")

    def text_length(self) -> int:
        """The longest training sequence in tokens (the model truncates there): ``max_txt_len``."""
        return self.arguments()["max_txt_len"]

    def problems(self) -> list[str]:
        """What the constructor would refuse of the LLM side, found before anything is built."""
        section, problems = self.section, []
        if problem := lora_problem(section.get("get_lora", False), section.get("freeze_llm", True)):
            problems.append(problem)
        if not section.get("tokenizer") and not section.get("llm_model"):
            problems.append("model.tokenizer: required when model.llm_model is null (a local tokenizer folder)")
        if not section.get("llm_model"):
            problems += llm_config_problems(section.get("llm_config"))
        return problems

    def prompt(self) -> ChatPrompt:
        """The prompt the section builds, from its tokenizer alone, without any weights (``lavis_ds.show_sample``);
        the same tokens as the built model's own ``prompt``."""
        args = self.arguments()
        tokenizer, _ = prepare_tokenizer(args["tokenizer"] or args["llm_model"], args["image_token"],
                                         self.PROMPT_LAYOUT.prompt_tokens)
        return self.PROMPT_LAYOUT.chat_prompt(tokenizer, args["system_prompt"], args["image_token"],
                                              self.tokens_per_image(), args["max_txt_len"],
                                              args["chat_template_kwargs"], args["record_system_prompt"])

    @classmethod
    def merged_llm_settings(cls, folder: str) -> dict[str, Any]:
        """The ``model:`` keys that make the model load the merged LLM saved in ``folder`` (``merge_lora``,
        ``save_pretrained`` with the tokenizer) instead of building its own."""
        return {"llm_model": folder, "tokenizer": folder, "llm_config": None, "llm_precision": "auto",
                "get_lora": False, "freeze_llm": True}
