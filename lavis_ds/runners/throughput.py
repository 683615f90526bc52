"""Throughput you can see: tokens/s, supervised tokens/s, padding share, peak memory and MFU at every logged step.

Tokens are counted from each rank's CPU-side micro-batches before the forward (``count_tokens``, in
the loop's ``run_step``): no GPU-to-host copy, no collective. ``ThroughputMeter`` adds them up between
logged steps and sums them over the ranks only at a logged step, with one ``comm.all_gather_object``. Its clock
counts training time only: the time from the end of a step's hooks to the next step's logger, so
evaluation and checkpoint saving do not lower tokens/s and MFU. docs/throughput.md has the fields and
the FLOP formula.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, fields

import torch

from lavis_ds.common import comm
from lavis_ds.common.errors import report
from lavis_ds.common.hardware import device_name, peak_bf16_tflops, peak_memory_bytes
from lavis_ds.models.image_tokens import batch_images, image_sizes
from lavis_ds.models.prompt import IGNORE_INDEX


@dataclass
class TokenCounts:
    """Tokens of some micro-batches (one rank's, or every rank's once gathered)."""

    samples: int = 0
    images: int = 0  # images (video frames; a Qwen-VL video is one grid row) the vision tower encodes for them
    positions: int = 0  # every position of the padded batches
    tokens: int = 0  # positions holding a token (attention_mask 1)
    supervised: int = 0  # tokens the loss is taken on
    squared_tokens: int = 0  # sum of each sample's token count squared: attention FLOPs grow with it
    # The instruction tokens a connector reads beside each image (InstructBLIP's Q-Former), and their squares.
    image_text_tokens: int = 0
    squared_image_text_tokens: int = 0
    # How many images of each size (a grid row, or pixel height and width): a Qwen-VL tower's cost depends on it.
    image_sizes: Counter = field(default_factory=Counter)

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def count_tokens(micro_batches: list[dict]) -> TokenCounts | None:
    """This rank's token counts of one optimizer step's micro-batches, made on the CPU.

    Counted from a micro-batch's ``attention_mask`` and ``labels``, which the model's ``prepare_batch`` adds on the
    host before the step (``data.TrainData.prepare``). None if the model's batches have no tokens.
    """
    total = TokenCounts()
    for batch in micro_batches:
        if not ("attention_mask" in batch and "labels" in batch):
            return None
        total += _counts(batch)
    return total


def _counts(tokens: dict[str, torch.Tensor]) -> TokenCounts:
    mask = tokens["attention_mask"]
    # A packed row holds several samples, each attending only to itself: attention costs their own lengths squared.
    lengths = torch.as_tensor(tokens["sample_lengths"]) if "sample_lengths" in tokens else mask.sum(dim=1)
    # The loss reads the labels shifted by one (token t predicts t + 1): count the tokens it counts.
    supervised = torch.count_nonzero(tokens["labels"][:, 1:] != IGNORE_INDEX)
    # One row per image, as an instruction connector's `prepare` names them (connectors.instruction).
    text = tokens.get("qformer_attention_mask")
    text = [] if text is None else torch.as_tensor(text).sum(dim=1).tolist()
    # A few dozen integers: summed in Python after one conversion each (every tensor op is a call into torch).
    lengths = lengths.tolist()
    return TokenCounts(samples=len(lengths), images=batch_images(tokens), image_sizes=Counter(image_sizes(tokens)),
                       positions=mask.numel(), tokens=sum(lengths), supervised=int(supervised),
                       squared_tokens=sum(n * n for n in lengths), image_text_tokens=sum(text),
                       squared_image_text_tokens=sum(n * n for n in text))


def peak_tflops(given: float | None, precision: str | None) -> tuple[float | None, str | None]:
    """The peak TFLOP/s per device that MFU divides by, and why there is none (a note for the log) if none.

    ``given`` (run.peak_tflops) if set; else the device's dense bf16 peak (``common.hardware``) for a bf16/fp16
    run (``precision``: run.precision). An fp32 run gets none by itself: its matmuls do not run at the bf16 rate.
    """
    if given:
        return float(given), None
    name = device_name()
    unset = "set run.peak_tflops (the device's peak TFLOP/s for this precision) to log it"
    if name == "CPU":
        return None, f"MFU is not logged: there is no peak FLOP/s table for CPUs; {unset}"
    if precision not in ("bf16", "fp16"):
        return None, (f"MFU is not logged: this run computes in {precision} and the table "
                      f"holds bf16 peaks; {unset}")
    peak = peak_bf16_tflops(name)
    if peak is None:
        return None, f"MFU is not logged: no peak FLOP/s is known for {name}; {unset}"
    return peak, None


class ThroughputMeter:
    """Training time and token counts between logged steps, turned into rates at each logged step.

    The logger calls ``step_done`` first thing after every step and ``report`` at logged steps; ``mark`` is
    called once a step's hooks are done (hooks.TrainingClock, last in the hook list), so the time of
    evaluations and saves is left out.
    """

    def __init__(self, peak: float | None = None, precision: str | None = None) -> None:
        """``peak``, ``precision``: run.peak_tflops and run.precision (``peak_tflops``)."""
        self.peak, self.precision = peak, precision
        self.flops, self.peak_tflops, self.note = None, None, None  # start()'s
        self.seconds, self.steps, self.counts, self.since = 0.0, 0, TokenCounts(), 0.0  # _reset()'s

    def start(self, module: torch.nn.Module, rank: int) -> None:
        """Before training: what the model costs per sample, the device's peak, a clean slate."""
        flop_model = getattr(module, "flop_model", None)
        self.flops = flop_model() if flop_model is not None else None
        self.peak_tflops, self.note = peak_tflops(self.peak, self.precision)
        self._reset()

    def mark(self) -> None:
        """The clock starts here (again): what follows until ``step_done`` is training."""
        self.since = time.perf_counter()

    def step_done(self, counts: TokenCounts | None) -> None:
        """One optimizer step is done (its hooks are not): add its time and this rank's ``counts`` (None: none)."""
        now = time.perf_counter()
        self.seconds += now - self.since
        self.since, self.steps = now, self.steps + 1
        self.counts = None if counts is None or self.counts is None else self.counts + counts

    def report(self, trainer) -> dict[str, float]:
        """Rates since the last report, over every rank. Collective: every rank calls it, at the same steps."""
        if self.note and trainer.rank == 0:  # once, with the first numbers (not in evaluate-only runs)
            report(self.note)
        self.note = None
        gathered = comm.all_gather_object((self.counts, peak_memory_bytes()))
        seconds = max(self.seconds, 1e-9)
        # A token budget fills each step with as many samples as fit: count them where the batches tell.
        counted = all(counts is not None for counts, _ in gathered)
        samples = sum(counts.samples for counts, _ in gathered) if counted else self.steps * trainer.plan.global_batch
        record = {"samples_per_sec": samples / seconds,
                  "peak_memory_gib": max(memory for _, memory in gathered) / 2**30}
        if counted:
            record.update(self._rates(sum((counts for counts, _ in gathered), TokenCounts()), seconds,
                                      trainer.world_size))
        self._reset()
        return record

    def _rates(self, total: TokenCounts, seconds: float, world_size: int) -> dict[str, float]:
        rates = {"tokens_per_sec": total.tokens / seconds, "supervised_tokens_per_sec": total.supervised / seconds,
                 "padding_share": 1 - total.tokens / max(total.positions, 1)}
        if self.flops is not None:
            # Model FLOPs of the tokens (padding excluded: compute spent on it is not useful work).
            flops = self.flops.training_flops(total.images, total.tokens, total.squared_tokens, total.supervised,
                                              total.image_text_tokens, total.squared_image_text_tokens,
                                              total.image_sizes)
            per_device = flops / seconds / world_size
            rates["tflops_per_device"] = per_device / 1e12
            if self.peak_tflops:
                rates["mfu"] = per_device / (self.peak_tflops * 1e12)
        return rates

    def _reset(self) -> None:
        self.seconds, self.steps, self.counts = 0.0, 0, TokenCounts()
        self.mark()
