"""Published weights into our models: LAVIS ``eva_vit_g.pth``, LAVIS BLIP-2 ``.pth``, Hugging Face BLIP-2 folders.

One job: read a checkpoint, rename its keys to ours, check them strictly, copy them in.
Every key of a file is accounted for: it is mapped onto one of our tensors, or it
matches the documented list of keys we knowingly skip (``SKIPPED_KEYS``); anything
else, a key we need that the file lacks, or a shape that differs, raises
``CheckpointError`` naming the file and the keys.

Key names come from the publishers' own code: LAVIS ``lavis/models/eva_vit.py``
(EVA's ``VisionTransformer``, whose names our timm-based ``EvaViT`` keeps),
``lavis/models/blip2_models/{blip2,blip2_qformer,blip2_t5,Qformer}.py``, and the
inverse of transformers' ``convert_blip_2_original_to_pytorch.py`` (which also
shows that HF's ``vision_model.post_layernorm`` is BLIP-2's ``ln_vision``).
"""
from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from lavis_ds.common import safe_files
from lavis_ds.common.errors import CheckpointError  # noqa: F401  (raised here; importers name it pretrained.CheckpointError)
from lavis_ds.common.renamed_keys import renamed

logger = logging.getLogger(__name__)

EVA_VIT, LAVIS_BLIP2, HF_BLIP2 = "eva_vit", "lavis_blip2", "hf_blip2"
FORMATS = {
    EVA_VIT: "LAVIS eva_vit_g.pth: a plain EVA ViT state dict (cls_token, pos_embed, patch_embed.proj.*, blocks.N.*)",
    LAVIS_BLIP2: "LAVIS BLIP-2 .pth: {'model': state dict} with Qformer.bert.*, query_tokens, ln_vision.* "
                 "and optionally visual_encoder.*",
    HF_BLIP2: "Hugging Face BLIP-2 folder (Blip2ForConditionalGeneration.save_pretrained: model.safetensors "
              "or model.safetensors.index.json with its shards)",
}

# Keys each format may hold that we knowingly do not load: {readable name: regex matched at the key's start}.
SKIPPED_KEYS: dict[str, dict[str, str]] = {
    # EVA-ViT-G has 40 blocks and BLIP-2 uses 39: the blocks at and beyond the model's depth are skipped
    # too, see `_extra_blocks` (they depend on the model, so they are not a fixed pattern).
    EVA_VIT: {},
    LAVIS_BLIP2: {
        # BERT LM head: only stage 1's image-grounded captioning loss uses it
        "Qformer.cls.*": r"Qformer\.cls\.",
        # text-token inputs and the text-token FFN: BLIP-2 feeds only queries (they use the *_query FFN)
        "Qformer.bert.embeddings.{word_embeddings,position_embeddings,position_ids}":
            r"Qformer\.bert\.embeddings\.(word_embeddings|position_embeddings|position_ids)\b",
        "Qformer.bert.encoder.layer.N.{intermediate,output}.*":
            r"Qformer\.bert\.encoder\.layer\.\d+\.(intermediate|output)\.",
        # stage 1's contrastive and matching heads
        "vision_proj.*, text_proj.*, itm_head.*, temp": r"((vision_proj|text_proj|itm_head)\.|temp$)",
        # BLIP-2's own LLM and its projection; ours is Qwen behind llm_proj
        "{t5,opt}_{proj,model}.*": r"(t5|opt)_(proj|model)\.",
    },
    # the OPT/T5 LLM and its projection
    HF_BLIP2: {"language_model.*": r"language_model\.", "language_projection.*": r"language_projection\."},
}
BRIDGE_PREFIXES = ("ln_vision.", "qformer.", "query_tokens")  # what every BLIP-2 checkpoint must give us
VIT_PREFIX = "visual_encoder."

# Hugging Face BLIP-2 names -> ours: the inverse of transformers' conversion script. The tail of the key is kept.
HF_RENAMES = (
    (r"vision_model\.embeddings\.class_embedding$", "visual_encoder.cls_token"),
    (r"vision_model\.embeddings\.position_embedding$", "visual_encoder.pos_embed"),
    (r"vision_model\.embeddings\.patch_embedding\.", "visual_encoder.patch_embed.proj."),
    (r"vision_model\.encoder\.layers\.(\d+)\.layer_norm([12])\.", r"visual_encoder.blocks.\1.norm\2."),
    (r"vision_model\.encoder\.layers\.(\d+)\.self_attn\.qkv\.", r"visual_encoder.blocks.\1.attn.qkv."),
    (r"vision_model\.encoder\.layers\.(\d+)\.self_attn\.projection\.", r"visual_encoder.blocks.\1.attn.proj."),
    (r"vision_model\.encoder\.layers\.(\d+)\.mlp\.", r"visual_encoder.blocks.\1.mlp."),
    (r"vision_model\.post_layernorm\.", "ln_vision."),
)
# LAVIS Q-Former (a BertLMHeadModel, used through `.bert`) -> transformers' Blip2QFormerModel, as that script does.
LAVIS_QFORMER_RENAMES = (
    (r"Qformer\.bert\.embeddings\.LayerNorm\.", "qformer.layernorm."),
    (r"Qformer\.bert\.encoder\.layer\.(\d+)\.(attention|crossattention)\.self\.",
     r"qformer.encoder.layer.\1.\2.attention."),
    (r"Qformer\.bert\.", "qformer."),
)


# ----------------------------------------------------------------- public API
def load_eva_vit(vit: nn.Module, path: str | Path) -> None:
    """Load LAVIS's ``eva_vit_g.pth`` (EVA layout) into an ``EvaViT``; blocks beyond its depth are skipped.

    The position embedding is interpolated when the file's patch grid differs from the model's.
    """
    fmt, state, _ = read_checkpoint(path)
    if fmt != EVA_VIT:
        raise CheckpointError(f"{path}: is a {FORMATS[fmt]}, but a ViT checkpoint needs a {FORMATS[EVA_VIT]}. "
                              "Give BLIP-2 checkpoints as the model's `pretrained` instead.")
    extra = _extra_blocks(state, len(vit.blocks))
    state = {k: v for k, v in state.items() if k not in extra}
    state = fit_pos_embed(state, "pos_embed", vit)
    load_checked(vit, state, vit.state_dict().keys(), path, EVA_VIT)
    _log_skipped(path, extra)


def load_blip2(model: nn.Module, path: str | Path, vit_loaded: bool) -> None:
    """Load a LAVIS BLIP-2 ``.pth`` or a Hugging Face BLIP-2 folder into a ``blip2_qwen`` (format auto-detected).

    Loads ``ln_vision``, the Q-Former, ``query_tokens`` and, when the file has them, the ViT. The file's keys are
    renamed to BLIP-2's names (``visual_encoder.*``, ``ln_vision.*``, ``qformer.*``, ``query_tokens``, which the
    messages use), then by the model's ``RENAMED_KEYS`` to its parts' (``vision_tower.vit.*``, ``connector.*``).
    LAVIS saves only trained parameters, so its BLIP-2 files usually hold no ViT: then the
    ViT must already be loaded (``vit_loaded``, from ``vit_pretrained``), or this raises.
    """
    fmt, state, skipped = read_checkpoint(path)
    if fmt == EVA_VIT:
        raise CheckpointError(f"{path}: is a {FORMATS[EVA_VIT]}; give it as `vit_pretrained`. `pretrained` takes a "
                              f"{FORMATS[LAVIS_BLIP2]} or a {FORMATS[HF_BLIP2]}.")
    if fmt == HF_BLIP2:
        _check_hf_architecture(Path(path).expanduser(), model)
    renames = HF_RENAMES if fmt == HF_BLIP2 else LAVIS_QFORMER_RENAMES
    to_parts = getattr(model, "RENAMED_KEYS", ())

    def ours(key: str) -> str:
        return renamed(rename_key(key, renames), to_parts)

    file_key = {ours(k): k for k in state}  # our name -> the file's, for error messages
    state = _split_qkv_bias({ours(k): v for k, v in state.items()})
    own = model.state_dict().keys()
    bridge, vit_prefix = tuple(renamed(p, to_parts) for p in BRIDGE_PREFIXES), renamed(VIT_PREFIX, to_parts)
    expected = [k for k in own if k.startswith(bridge)]
    has_vit = any(k.startswith(vit_prefix) for k in state)
    if has_vit:
        state = fit_pos_embed(state, vit_prefix + "pos_embed", model.get_submodule(vit_prefix[:-1]))
        expected += [k for k in own if k.startswith(vit_prefix)]
    elif not vit_loaded:
        raise CheckpointError(
            f"{path}: holds no visual_encoder.* (ViT) weights, and no other source gave them. LAVIS saves only "
            "trained parameters and BLIP-2 freezes its ViT, so set `vit_pretrained` to LAVIS's eva_vit_g.pth.")
    load_checked(model, state, expected, path, fmt, file_key)
    _log_skipped(path, skipped)


def read_checkpoint(path: str | Path) -> tuple[str, dict[str, torch.Tensor], list[str]]:
    """Detect the format and read the tensors.

    Returns:
        ``(format, {file key: tensor}, skipped)``: the tensors exclude the format's
        documented ``SKIPPED_KEYS``, whose names are returned in ``skipped``
        (a Hugging Face folder's LLM tensors are never read).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: checkpoint not found")
    if path.is_dir() or path.suffix == ".safetensors":
        return (HF_BLIP2, *read_safetensors_file(path, _skip_matcher(HF_BLIP2)))
    fmt, state = detect_torch_format(path, load_torch_file(path))
    skip = _skip_matcher(fmt)
    return fmt, {k: v for k, v in state.items() if not skip(k)}, [k for k in state if skip(k)]


def load_checked(model: nn.Module, state: Mapping[str, torch.Tensor], expected: Iterable[str], path: str | Path,
                 fmt: str, file_key: Mapping[str, str] | None = None) -> None:
    """Copy ``state`` into ``model`` after checking that it supplies exactly the ``expected`` keys, shape for shape.

    Values are cast to the parameters' dtype on copy, so a model's precision
    (``vit_precision``) holds whatever the file's dtype was. ``file_key`` maps our
    names back to the file's, so that errors name the keys a user can find in the file.
    """
    source = f"{path} ({fmt})"
    expected = set(expected)
    file_key = file_key or {}

    def named(key: str) -> str:
        return key if file_key.get(key, key) == key else f"{file_key[key]} (our {key})"

    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if unexpected:
        raise CheckpointError(f"{source}: {len(unexpected)} unexpected key(s): {_first([named(k) for k in unexpected])}. "
                              "Keys skipped on purpose for this format: "
                              f"{_skipped_help(fmt)}")
    if missing:
        raise CheckpointError(f"{source}: {len(missing)} key(s) the model needs are not in the file: {_first(missing)}")
    own = model.state_dict()
    for key in sorted(expected):
        if own[key].shape != state[key].shape:
            raise CheckpointError(f"{source}: shape mismatch for {named(key)}: file {tuple(state[key].shape)}, "
                                  f"model {tuple(own[key].shape)}")
    # strict=False only because the file covers part of the model (never the LLM): its keys are checked above.
    model.load_state_dict(dict(state), strict=False)
    logger.info("Loaded %d tensors from %s", len(expected), source)


# ----------------------------------------------------------------- reading
def load_torch_file(path: Path):
    # A .pth/.bin is a pickle, and unpickling arbitrary objects runs code: safe_files reads it with
    # weights_only=True and names what a crafted file asks for. mmap keeps a 2 GB ViT file out of every rank's RAM.
    try:
        return safe_files.torch_load(path, map_location="cpu", mmap=True)
    except safe_files.UnsafeFile:
        raise
    except Exception as e:  # whatever torch cannot read is not a checkpoint of ours either
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = (" Either it is not a PyTorch file, or it pickles Python objects besides tensors and plain "
                "containers, which weights_only refuses because unpickling them can run code."
                if isinstance(e, pickle.UnpicklingError) else "")
        raise CheckpointError(f"{path}: cannot be read by torch.load(weights_only=True) ({type(e).__name__}: "
                              f"{reason}).{hint} Expected one of: " + "; ".join(FORMATS.values())) from None


def detect_torch_format(path: Path, obj) -> tuple[str, Mapping[str, torch.Tensor]]:
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping) and any(
            k.startswith(("Qformer.", VIT_PREFIX, "query_tokens")) for k in obj["model"]):
        return LAVIS_BLIP2, obj["model"]
    if isinstance(obj, Mapping) and "patch_embed.proj.weight" in obj and any(k.startswith("blocks.") for k in obj):
        return EVA_VIT, obj
    top = list(obj)[:5] if isinstance(obj, Mapping) else type(obj).__name__
    raise CheckpointError(f"{path}: not a checkpoint format we know (top-level keys: {top}). Expected one of: "
                          + "; ".join(FORMATS.values()))


def read_safetensors_file(path: Path, skip: Callable[[str], bool]) -> tuple[dict[str, torch.Tensor], list[str]]:
    from safetensors import safe_open
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    from transformers.utils.hub import get_checkpoint_shard_files

    if path.is_file():
        files = [path]
    elif (path / SAFE_WEIGHTS_NAME).is_file():
        files = [path / SAFE_WEIGHTS_NAME]
    elif (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
        files, _ = get_checkpoint_shard_files(str(path), str(path / SAFE_WEIGHTS_INDEX_NAME), local_files_only=True)
    else:
        raise CheckpointError(f"{path}: folder has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}. "
                              f"Expected a {FORMATS[HF_BLIP2]}")
    state, skipped = {}, []
    for file in files:
        # safe_open reads one tensor at a time: the LLM's shards (most of the folder) are never loaded.
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if skip(key):
                    skipped.append(key)
                else:
                    state[key] = f.get_tensor(key)
    if not any(k.startswith(("vision_model.", "qformer.")) for k in state):
        raise CheckpointError(f"{path}: has no vision_model.* or qformer.* tensors, so it is not a {FORMATS[HF_BLIP2]}")
    return state, skipped


def _check_hf_architecture(path: Path, model: nn.Module) -> None:
    """Settings that change outputs without changing any shape must agree with the folder's config.json.

    (LAVIS files carry no config: for them only the shapes are checked.)
    """
    if not (path.is_dir() and (path / "config.json").is_file()):
        return
    from transformers import Blip2Config

    config = Blip2Config.from_pretrained(path)
    attn, norm = model.vision_tower.vit.blocks[0].attn, model.vision_tower.vit.blocks[0].norm1
    qformer = model.connector.qformer.config
    pairs = {  # name: (folder's value, our value)
        "vision_config.num_attention_heads (vit.num_heads)": (config.vision_config.num_attention_heads, attn.num_heads),
        "vision_config.layer_norm_eps (EVA uses 1e-6)": (config.vision_config.layer_norm_eps, norm.eps),
        "vision_config.hidden_act (EVA uses exact gelu)": (config.vision_config.hidden_act, "gelu"),
        "qformer_config.num_attention_heads": (config.qformer_config.num_attention_heads, qformer.num_attention_heads),
        "qformer_config.layer_norm_eps": (config.qformer_config.layer_norm_eps, qformer.layer_norm_eps),
        "qformer_config.hidden_act": (config.qformer_config.hidden_act, qformer.hidden_act),
    }
    wrong = [f"{name}: folder {theirs!r}, model {ours!r}" for name, (theirs, ours) in pairs.items() if theirs != ours]
    if wrong:
        raise CheckpointError(f"{path}: config.json describes another architecture than the model's: " + "; ".join(wrong))


# ----------------------------------------------------------------- mapping
def rename_key(key: str, renames) -> str:
    """Apply the first matching (pattern, replacement); a key no rule matches keeps its name."""
    for pattern, replacement in renames:
        new, n = re.subn("^" + pattern, replacement, key, count=1)
        if n:
            return new
    return key


def _split_qkv_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face fuses EVA's q/v biases into ``qkv.bias`` = [q_bias, k part, v_bias]; EVA keeps q_bias and v_bias.

    The k part starts at zero in HF and may have drifted if the model was fine-tuned there;
    dropping it changes nothing: ``q·(k + b)`` shifts every logit of a query by the same
    ``q·b``, and softmax ignores a constant shift.
    """
    out = {}
    for key, value in state.items():
        if key.endswith(".attn.qkv.bias"):
            q, _, v = value.chunk(3)
            out[key.replace("qkv.bias", "q_bias")], out[key.replace("qkv.bias", "v_bias")] = q, v
        else:
            out[key] = value
    return out


def fit_pos_embed(state: dict[str, torch.Tensor], key: str, vit: nn.Module) -> dict[str, torch.Tensor]:
    """Interpolate the patch grid of ``state[key]`` to the model's (bicubic, CLS kept), as LAVIS's
    ``interpolate_pos_embed`` does."""
    from timm.layers import resample_abs_pos_embed

    pos_embed, own = state.get(key), vit.pos_embed
    if pos_embed is None or pos_embed.shape == own.shape:
        return state
    grid = list(vit.patch_embed.grid_size)
    if pos_embed.ndim != 3 or pos_embed.shape[-1] != own.shape[-1]:
        return state  # a width mismatch is reported by the shape check, not interpolated
    # align_corners=False, no antialias: exactly LAVIS's (and HF's interpolate_pos_encoding) F.interpolate call.
    resized = resample_abs_pos_embed(pos_embed.float(), new_size=grid, num_prefix_tokens=1,
                                     interpolation="bicubic", antialias=False, align_corners=False)
    logger.info("%s: position embedding interpolated from %d to %d patches", key, pos_embed.shape[1] - 1,
                resized.shape[1] - 1)
    return {**state, key: resized}


def _extra_blocks(state: Mapping[str, torch.Tensor], depth: int) -> list[str]:
    """Keys of EVA blocks at or beyond ``depth``: BLIP-2 builds 39 of eva_vit_g.pth's 40 blocks."""
    return [k for k in state if (m := re.match(r"blocks\.(\d+)\.", k)) and int(m.group(1)) >= depth]


def _skip_matcher(fmt: str) -> Callable[[str], bool]:
    patterns = SKIPPED_KEYS[fmt].values()
    if not patterns:
        return lambda key: False
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    return lambda key: regex.match(key) is not None


def _skipped_help(fmt: str) -> str:
    extra = ["blocks.N.* with N >= the model's depth"] if fmt == EVA_VIT else []
    return "; ".join(list(SKIPPED_KEYS[fmt]) + extra) or "none"


def _log_skipped(path, skipped: list[str]) -> None:
    if skipped:
        logger.info("%s: skipped %d documented unused key(s), e.g. %s", path, len(skipped), _first(skipped))


def _first(keys: list[str], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys) - n} more)" if len(keys) > n else "")
