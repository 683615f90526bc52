"""The reference model of DPO, without a second copy of the model.

- ``adapters``: with LoRA, the reference is the same model with its adapters disabled (peft's
  ``disable_adapter()``), run in the same step on the same image features. Exact only when the adapters are
  the only trained parameters and start at zero (peft's initialisation: the adapted model is the base model);
  adapters loaded from ``model.pretrained`` would make the disabled model another model than the start.
- ``precomputed``: one pass over the training and validation pairs before training, with the starting weights.
  The log-probs are stored in the run folder under a key hashed from the data sections, the model section (and
  the size and time of the files it reads) and the tokenizer, written in parts (each atomically: a temporary
  file renamed) so that a pass cut short continues with the parts it has. Each pair is looked up by a hash of
  its content (prompt, both answers, image pixels): a pair the pass did not score (another image
  augmentation, a changed file) is named, never given another pair's numbers.
- ``auto``: ``adapters`` where exact, else ``precomputed``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from lavis_ds.common import comm
from lavis_ds.common.errors import LavisDsError
from lavis_ds.common.modes import eval_mode
from lavis_ds.datasets.splits import concat, part_of

ReferenceKind = Literal["auto", "adapters", "precomputed"]
# Batch keys of the reference log-probs (TRL's names).
REF_CHOSEN, REF_REJECTED = "ref_chosen_logps", "ref_rejected_logps"
PASS_PART = 64  # pairs per rank in one stored part of the reference pass


# ----------------------------------------------------------------- adapters
def adapter_reference_logps(model: torch.nn.Module, batch: dict[str, Any], features: Tensor) -> dict[str, Tensor]:
    """The pairs' answer log-probs of ``model`` with its LoRA adapters disabled, on the same image features."""
    pairs = int(batch["num_pairs"])
    with torch.no_grad(), model.llm_model.disable_adapter():
        logps, _ = model.answer_logps(batch, image_features=features.detach())
    return {REF_CHOSEN: logps[:pairs], REF_REJECTED: logps[pairs:]}


def adapter_problems(model: torch.nn.Module) -> list[str]:
    """Why the adapter-disabled model is not the starting model ([] if it is)."""
    if not hasattr(getattr(model, "llm_model", None), "disable_adapter"):
        return ["the LLM has no LoRA adapters (model.get_lora: false)"]
    others = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name]
    problems = [f"parameters other than the adapters train ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}), which disabling the adapters does not undo"] if others else []
    loaded = [name for name, p in model.named_parameters() if "lora_B" in name and p.numel() and bool(p.any())]
    if loaded:
        problems.append(f"the adapters do not start at zero ({loaded[0]}: loaded from model.pretrained?), so the "
                        "model without them is not the model training starts from")
    return problems


def resolve_kind(kind: str, model: torch.nn.Module) -> str:
    """``adapters`` or ``precomputed`` for ``kind`` on ``model`` (its starting weights, before an engine wraps it)."""
    if kind == "precomputed":
        return kind
    problems = adapter_problems(model)
    if kind == "adapters" and problems:
        raise LavisDsError("run.dpo.reference: 'adapters' is not the starting model here: " + "; ".join(problems)
                           + "; use reference: precomputed (or auto)")
    return "precomputed" if problems else "adapters"


# ----------------------------------------------------------------- precomputed
def pair_keys(pairs: dict[str, Any]) -> list[str]:
    """A hash of each pair's content in a collated (not yet prepared) pair batch: its own system turn, prompt turns,
    earlier answers, both last answers, and its images' pixels as the dataset made them."""
    image, counts = pairs.get("image"), [int(n) for n in pairs["num_images"]]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    history = pairs.get("output") or [[] for _ in counts]
    systems = pairs.get("system") or [None] * len(counts)
    keys = []
    for i, (start, count) in enumerate(zip(starts, counts, strict=True)):
        content = [pairs["instruction"][i], list(history[i]), pairs["chosen"][i], pairs["rejected"][i]]
        # Without a system turn the key hashes the content alone: stores written without the field stay readable.
        digest = hashlib.sha256(json.dumps(content if systems[i] is None else [*content, systems[i]]).encode())
        if count:
            digest.update(image[start:start + count].detach().float().cpu().contiguous().numpy().tobytes())
        keys.append(digest.hexdigest())
    return keys


def store_key(cfg: Any, model: torch.nn.Module) -> str:
    """The store's key: a hash of what the reference log-probs depend on - the data sections, the model section
    and the files it reads (path, size, time), the tokenizer's vocabulary and chat template."""
    from omegaconf import OmegaConf

    model_section = OmegaConf.to_container(cfg.model, resolve=True)
    files = {}
    for key in getattr(getattr(type(model), "SETTINGS", None), "FILE_KEYS", ()):
        path = model_section.get(key)
        if isinstance(path, str) and os.path.exists(os.path.expanduser(path)):
            stat = os.stat(os.path.expanduser(path))
            files[key] = [path, stat.st_size, stat.st_mtime_ns]
    tokenizer = getattr(getattr(model, "llm", None), "tokenizer", None)
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    what = {"datasets": OmegaConf.to_container(cfg.datasets, resolve=True), "model": model_section, "files": files,
            "vocab": hashlib.sha256(json.dumps(vocab).encode()).hexdigest(),
            "template": getattr(tokenizer, "chat_template", None)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_atomically(path: Path, value: Any) -> None:
    """``torch.save`` to a temporary file, then renamed: a reader finds the whole file or none."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(value, tmp)
    os.replace(tmp, path)


def read_part(path: Path) -> dict[str, tuple[float, float]] | None:
    """A stored part, or None if it is not there or cannot be read (then the pass computes it again)."""
    try:
        return torch.load(path, weights_only=True) if path.is_file() else None
    except Exception:  # noqa: BLE001 - a damaged part is recomputed, whatever torch.load says about it
        return None


class ReferenceStore:
    """The reference log-probs of every pair, by content key (``pair_keys``): ``{key: (chosen, rejected)}``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.logps: dict[str, tuple[float, float]] = {}

    @property
    def complete_file(self) -> Path:
        return self.folder / "reference_logps.pt"

    def load(self) -> bool:
        """Read the complete store; False if the pass has not finished it."""
        logps = read_part(self.complete_file)
        if logps is None:
            return False
        self.logps = logps
        return True

    def lookup(self, pairs: dict[str, Any]) -> dict[str, Tensor]:
        """``ref_chosen_logps`` and ``ref_rejected_logps`` of a collated pair batch; a pair not in the store named."""
        keys = pair_keys(pairs)
        missing = [i for i, key in enumerate(keys) if key not in self.logps]
        if missing:
            index = pairs.get("index")
            names = [f"pair {int(index[i])}" if index is not None else f"pair {i} of the batch" for i in missing]
            raise LavisDsError(f"{', '.join(names[:3])}: not in the reference log-probs of {self.complete_file} "
                               f"(the pair's text or pixels differ from the reference pass's: a random train "
                               f"image processor, or a changed file); the reference pass scores each pair once, "
                               f"so the train vis_processor must be deterministic (blip2_image_eval, or "
                               f"tower_image_train without min_scale and hflip)")
        # Python floats, not tensors: moving a batch to the device casts its float tensors to a bf16/fp16 engine's
        # dtype (common.precision.to_compute), which would round the log-probs to 3 digits
        return {REF_CHOSEN: [self.logps[key][0] for key in keys], REF_REJECTED: [self.logps[key][1] for key in keys]}

    def compute(self, engine: Any, scorer: Any, dataset: Any, batch_size: int, rank: int, world_size: int,
                name: str) -> dict[str, tuple[float, float]]:
        """The pass over one split (collective): every pair of ``dataset`` scored by ``engine`` with ``scorer``, in
        parts of ``PASS_PART`` pairs per rank (``<name>_part_<k>.pt``); parts already stored are read, not
        recomputed. Rank 0 writes. Returns the split's log-probs (also added to ``logps``)."""
        collate = part_of(dataset, 0)[1].collater
        size = PASS_PART * world_size
        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        logps: dict[str, tuple[float, float]] = {}
        for part, start in enumerate(range(0, len(dataset), size)):
            path = self.folder / f"{name}_part_{part:05d}.pt"
            stored = read_part(path)
            if all(comm.all_gather_object(stored is not None)):
                logps.update(stored)
                continue
            end = min(start + size, len(dataset))
            mine = list(range(start + rank, end, world_size))
            longest = -(-(end - start) // world_size)  # the most pairs a rank has in this part
            scored: dict[str, tuple[float, float]] = {}
            for step in range(-(-longest // batch_size)):  # every rank as many forwards (collective when sharded)
                indices = mine[step * batch_size:(step + 1) * batch_size]
                pairs = collate([dataset[i] for i in (indices or [start])])
                out = engine.forward(scorer.prepare(engine.module, pairs))
                if indices:
                    values = out["logps"].double().cpu().view(2, -1).T.tolist()
                    scored.update(zip(pair_keys(pairs), map(tuple, values), strict=True))
            part_logps = {key: value for gathered in comm.all_gather_object(scored) for key, value in gathered.items()}
            logps.update(part_logps)
            if rank == 0:
                write_atomically(path, part_logps)
            comm.barrier()
        self.logps.update(logps)
        return logps

    def finish(self, rank: int, summary: dict[str, dict]) -> None:
        """The complete store and its summary (per split: pairs, the starting model's preference accuracy), written
        by rank 0 once every split is scored."""
        if rank == 0:
            (self.folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            write_atomically(self.complete_file, self.logps)
        comm.barrier()


def preference_accuracy(logps: dict[str, tuple[float, float]]) -> float:
    """The share of pairs whose chosen answer the scored model finds likelier (``logps/accuracies``)."""
    return sum(chosen > rejected for chosen, rejected in logps.values()) / max(len(logps), 1)


def reference_line(split_summary: dict[str, Any]) -> str:
    """What the reference pass says of a split: the records' count, with the distinct pairs beside it (pairs of
    identical content are scored once, and the share counts each content once)."""
    pairs, distinct = split_summary["pairs"], split_summary["distinct"]
    return (f"the starting model prefers the chosen answer of {split_summary['logps/accuracies']:.3f} of {pairs} "
            f"pairs ({distinct} distinct)")


def precomputed_store(trainer: Any, resuming: bool) -> ReferenceStore:
    """The reference log-probs of the run's training and validation pairs: stored, or computed now by the trainer's
    engine with the starting weights (collective). ``resuming``: the weights will be a checkpoint's, so a store
    that is not complete cannot be made any more."""
    run, module = trainer.run, trainer.engine.module
    store = ReferenceStore(trainer.output_dir / "reference_logps" / store_key(trainer.cfg, module))
    if store.load():
        return store
    if resuming:
        raise LavisDsError(f"{store.complete_file}: missing, and this run continues a checkpoint whose weights are no "
                           f"longer the starting model; the reference pass needs the weights training started from: "
                           f"start the run again (run.resume: false) or restore that file")
    splits = [s for s in (*run.train_splits, *(run.get("valid_splits") or ()))
              if any(s in per_split for per_split in trainer.data.datasets.values())]
    summary = {}
    with torch.no_grad(), eval_mode(module):
        for split in dict.fromkeys(splits):
            dataset = concat(trainer.data.datasets, [split])
            scored = store.compute(trainer.engine, ReferenceScorer(), dataset, run.batch_size_eval, trainer.rank,
                                   trainer.world_size, split)
            summary[split] = {"pairs": len(dataset), "distinct": len(scored),
                              "logps/accuracies": preference_accuracy(scored)}
            if trainer.rank == 0:
                print(f"lavis_ds: reference pass, {split}: {reference_line(summary[split])}", flush=True)
    store.finish(trainer.rank, summary)
    return store


class ReferenceScorer:
    """Scores a pair batch's answers with the model as it is (the reference pass): one vision pass per pair."""

    def prepare(self, model: torch.nn.Module, pairs: dict[str, Any]) -> dict[str, Any]:
        from lavis_ds.objectives import model_calls

        return {**model_calls.prepare_pairs(model, pairs), "objective": self}

    def __call__(self, model: torch.nn.Module, batch: dict[str, Any]) -> Any:
        from lavis_ds.objectives import model_calls

        features = model_calls.image_features(model, batch)
        logps, _ = model_calls.answer_logps(model, batch, features)
        return _Logps(logps.detach())


class _Logps:
    """The reference pass's forward output, as a model's forward returns it (``as_dict``)."""

    def __init__(self, logps: Tensor):
        self.logps = logps

    def as_dict(self) -> dict[str, Tensor]:
        return {"logps": self.logps}
