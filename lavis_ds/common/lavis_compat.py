"""LAVIS / MiniGPT4Qwen keys in a run YAML: each one maps to what it meant here, is ignored by name, or is refused.

MiniGPT4Qwen's published YAMLs (Coobiw/MPP-LLaVA, ``lavis/projects/``) carry LAVIS
keys. None of them may be dropped silently: ``accum_grad_iters: 16`` that is
ignored trains with a global batch 16 times too small. So every key here is one of

* mapped to the lavis_ds key with the same meaning (``MAPPED_RUN_KEYS``, precision; ``accum_grad_iters``
  and ``grad_norm_clip`` are lavis_ds keys themselves);
* ignored because it changes nothing in lavis_ds (``IGNORED``), said once in the log;
* refused, with the key to use instead (``REPLACED_RUN_KEYS``, and ignorable keys
  whose value asks for something lavis_ds does not do).

Works on plain dicts (the user's YAML before defaults are merged); imports nothing of lavis_ds outside
``common/``.
"""
from __future__ import annotations

from typing import Any, Callable

from lavis_ds.common.run_config import Twin

# run.<LAVIS key> -> run.<path of the lavis_ds key with the same meaning>
MAPPED_RUN_KEYS = {
    "resume_ckpt_path": ("resume",),
    # LAVIS's generation settings for evaluation -> model.generate arguments of the test splits
    "max_new_tokens": ("generate", "max_new_tokens"),
    "min_new_tokens": ("generate", "min_new_tokens"),
    "max_len": ("generate", "max_new_tokens"),
    "min_len": ("generate", "min_new_tokens"),
    "num_beams": ("generate", "num_beams"),
}

# run.<LAVIS key> that has no counterpart: the message says what to use instead.
REPLACED_RUN_KEYS = {
    "iters_per_epoch": "lavis_ds epochs cover the whole data; use run.max_epoch (and run.save_freq_steps "
                       "to checkpoint within an epoch)",
    "max_iters": "lavis_ds counts epochs; use run.max_epoch",
    "iters_per_inner_epoch": "lavis_ds counts epochs; use run.max_epoch and run.save_freq_steps",
    "lr_layer_decay": "use run.lr_scales (a learning-rate factor per parameter-name prefix)",
}


# (section, key) -> (when the value changes nothing, why it is ignored / what to do otherwise)
IGNORED: dict[tuple[str, str], tuple[Callable[[Any, dict], bool], str]] = {
    ("model", "load_finetuned"): (
        lambda v, s: not v,
        "true loads a LAVIS fine-tuned checkpoint; to continue a lavis_ds run use run.resume, to load published "
        "weights use model.pretrained with model.load_pretrained: true"),
    ("model", "finetuned"): (
        lambda v, s: not s.get("load_finetuned"),
        "is read only with load_finetuned: true (see model.load_finetuned)"),
    ("model", "qformer_text_input"): (  # true is InstructBLIP's Q-Former, which model.arch: instructblip always is
        lambda v, s: not v or s.get("arch") == "instructblip",
        "true feeds the instruction to the Q-Former, as model.arch: instructblip does; this architecture's "
        "Q-Former reads the image alone (as MiniGPT4Qwen's): set it false, or use model.arch: instructblip"),
    ("model", "enable_autocast"): (
        lambda v, s: True, ""),  # the whole forward runs under the engine's autocast (run.precision)
    ("model", "apply_lemmatizer"): (
        lambda v, s: not v, "true (LAVIS's spaCy lemmatizer of VQA answers) has no counterpart: the VQA metric "
                            "normalises answers as the official VQA evaluation does; set it false"),
    ("model", "llm_device_map"): (lambda v, s: True, ""),  # DeepSpeed places the model
    ("model", "prompt"): (
        lambda v, s: not v,
        "a LAVIS generation prompt is not used: the ChatML prompt is built from the data; set the system "
        "turn with model.system_prompt"),
    ("run", "device"): (lambda v, s: True, ""),  # DeepSpeed's accelerator decides
    ("run", "world_size"): (lambda v, s: True, ""),  # the launcher decides
    ("run", "dist_url"): (lambda v, s: True, ""),
    ("run", "distributed"): (lambda v, s: True, ""),
    ("run", "fsdp"): (  # LAVIS's boolean; a mapping is runner_fsdp's options section and stays
        lambda v, s: v is False,
        "true: choose the engine with run.runner: runner_fsdp (its options go in a run.fsdp mapping)"),
}

# LAVIS booleans whose key lavis_ds uses for a mapping of its own
NATIVE_WHEN_MAPPING = {("run", "fsdp")}

# model.autocast_dtype / run.autocast_dtype spellings -> run.precision
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def translate(cfg: dict, twins: list[Twin] = ()) -> tuple[list[str], list[str]]:
    """Rewrite LAVIS keys of ``cfg`` (the user's YAML as plain dicts) in place. ``twins``: what the engines'
    sections say about the neutral run keys (a LAVIS precision must agree with them).

    Returns ``(problems, notes)``: problems name the key and what to use instead;
    notes list what was ignored and what was mapped, for one log line.
    """
    problems: list[str] = []
    ignored: list[str] = []
    mapped: list[str] = []
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else None
    run = cfg.get("run") if isinstance(cfg.get("run"), dict) else None

    seen: list[tuple[str, str]] = []
    for (section_name, key), (harmless, why) in IGNORED.items():
        section = cfg.get(section_name)
        if not isinstance(section, dict) or key not in section or (section_name, key) in NATIVE_WHEN_MAPPING \
                and isinstance(section[key], dict):
            continue
        if harmless(section[key], section):
            ignored.append(f"{section_name}.{key}")
        else:
            problems.append(f"{section_name}.{key}: {section[key]!r}: {why}")
        seen.append((section_name, key))
    for section_name, key in seen:  # removed after all checks (`finetuned` reads `load_finetuned`): said once
        cfg[section_name].pop(key, None)

    if run is not None:
        for key, instead in REPLACED_RUN_KEYS.items():
            if key in run:
                run.pop(key)
                problems.append(f"run.{key}: not supported; {instead}")
        _map_precision(model, run, twins, problems, mapped)
        _map_resume_folder(run, problems, mapped, ignored)
        for key, target in MAPPED_RUN_KEYS.items():
            if key not in run:
                continue
            value = run.pop(key)
            if value is None:  # LAVIS's "not set" (resume_ckpt_path: null): nothing to map
                ignored.append(f"run.{key} (null)")
                continue
            if _put(run, target, value, f"run.{key}", problems):
                mapped.append(f"run.{key} -> run.{'.'.join(target)} = {value!r}")

    notes = []
    if ignored:
        notes.append("LAVIS/MiniGPT4Qwen keys that change nothing in lavis_ds, ignored: " + ", ".join(ignored))
    if mapped:
        notes.append("LAVIS/MiniGPT4Qwen keys mapped: " + "; ".join(mapped))
    return problems, notes


def _put(run: dict, target: tuple[str, ...], value: Any, source: str, problems: list[str]) -> bool:
    """Set run.<target> to ``value`` unless the YAML gives it already; a different value is a conflict."""
    node = run
    for key in target[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):  # e.g. an engine section still a file path: read before translating
            problems.append(f"{source}: cannot be mapped into run.{'.'.join(target[:-1])}, which is {child!r}")
            return False
        node = child
    leaf = target[-1]
    present = node.get(leaf)
    if present is not None and present != "auto" and present != value:
        problems.append(f"{source}={value!r} and run.{'.'.join(target)}={present!r} disagree; they are the same "
                        f"setting, give one")
        return False
    node[leaf] = value
    return True


def _map_resume_folder(run: dict, problems: list[str], mapped: list[str], ignored: list[str]) -> None:
    """MiniGPT4Qwen's ``resume_ckpt_load_dir`` (a checkpoints folder) and ``resume_ckpt_tag`` (one checkpoint in it)
    -> ``run.resume``: the checkpoint ``<load_dir>/<tag>``, or the newest complete one in ``<load_dir>``."""
    given = [key for key in ("resume_ckpt_load_dir", "resume_ckpt_tag") if key in run]
    load_dir, tag = run.pop("resume_ckpt_load_dir", None), run.pop("resume_ckpt_tag", None)
    if load_dir is None:
        ignored.extend(f"run.{key} (null)" for key in given if tag is None)
        if tag is not None:
            problems.append(f"run.resume_ckpt_tag={tag!r} names a checkpoint inside run.resume_ckpt_load_dir, which "
                            "is not set; give both, or the checkpoint folder as run.resume")
        return
    source = "run.resume_ckpt_load_dir" + (" + run.resume_ckpt_tag" if tag else "")
    value = f"{str(load_dir).rstrip('/')}/{tag}" if tag else str(load_dir)
    if _put(run, ("resume",), value, source, problems):
        mapped.append(f"{source} -> run.resume = {value!r}")


def _map_precision(model: dict | None, run: dict, twins: list[Twin], problems: list[str],
                   mapped: list[str]) -> None:
    """MiniGPT4Qwen's precision keys -> run.precision, checked against what the run says elsewhere."""
    lavis = _lavis_precision(model, run, problems, mapped)
    if lavis is None:
        return
    precision, source = lavis
    for twin in (t for t in twins if t.key == "precision"):  # an engine's section saying it in its words
        if not twin.agrees(precision):
            problems.append(f"{source} means {precision} but {twin.path} is {twin.written!r}; they disagree, give one")
            return
    present = run.get("precision")
    if present is not None and present != precision:
        problems.append(f"{source} means {precision} but run.precision is {present!r}; they disagree, give one")
        return
    run["precision"] = precision
    mapped.append(f"{source} -> run.precision = {precision}")


def _lavis_precision(model: dict | None, run: dict, problems: list[str], mapped: list[str]) -> tuple[str, str] | None:
    """(precision, the keys that said it) from MiniGPT4Qwen's two published spellings, or None if neither is there.

    Later (MPP-LLaVA): ``model.autocast_dtype`` is the dtype the forward runs in, whatever ``run.amp`` says.
    Earlier (MiniGPT4Qwen's runner_base): ``run.amp`` switches autocast and a GradScaler on, ``run.autocast_dtype``
    (default fp16) is the autocast dtype, ``run.loss_scale`` (default true) switches the GradScaler. LAVIS itself
    has ``run.amp`` alone: fp16 with a GradScaler.
    """
    before = len(problems)
    model_dtype = _dtype(model.pop("autocast_dtype", None) if model is not None else None, "model.autocast_dtype",
                         problems)
    run_dtype = _dtype(run.pop("autocast_dtype", None), "run.autocast_dtype", problems)
    amp, loss_scale = run.pop("amp", None), run.pop("loss_scale", None)
    problems.extend(f"run.{key}: expected true or false, got {value!r}" for key, value in
                    (("amp", amp), ("loss_scale", loss_scale)) if value is not None and not isinstance(value, bool))
    if len(problems) > before:
        return None
    if model_dtype is not None:
        if run_dtype is not None and run_dtype[0] != model_dtype[0]:
            problems.append(f"{model_dtype[1]} and {run_dtype[1]} disagree; they are the same setting, give one")
            return None
        if amp is not None:  # MiniGPT4Qwen's forward ran in autocast_dtype whatever amp said
            mapped.append(f"run.amp={amp!r} superseded by model.autocast_dtype")
        chosen = model_dtype
    elif amp:
        chosen = (run_dtype[0], f"run.amp=True with {run_dtype[1]}") if run_dtype else ("fp16", "run.amp=True")
    elif run_dtype is not None:  # without amp MiniGPT4Qwen made no autocast: the dtype was never read
        chosen = ("fp32", f"{run_dtype[1]} without run.amp=True")
    elif amp is False:
        chosen = ("fp32", "run.amp=False")
    else:
        if loss_scale is not None:
            mapped.append(f"run.loss_scale={loss_scale!r}: no effect without run.amp=True (as in MiniGPT4Qwen)")
        return None
    return chosen if _loss_scale_fits(chosen, loss_scale, problems, mapped) else None


def _dtype(value: Any, key: str, problems: list[str]) -> tuple[str, str] | None:
    """(precision, ``key=value``) of a MiniGPT4Qwen dtype setting; None if unset or not a dtype (then a problem)."""
    if value is None:
        return None
    if str(value) not in _DTYPES:
        problems.append(f"{key}: {value!r} is not a dtype; valid: {', '.join(_DTYPES)}")
        return None
    return _DTYPES[str(value)], f"{key}={value!r}"


def _loss_scale_fits(chosen: tuple[str, str], loss_scale: bool | None, problems: list[str], mapped: list[str]) -> bool:
    """``run.loss_scale`` (MiniGPT4Qwen's GradScaler switch) against the precision: fp16 here always scales the
    loss dynamically (DeepSpeed's loss scaler), bf16 and fp32 need no scaling."""
    if loss_scale is None:
        return True
    precision, source = chosen
    if precision == "fp16" and not loss_scale:
        problems.append(f"run.loss_scale: False with fp16 ({source}): fp16 training here always scales the loss "
                        "(DeepSpeed's dynamic loss scaler); fp16 gradients without it underflow. Drop "
                        "run.loss_scale, or train in bf16 (run.autocast_dtype: bf16)")
        return False
    why = "the dynamic loss scaler of fp16" if precision == "fp16" else f"{precision} needs no loss scaling"
    mapped.append(f"run.loss_scale={loss_scale!r}: {why}")
    return True
