"""Export a checkpoint (any ZeRO stage) to safetensors + config for inference without DeepSpeed.

    python export.py output/demo --out exports/demo                      # the run's newest complete checkpoint
    python export.py output/demo/checkpoints/step_62 --out exports/step62      # the demo's first epoch
    python export.py output/lora_run --out exports/lora --merge-lora     # also a merged Hugging Face LLM
    python export.py output/demo --out exports/demo_hf --format hf       # transformers' BLIP-2 (LoRA merged)

Then: python -m lavis_ds.apps.generate --model exports/demo --image x.png --prompt "Describe the image."
A --format hf folder loads with transformers alone: docs/export-hf.md.
"""
from lavis_ds.common.dist import exit_now
from lavis_ds.apps.export import main

if __name__ == "__main__":
    exit_now(main())
