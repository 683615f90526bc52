"""Checkpoint size of a full-size configuration, computed from the real model built on the meta device.

    python benchmarks/checkpoint_size.py [--model-type qwen2.5_7b_instruct] [--get-lora]

Prints what a lavis_ds checkpoint holds (trainable parameters in the training
dtype + Adam's fp32 master copy, exp_avg and exp_avg_sq) next to what saving the
whole module would cost (every parameter in its dtype, no optimizer state).
Nothing is allocated: the model is built on PyTorch's meta device.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import lavis_ds  # noqa: F401  (fills the registries)
from lavis_ds.common.registry import registry
from lavis_ds.models.tokenizer import train_chatml_tokenizer

ADAM_FP32_STATE_BYTES = 12  # master copy + exp_avg + exp_avg_sq, 4 bytes each


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", default="qwen2.5_7b_instruct")
    parser.add_argument("--train-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--get-lora", action="store_true", help="LoRA on the LLM (r=8, every linear layer)")
    args = parser.parse_args(argv)

    cls = registry.get_model_class("blip2_qwen")
    cfg = cls.default_config(args.model_type)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        # The sizes come from the preset (vocab_size included); any ChatML tokenizer builds it.
        train_chatml_tokenizer(["a tiny corpus"], tokenizer_dir)
        # llm_precision: the published Qwen2.5 weights are bf16 (a random-init LLM would be fp32).
        cfg.update(tokenizer=tokenizer_dir, get_lora=args.get_lora, load_pretrained=False, llm_precision="bf16")
        with torch.device("meta"):
            model = cls.from_config(cfg)

    param_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.train_dtype]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    lean = trainable * (param_bytes + ADAM_FP32_STATE_BYTES)
    print(f"model: blip2_qwen/{args.model_type}{' + LoRA' if args.get_lora else ''}, training in {args.train_dtype}")
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B, trainable {trainable / 1e6:.2f} M")
    print(f"lavis_ds checkpoint (trainable weights + Adam state): {lean / 2**20:,.1f} MiB")
    print(f"whole module, weights only:                          {whole / 2**30:,.2f} GiB")
    print(f"ratio whole/lean: {whole / lean:,.0f}x")


if __name__ == "__main__":
    main()
