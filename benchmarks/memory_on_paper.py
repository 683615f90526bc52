"""Per-GPU memory of the full-size MiniGPT4Qwen recipe under ZeRO 0-3 (with and without optimizer offload)
and under FSDP2 (runner_fsdp: mixed, low, mixed with CPU offload).

    python benchmarks/memory_on_paper.py [--gpus 4] [--gpu-gb 24] [--seq-len 256] [--answer-len 128]

Parameter counts come from our real model: `Blip2Qwen` built on the meta device from
each project YAML (`projects/minigpt4qwen/zero2.yaml`: projection only;
`zero2_lora.yaml`: projection + LoRA), with the LLM architecture of its preset (the
weight folders need not exist). The micro-batch is the YAML's. Nothing is allocated
but one probe layer (below); the figures are arithmetic, printed as Markdown tables
(docs/memory.md holds one run's output).

What each column counts, per GPU, bf16 engine (DeepSpeed casts every parameter to
bf16, frozen ones included), Adam, N = --gpus, P = all parameters, T = trainable:

  params     2P bytes; ZeRO-3: 2P/N + the gathered working set (the largest module,
             the 545M-parameter lm_head, plus one prefetched decoder layer).
  grads      bf16 gradients of T: 2T (ZeRO-0/1), 2T/N (ZeRO-2/3); ZeRO-0's bf16
             optimizer adds fp32 gradient accumulators, 4T.
  optimizer  fp32 master + Adam m + v = 12T (ZeRO-0), 12T/N (ZeRO-1+); 0 when offloaded.
  buffers    DeepSpeed's gradient-reduction bucket: reduce_bucket_size elements (5e8 by
             default) in bf16 = 1 GB at ZeRO 1-3 whatever T is (ZeRO-1/2 allocate it for
             each backward, ZeRO-3 keeps it).
  activations  what autograd saves for the backward pass through the 28 LLM layers
             (gradients reach the projection through every layer, frozen or not), plus
             logits and loss. The frozen ViT and Q-Former run without saving anything:
             nothing before the projection needs a gradient.

Activations per layer: the standard formula is Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", eq. 1): s*b*h*(34 + 5*a*s/h)
bytes in 16-bit, for a GPT block with a 4h GeLU MLP whose weights all train; the
5as/h term (stored attention scores) disappears with SDPA/flash attention, which
transformers uses for Qwen2. Qwen2.5-7B's SwiGLU MLP is 5.3h wide and frozen weights
do not keep their inputs, so the totals use a measurement instead: one decoder layer
of the real width, in bf16 on the CPU (b=1, s=64; activations grow linearly in b*s
with SDPA), counting the bytes autograd saves (torch.autograd.graph.saved_tensors_hooks),
frozen and with the YAML's LoRA adapters. --no-measure uses the formula.

Logits and loss: b*s*V*2 (bf16 logits) + 3*b*a*V*4 (fp32 copy of the supervised
positions, its log-softmax, its gradient), a = answer tokens.

FSDP2 (runner_fsdp), per GPU:
  mixed      params (2(P-T) + 4T)/N (fp32 shards of the trainable parameters, bf16 of the frozen ones:
             runner_fsdp casts those as DeepSpeed does) + the gathered working set in bf16: the root unit (embeddings, lm_head, norms, queries,
             projection and the towers' non-block parts, gathered for the whole forward) plus two
             blocks (the current one and the prefetched one); grads 4T/N (fp32 reduce-scatter);
             optimizer 8T/N (Adam m + v; the fp32 parameter is its own master); no bucket.
  low        params 2P/N + the same working set, grads 2T/N, optimizer 4T/N (all bf16).
  mixed+cpu  CPUOffloadPolicy: shards, gradients and optimizer live in host memory; the GPU holds
             the working set and the activations.

Not counted: the CUDA context and PyTorch's allocator caching (typically 0.5-1.5 GB),
transient ViT / Q-Former forward buffers (< 0.2 GB at these sizes).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402

GB = 1e9
PROJECTS = {"Projection only (zero2.yaml)": REPO / "projects/minigpt4qwen/zero2.yaml",
            "Projection + LoRA (zero2_lora.yaml)": REPO / "projects/minigpt4qwen/zero2_lora.yaml"}
REDUCE_BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size, in elements


@dataclass
class Counts:
    vit: int
    qformer: int  # with ln_vision and the query tokens
    proj: int
    llm: int  # the LLM without adapters
    lora: int
    vit_blocks: int  # parameters inside the ViT's blocks (FSDP2 shards each block as a unit)
    qformer_layers: int  # parameters inside the Q-Former's layers
    trainable: int
    micro_batch: int
    lora_cfg: dict | None
    llm_transformers_config: object


def count(yaml_path: Path, gpus: int, tokenizer_dir: Path) -> Counts:
    from lavis_ds.config import load_config
    from lavis_ds.models import Blip2Qwen

    cfg = load_config(yaml_path, world_size=gpus, check_files=False)
    model_cfg = dict(cfg.model)
    # Same architecture from the preset's llm_config; no weight files are read on the meta device.
    model_cfg.update(llm_model=None, tokenizer=str(tokenizer_dir), load_pretrained=False, pretrained=None,
                     vit_pretrained=None)
    with torch.device("meta"):
        model = Blip2Qwen.from_config(model_cfg)

    def n(module) -> int:
        return sum(p.numel() for p in module.parameters())

    lora = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    lora_cfg = ({k: model_cfg[k] for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")}
                if model_cfg.get("get_lora") else None)
    vit, connector = model.vision_tower.vit, model.connector
    qformer = n(connector.qformer) + n(connector.ln_vision) + connector.query_tokens.numel()
    return Counts(vit=n(vit), qformer=qformer, proj=n(connector.llm_proj),
                  llm=n(model.llm_model) - lora, lora=lora, vit_blocks=n(vit.blocks),
                  qformer_layers=n(connector.qformer.encoder.layer),
                  trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
                  micro_batch=int(cfg.run.batch_size_train),
                  lora_cfg=lora_cfg, llm_transformers_config=model.llm_model.config)


def measured_bytes_per_token_layer(llm_transformers_config, lora_cfg: dict | None, s: int = 64) -> float:
    """Bytes autograd saves per token for one real-width Qwen2 decoder layer in bf16 (CPU, b=1)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config = llm_transformers_config.__class__.from_dict(llm_transformers_config.to_dict())
    config._attn_implementation = "sdpa"  # transformers' default for Qwen2
    torch.manual_seed(0)
    layer = Qwen2DecoderLayer(config, 0).to(torch.bfloat16).requires_grad_(False)
    if lora_cfg:
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(LoraConfig(r=lora_cfg["lora_r"], lora_alpha=lora_cfg["lora_alpha"],
                                           lora_dropout=lora_cfg["lora_dropout"],
                                           target_modules=list(lora_cfg["lora_target_modules"])), layer)
        layer.to(torch.bfloat16)
        for name, p in layer.named_parameters():
            p.requires_grad_(".lora_" in name)
    layer.train()
    hidden = torch.randn(1, s, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(s)[None]
    rope = Qwen2RotaryEmbedding(config)(hidden, positions)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()  # one activation saved by several ops counts once
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, position_embeddings=rope, attention_mask=None, position_ids=positions)
    not_activations = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    not_activations.add(hidden.untyped_storage().data_ptr())  # the previous layer's output, counted there
    return sum(v for k, v in saved.items() if k not in not_activations) / s


def korthikanti_bytes_per_token_layer(h: int) -> float:
    return 34 * h  # s*b*h*34 / (s*b): the SDPA/flash case (no stored attention scores)


def table(title: str, c: Counts, gpus: int, gpu_gb: float, seq: int, answer: int, per_token_layer: float,
          formula: float) -> str:
    # Over 50 lines: one table's rows, each a line of arithmetic on the same counts; split, they would pass them all.
    cfg = c.llm_transformers_config
    b, layers, vocab = c.micro_batch, cfg.num_hidden_layers, cfg.vocab_size
    total_params = c.vit + c.qformer + c.proj + c.llm + c.lora
    T = c.trainable
    act_layers = per_token_layer * b * seq * layers
    act_logits = b * seq * vocab * 2 + 3 * b * answer * vocab * 4
    activations = act_layers + act_logits
    # ZeRO-3 gathers one module at a time (plus prefetch): the lm_head is the largest.
    layer_params = (c.llm - 2 * vocab * cfg.hidden_size) / layers
    working_set = 2 * (vocab * cfg.hidden_size + layer_params)

    # FSDP2: the root unit is everything outside the repeated blocks, gathered in bf16 for the whole forward.
    blocks = layer_params * layers + c.lora + c.vit_blocks + c.qformer_layers  # LoRA lives in the decoder layers
    root = total_params - blocks
    fsdp_working = 2 * (root + 2 * layer_params)

    lines = [f"### {title}", "",
             f"Parameters: ViT {c.vit / 1e6:,.0f}M, Q-Former + ln_vision + queries {c.qformer / 1e6:,.1f}M, "
             f"projection {c.proj / 1e6:,.2f}M, LLM {c.llm / 1e6:,.0f}M"
             + (f", LoRA {c.lora / 1e6:,.1f}M" if c.lora else "")
             + f"; total {total_params / 1e9:.3f}B, trainable {T / 1e6:,.2f}M.",
             f"Micro-batch {b} (the YAML's), {seq} tokens ({answer} supervised), {gpus} GPUs of {gpu_gb:g} GB, bf16.",
             f"Activations: {per_token_layer / cfg.hidden_size:.1f}*s*b*h bytes per layer measured "
             f"(formula: {formula / cfg.hidden_size:.0f}*s*b*h) -> {act_layers / GB:.2f} GB for {layers} layers "
             f"+ logits/loss {act_logits / GB:.2f} GB.", "",
             "| engine | offload | params | grads | optimizer | buffers | activations | total | fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for stage in (0, 1, 2, 3):
        for offload in (False, True):
            if stage == 0 and offload:
                continue  # DeepSpeed offloads the optimizer of ZeRO 1-3 only
            params = 2 * total_params / gpus + working_set if stage == 3 else 2 * total_params
            grads = 2 * T / gpus if stage >= 2 else 2 * T
            if stage == 0:
                grads += 4 * T  # the bf16 optimizer's fp32 gradient accumulators
            optim = 0 if offload else (12 * T if stage == 0 else 12 * T / gpus)
            buffers = 0 if stage == 0 else 2 * REDUCE_BUCKET
            total = params + grads + optim + buffers + activations
            fits = "yes" if total <= gpu_gb * GB * 0.95 else "no"  # ~5% for context and fragmentation
            cells = [f"{params / GB:.2f}", f"{grads / GB:.3f}", f"{optim / GB:.3f}", f"{buffers / GB:.2f}",
                     f"{activations / GB:.2f}", f"{total / GB:.2f}", fits]
            lines.append(f"| ZeRO-{stage} | {'cpu' if offload else '-'} | " + " | ".join(cells) + " |")
    for mode, params, grads, optim in (
            ("mixed", (2 * (total_params - T) + 4 * T) / gpus, 4 * T / gpus, 8 * T / gpus),
            ("low", 2 * total_params / gpus, 2 * T / gpus, 4 * T / gpus),
            ("mixed+cpu", 0, 0, 0)):
        total = params + fsdp_working + grads + optim + activations
        fits = "yes" if total <= gpu_gb * GB * 0.95 else "no"
        cells = [f"{(params + fsdp_working) / GB:.2f}", f"{grads / GB:.3f}", f"{optim / GB:.3f}", "0.00",
                 f"{activations / GB:.2f}", f"{total / GB:.2f}", fits]
        lines.append(f"| FSDP2 {mode} | {'cpu' if mode.endswith('cpu') else '-'} | " + " | ".join(cells) + " |")
    # How the activations scale: the one term that grows with the batch.
    lines += ["", "Activations (GB) by micro-batch and sequence length (half of the tokens supervised):", "",
              "| micro-batch | " + " | ".join(f"s={s}" for s in (256, 512)) + " |", "|---|---|---|"]
    for mb in (1, 2, 4, 8):
        cells = [(per_token_layer * mb * s * layers + mb * s * vocab * 2 + 3 * mb * (s // 2) * vocab * 4) / GB
                 for s in (256, 512)]
        lines.append(f"| {mb} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--gpu-gb", type=float, default=24.0)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample, image placeholders included")
    parser.add_argument("--answer-len", type=int, default=128, help="supervised tokens per sample")
    parser.add_argument("--no-measure", action="store_true", help="use the formula instead of the one-layer probe")
    args = parser.parse_args(argv)

    import lavis_ds  # noqa: F401  (fills the registries)
    from lavis_ds.models.tokenizer import train_chatml_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        # Any ChatML tokenizer will do: the LLM's vocab size comes from the preset's llm_config.
        tokenizer_dir = train_chatml_tokenizer(["You are a helpful assistant."], tmp, vocab_size=300)
        for title, path in PROJECTS.items():
            c = count(path, args.gpus, tokenizer_dir)
            formula = korthikanti_bytes_per_token_layer(c.llm_transformers_config.hidden_size)
            per_token = (formula if args.no_measure else
                         measured_bytes_per_token_layer(c.llm_transformers_config, c.lora_cfg))
            print(table(title, c, args.gpus, args.gpu_gb, args.seq_len, args.answer_len, per_token, formula))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
