"""The README.md a ``--format hf`` export carries: how the ecosystem's one call runs it, and what differs from
lavis_ds's own generation.

lmms-eval's ``huggingface`` model, vLLM's processing and model cards load a folder with ``AutoProcessor`` and
``AutoModelForImageTextToText``, render the prompt with a chat template, call ``processor(images=..., text=...)`` and
``model.generate(**inputs)``. The README shows those lines for the folder's class and lists, from the family
(``ProcessorExport.one_call_notes``) and the export (``export_hf.export_notes``), every way they compute otherwise than
lavis_ds does on the checkpoint; what it does not list gives lavis_ds's token ids (tests/test_export_hf_arch.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from torch import nn

from lavis_ds.models.hf.family import HfFamily

README = "README.md"


def write_readme(model: nn.Module, family: HfFamily, notes: list[str], out: Path,
                 template_variables: Mapping[str, Any] | None = None) -> None:
    """Write ``out/README.md`` for ``model`` exported as ``family``'s class with the export's ``notes``;
    ``template_variables``: the run's chat-template variables the chat template defaults to."""
    render = ("processor.apply_chat_template" if family.processors.processor_keeps_chat_template
              else "processor.tokenizer.apply_chat_template")
    differences = family.processors.one_call_notes(model) + notes
    lines = [
        f"# {family.hf_class}, exported by lavis_ds",
        "",
        "Written by `lavis-ds export RUN --format hf`; `lavis_ds_export.json` names the checkpoint. transformers",
        "alone loads it (no lavis_ds import):",
        "",
        "```python",
        "from PIL import Image",
        "from transformers import AutoModelForImageTextToText, AutoProcessor",
        "",
        'folder = "."  # this folder',
        "processor = AutoProcessor.from_pretrained(folder)",
        "model = AutoModelForImageTextToText.from_pretrained(folder)",
        'messages = [{"role": "user", "content": [{"type": "image"},',
        '                                         {"type": "text", "text": "What is in the image?"}]}]',
        f"prompt = {render}(messages, add_generation_prompt=True, tokenize=False)",
        'inputs = processor(images=[Image.open("a.png").convert("RGB")], text=[prompt], return_tensors="pt")',
        "output = model.generate(**inputs, generation_config=model.generation_config)",
        "print(processor.batch_decode(output[:, inputs.input_ids.shape[1]:], skip_special_tokens=True))",
        "```",
        "",
        "The chat template writes the ChatML prompt the model was trained with (system turn, each image where training",
        f"put it, the assistant header); `{model.llm.prompt.image_token}` is the image token. The generation config is",
        "lavis_ds's: greedy, stopping at `<|im_end|>`, the image token suppressed.",
        "",
        *_variables_paragraph(template_variables or {}),
        "## The one call against lavis_ds's own generation on the checkpoint",
        "",
        "The lines above give lavis_ds's token ids, except where a note below says otherwise:" if differences
        else "The lines above give lavis_ds's token ids.",
        "",
    ]
    lines += [f"- {note}" for note in differences]
    (out / README).write_text("\n".join(lines) + "\n")


def _variables_paragraph(variables: Mapping[str, Any]) -> list[str]:
    """The lines saying which template variables the chat template defaults to (none: no lines)."""
    if not variables:
        return []
    given = ", ".join(f"`{name}={value!r}`" for name, value in variables.items())
    return [f"The chat template defaults to the template variables the model was trained with ({given}): the call",
            "above renders the trained prompt; passing one of them to `apply_chat_template` changes it.", ""]
