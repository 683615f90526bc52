"""Memory and time of one forward + backward: the LM head at the supervised positions in chunks against the full
``[B, T, V]`` logits, side by side in one run, at Qwen's vocabulary.

    python benchmarks/logits_memory.py [--tokens 2048] [--batch 2] [--chunks 0 1 4 8] [--repeats 3]

The model is the real tiny BLIP2-Qwen preset (everything trains, fp32) with the LLM's vocabulary set to Qwen's
151,936 rows, a ChatML tokenizer trained here; 2 samples of about 2,048 tokens each, one image and an instruction
of about three quarters of the tokens, an answer of about a quarter. Each path is `model.llm.loss_chunks` (0: the
full logits, the model's own forward; N: the head called N times, on 1/N of the supervised positions each). The
paths alternate, `--repeats` times each, on the same built model and the same prepared batch; gradients are
dropped between steps.

What is measured, above what the process holds just before the step (the built model, the prepared batch):
  GPU (cuda available): `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`: the tensors the
      step allocates at its peak (not the allocator's cached blocks).
  CPU: the process's resident set size sampled every 1 ms in a thread (psutil), its peak minus its value just
      before the step. glibc returns large blocks (mmapped) to the system when torch frees them, so each step
      starts from the same level; the figure includes what the allocator keeps of small blocks, so it is an upper
      bound of the tensors' peak.
The reference size is one fp32 `[B, T, V]` tensor (B*T*V*4 bytes); time is the wall clock of forward + backward
(median over the repeats).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

QWEN_VOCAB = 151_936
GIB = 2 ** 30
WORDS = "the red ball lies next to a small dog on the green grass while a cat sits on the mat".split()


class PeakRSS:
    """This process's resident set size, sampled in a thread between ``start`` and ``stop``."""

    def __init__(self, interval: float = 0.001):
        import psutil

        self.process, self.interval, self.peak, self._run = psutil.Process(), interval, 0, False

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = self.process.memory_info().rss
        self._run = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._run:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._run = False
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def added(self) -> int:
        return self.peak - self.base


def build(tokens: int, device: torch.device):
    from lavis_ds.models import Blip2Qwen
    from lavis_ds.models.tokenizer import train_chatml_tokenizer

    with tempfile.TemporaryDirectory(prefix="logits_memory_") as tmp:  # the model keeps the loaded tokenizer
        tokenizer = train_chatml_tokenizer([" ".join(WORDS)] * 4 + ["You are a helpful assistant."], tmp,
                                           vocab_size=300)
        cfg = Blip2Qwen.default_config("tiny")
        cfg.update(tokenizer=str(tokenizer), max_txt_len=tokens + 64)
        cfg["llm_config"] = {**cfg["llm_config"], "vocab_size": QWEN_VOCAB, "max_position_embeddings": tokens + 64}
        torch.manual_seed(0)
        model = Blip2Qwen.from_config(cfg).to(device).train()
    assert model.llm.config.vocab_size == QWEN_VOCAB
    return model


def words(n: int, offset: int) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n))


def batch_of(model, batch: int, tokens: int, device: torch.device) -> dict:
    """``batch`` samples of about ``tokens`` tokens, a quarter of them answer (word counts fitted to the tokenizer)."""
    count = lambda text: len(model.llm.tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    per_word = count(words(400, 0)) / 400
    question, answer = int(tokens * 0.75 / per_word) - 30, int(tokens * 0.25 / per_word)
    samples = {"image": torch.randn(batch, 3, *[model.vision_tower.image_size] * 2, device=device),
               "instruction": [[f"<Img><ImageHere></Img> {words(question, i)}"] for i in range(batch)],
               "output": [[words(answer, 7 * i)] for i in range(batch)]}
    prepared = model.prepare_batch(samples)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in prepared.items()}


def step(model, batch: dict, device: torch.device) -> tuple[int, float]:
    """Bytes the forward + backward adds at its peak, and its seconds."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        model(batch)["loss"].backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, time.perf_counter() - start
    with PeakRSS() as rss:
        start = time.perf_counter()
        model(batch)["loss"].backward()
        seconds = time.perf_counter() - start
    return rss.added, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per sample (about)")
    parser.add_argument("--batch", type=int, default=2, help="samples")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1, 4, 8],
                        help="loss_chunks values to compare (0: the full logits)")
    parser.add_argument("--repeats", type=int, default=3, help="steps per path (alternating)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = build(args.tokens, device)
    batch = batch_of(model, args.batch, args.tokens, device)
    shape = tuple(batch["input_ids"].shape)
    supervised = model.supervised_tokens(batch)
    logits_bytes = shape[0] * shape[1] * QWEN_VOCAB * 4
    results: dict[int, list[tuple[int, float]]] = {chunk: [] for chunk in args.chunks}
    step(model, batch, device)  # warm-up: first-use allocations of the kernels
    for _ in range(args.repeats):
        for chunk in args.chunks:
            model.llm.loss_chunks = chunk
            results[chunk].append(step(model, batch, device))
    measure = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS (psutil, 1 ms)"
    print(f"logits memory: tiny BLIP2-Qwen, vocabulary {QWEN_VOCAB:,}, fp32, {device.type}; batch {shape[0]} x "
          f"{shape[1]} tokens, {supervised} supervised ({supervised / (shape[0] * shape[1]):.0%}); "
          f"one fp32 [B, T, V] = {logits_bytes / GIB:.2f} GiB; memory: {measure}, above the built model")
    print(f"{'path':<22}{'added GiB (max)':>16}{'x [B,T,V]':>11}{'step s (median)':>17}")
    for chunk, runs in results.items():
        added = max(r[0] for r in runs)
        name = "full logits" if chunk == 0 else f"head in {chunk} call(s)"
        print(f"{name:<22}{added / GIB:>16.2f}{added / logits_bytes:>11.2f}"
              f"{statistics.median(r[1] for r in runs):>17.2f}")


if __name__ == "__main__":
    main()
