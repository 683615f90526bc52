"""Checks of the `run` section beyond its schema: the engine-neutral settings resolved with their twins in the
engines' sections, the token budget and packing, the splits. ``lavis_ds.config`` calls them on the merged config."""
from __future__ import annotations

from lavis_ds.common import registry as reg
from lavis_ds.common.run_config import NEUTRAL_KEYS, ZERO_KEYS, Twin, batch_unit, resolve_twins, training_settings


def engines_by_name() -> dict[str, type]:
    """Every registered engine class once, by its name (a user's subclass may share its parent's options section)."""
    return reg.engines.distinct()


def option_twins(run: dict) -> tuple[list[Twin], list[str]]:
    """What the engines' options sections of ``run`` say about the neutral run keys, and problems with it."""
    twins, problems, seen = [], [], set()
    for engine_class in engines_by_name().values():
        key = engine_class.config.KEY
        if key is None or key in seen or not isinstance(run.get(key), dict):
            continue
        seen.add(key)
        more_twins, more_problems = engine_class.config.twins(run[key])
        twins += more_twins
        problems += more_problems
    return twins, problems


def foreign_options_notes(run: dict, chosen: type) -> list[str]:
    """Another engine's options section or own run keys in this run: what of them this run's engine uses (the twins of
    the neutral run keys) and what it does not."""
    notes, seen = [], set(chosen.config.OWN_RUN_KEYS)
    for name, engine_class in engines_by_name().items():
        own = [f"run.{key}={run[key]!r}" for key in engine_class.config.OWN_RUN_KEYS
               if key not in seen and run.get(key) is not None]
        seen.update(engine_class.config.OWN_RUN_KEYS)
        if own:
            notes.append(f"{', '.join(own)}: read by {name} only; {reg.engines.canonical(run['runner'])} does not "
                         f"use {'it' if len(own) == 1 else 'them'}")
        key = engine_class.config.KEY
        if key is None or key == chosen.config.KEY or not isinstance(run.get(key), dict) or not run[key]:
            continue
        used = {twin.path.split(".")[2] for twin in engine_class.config.twins(run[key])[0] if twin.key in NEUTRAL_KEYS}
        unused = sorted(k for k in run[key] if k not in used)
        if unused:
            notes.append(f"run.{key} is {name}'s section; {reg.engines.canonical(run['runner'])} reads only what it "
                         f"says about the run keys (batch, clipping, precision, AdamW's betas/eps); not used: "
                         f"{', '.join(unused)}")
    return notes


def split_problems(run: dict, datasets: dict) -> list[str]:
    """Splits that no dataset has, and a training run with no split to train on."""
    # Split names are known only for datasets that list annotation files (generated ones have their own).
    annotations = [(section.get("build_info") or {}).get("annotations") for section in datasets.values()
                   if isinstance(section, dict)]
    splits = {s for a in annotations if a for s in a} if all(annotations) else set()
    problems = [f"run.{key}: split {split!r} is not in any dataset; available: {', '.join(sorted(splits))}"
                for key in ("train_splits", "valid_splits", "test_splits") for split in run.get(key) or []
                if splits and split not in splits]
    if run.get("train_splits") == [] and not run.get("evaluate"):  # the loop would have no data to draw from
        available = f" (available: {', '.join(sorted(splits))})" if splits else ""
        problems.append(f"run.train_splits: empty, so nothing trains; name the split(s) to train on{available}, or set "
                        "run.evaluate: true to evaluate a checkpoint without training")
    return problems


def neutral_settings(run: dict, errors: list[str], world_size: int) -> dict | None:
    """Batch layout, clipping, precision and AdamW's betas/eps from the run keys and their twins in the engines'
    sections, once their values passed the type and range checks (a micro-batch of 0 is reported once, as
    run.batch_size_train's); None if they cannot be resolved."""
    twins, problems = option_twins(run)
    errors.extend(problems)
    written = tuple(f"run.{key}" for key in NEUTRAL_KEYS + ZERO_KEYS) + tuple(twin.path for twin in twins)
    if problems or any(e.startswith(written) for e in errors):
        return None
    try:
        resolved, spelled = resolve_twins(run, twins)
        tokens = token_budget_problems(resolved, spelled, errors)  # global_batch_tokens may fix the layout
        settings = training_settings({**resolved, **tokens}, world_size, spelled)
    except ValueError as e:
        errors.append(str(e))
        return None
    if tokens and isinstance(resolved.get("max_seq_len"), int):  # else an error names it: the tokens of a step
        tokens = {**tokens, "global_batch_tokens": settings.global_batch * resolved["max_seq_len"]}
    return {**{key: resolved[key] for key in NEUTRAL_KEYS}, "batch_size_train": settings.micro_batch,
            "accum_grad_iters": settings.accum, "global_batch_size": settings.global_batch,
            "precision": settings.precision, **tokens}  # grad_norm_clip stays unset if it was: no clipping either way


def token_budget_problems(run: dict, spelled: dict[str, str], errors: list[str]) -> dict:
    """``run.batch_unit: tokens``: its problems added to ``errors``; returns the run keys it resolves (the unit, and
    the global batch in rows if ``run.global_batch_tokens`` gave it), or {} for a run counted in samples.
    ``spelled``: where a batch key was written."""
    if batch_unit(run) != "tokens":
        if run.get("global_batch_tokens") is not None:
            errors.append("run.global_batch_tokens: only with run.batch_unit: tokens (or run.packing: true); this run "
                          "counts its batches in samples (run.global_batch_size)")
        return {}
    rows, given = run.get("max_seq_len"), run.get("global_batch_tokens")
    if run.get("length_grouped"):
        errors.append("run.length_grouped: sorts micro-batches of a fixed number of samples, but this run fills them "
                      "by tokens (run.batch_unit: tokens, the default with run.packing); drop one of the two")
    if not isinstance(rows, int):
        errors.extend([] if run.get("packing") else  # packing_problems names it
                      ["run.batch_unit: tokens: set run.max_seq_len, the tokens of a row of a micro-batch"])
        return {"batch_unit": "tokens"}
    if given is None or not isinstance(given, int):
        return {"batch_unit": "tokens"}
    if given % rows:
        errors.append(f"run.global_batch_tokens={given} is not a multiple of run.max_seq_len={rows}: an optimizer step "
                      f"is a whole number of rows; e.g. {given // rows * rows or rows}")
        return {"batch_unit": "tokens"}
    if run.get("global_batch_size") not in (None, given // rows):
        where = spelled.get("global_batch_size", "run.global_batch_size")
        errors.append(f"run.global_batch_tokens={given} is {given // rows} rows of run.max_seq_len={rows}, but "
                      f"{where}={run['global_batch_size']}; give one of the two")
        return {"batch_unit": "tokens"}
    return {"batch_unit": "tokens", "global_batch_size": given // rows}


def packing_problems(run: dict, longest: int | None) -> list[str]:
    """run.packing and a token budget need a row length that holds the longest sample the model makes
    (``longest``: its settings' ``text_length()``, model.max_txt_len; None: the model does not say)."""
    if not run.get("packing") and batch_unit(run) != "tokens":
        return []
    rows = run.get("max_seq_len")
    if rows is None and run.get("packing"):
        return ["run.packing: set run.max_seq_len, the tokens of a packed row (at least model.max_txt_len"
                + (f", {longest})" if isinstance(longest, int) else ")")]
    if isinstance(rows, int) and isinstance(longest, int) and rows < longest:
        return [f"run.max_seq_len={rows} is shorter than model.max_txt_len={longest}: a sample could not fit in a "
                f"row; raise run.max_seq_len to at least {longest} or lower model.max_txt_len"]
    return []  # an LLM whose recurrent layers cannot be packed: models.linear_attention.model_packing_problems
