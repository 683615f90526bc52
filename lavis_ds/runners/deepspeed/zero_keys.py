"""The ZeRO run keys and their DeepSpeed spelling: ``run.zero_stage``, ``run.offload_optimizer``, ``run.offload_params``.

The shipped YAMLs say the ZeRO stage and CPU offload as run keys; a DeepSpeed JSON says them in
``zero_optimization``. Both spellings are read: the JSON's are twins of the run keys (``Twin``), so the config
loader refuses the two disagreeing with one message naming both (``run_config.resolve_twins``), and the run keys
are written into the JSON handed to DeepSpeed (``apply``). What only the JSON can say (NVMe offload and its paths,
``pin_memory``, bucket sizes) stays there and is kept.
"""
from __future__ import annotations

from typing import Any

from lavis_ds.common.run_config import Twin

WHERE = "run.deepspeed_config.zero_optimization"
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
# run key -> the zero_optimization subsection whose `device` says the same thing
OFFLOADS = {"offload_optimizer": "offload_optimizer", "offload_params": "offload_param"}


def _zero(ds: dict) -> dict:
    return ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}


def twins(ds: dict) -> list[Twin]:
    """What the DeepSpeed section says about the ZeRO run keys. A value that is not a stage or a device is no twin:
    the section's own checks report it."""
    zero, found = _zero(ds), []
    stage = zero.get("stage")
    if isinstance(stage, int) and not isinstance(stage, bool) and stage in (0, 1, 2, 3):
        found.append(Twin("zero_stage", f"{WHERE}.stage", stage, stage))
    for key, ds_key in OFFLOADS.items():
        section = zero.get(ds_key)
        device = section.get("device") if isinstance(section, dict) else None
        if device in OFFLOAD_DEVICES:  # without a device (only pin_memory, say) it says nothing about the run key
            found.append(Twin(key, f"{WHERE}.{ds_key}.device", device, device != "none"))
    return found


def apply(ds: dict, run: dict) -> None:
    """Write the ZeRO run keys that ``run`` sets into ``ds`` (the DeepSpeed JSON being built), keeping the rest of
    its ``zero_optimization``. The loader has checked that the two spellings agree: an offload the JSON sends to
    NVMe stays there, one it does not place goes to CPU RAM."""
    if run.get("zero_stage") is not None:
        ds["zero_optimization"] = {**_zero(ds), "stage": run["zero_stage"]}
    for key, ds_key in OFFLOADS.items():
        if run.get(key) is None:
            continue
        zero = ds["zero_optimization"] = dict(_zero(ds))
        section = dict(zero.get(ds_key) or {})
        section["device"] = (section.get("device") or "cpu") if run[key] else "none"
        zero[ds_key] = section


def spelled(run: dict, key: str) -> str:
    """Where the user gave a ZeRO setting, for messages: the run key if the run sets it, else the JSON's key."""
    if run.get(key) is not None:
        return f"run.{key}"
    return f"{WHERE}.{OFFLOADS[key]}" if key in OFFLOADS else f"{WHERE}.stage"


def no_effect_warnings(ds: dict, run: dict) -> list[str]:
    """Offload settings that are valid but change nothing at this stage (``ds``: the completed JSON)."""
    stage, warnings = _zero(ds).get("stage", 0), []
    if not isinstance(stage, int):
        return warnings
    if stage < 3 and _offloads(ds, "offload_param"):
        warnings.append(f"{spelled(run, 'offload_params')}: has no effect at ZeRO stage {stage} (parameters are "
                        f"offloaded at stage 3 only); use stage 3, or offload_optimizer to offload at stage 1-2")
    if stage == 0 and _offloads(ds, "offload_optimizer"):
        warnings.append(f"{spelled(run, 'offload_optimizer')}: has no effect at ZeRO stage 0; use stage 1, 2 or 3")
    return warnings


def _offloads(ds: dict, ds_key: str) -> bool:
    section: Any = _zero(ds).get(ds_key)
    return isinstance(section, dict) and section.get("device", "none") not in ("none", None)
