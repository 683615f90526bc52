"""The LLM side of every architecture: any transformers causal LM, its tokenizer's tokens, new embedding rows, LoRA, merge.

The LLM is whatever ``AutoModelForCausalLM`` builds from a folder or a config
(``lavis_ds.models.llm_families``). Tokens the prompt needs (``lavis_ds.models.prompt``):
the image placeholder (``<|image_pad|>`` by default) and, for ChatML prompts (a ChatML
template, or none), ``<|im_start|>`` and ``<|im_end|>``; other families' templates
write their own tokens, which their tokenizers have.

- Qwen2.5 tokenizers have all three as added special tokens, and their embedding
  matrices have spare rows (151936 or 152064 rows for 151665 tokens): nothing is
  added, nothing is resized.
- A Qwen2 tokenizer lacks ``<|image_pad|>``: it is added, and lands in a spare row
  (no resize). Its row never needs training: its input embedding is always replaced
  by an image feature, it is never a target, and generation never emits it.
- A tokenizer without ChatML tokens (e.g. a Qwen2-architecture model of another
  family) gets them added. A frozen LLM has never seen them, so a chat format built
  on them would mean nothing: their input and output rows are trained, and only
  those rows (``TokenRowsEmbedding`` / ``TokenRowsHead`` hold them as small
  separate parameters, so checkpoints of a frozen LLM hold a few rows, not the
  vocabulary). With ``freeze_llm: false`` the whole embedding trains anyway.
- A tokenizer without a pad token (Llama 3) pads with its eos token: padded
  positions are masked and never targets.

Rows are added only when a token id has no row yet; new rows start as the mean of
the old ones (deterministic, so a model rebuilt from its YAML for resuming or export
has the same rows). ``merge_llm`` turns all of it back into a plain
transformers model for export.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tokenizers import AddedToken
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers import PreTrainedTokenizerBase

from lavis_ds.common import safe_files
from lavis_ds.common.suggest import did_you_mean
from lavis_ds.models.chat_template import renders_chatml
from lavis_ds.models.llm_families import causal_lm_class
from lavis_ds.models.linear_attention import LANGUAGE_MODEL_OF
from lavis_ds.models.qwen_vl_text import TEXT_CAUSAL_LMS
from lavis_ds.models.llm_placement import current_placement, empty_weights, holds_pieces

logger = logging.getLogger(__name__)

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
QWEN_PAD_TOKEN = "<|endoftext|>"  # what every Qwen2 / Qwen2.5 tokenizer pads with


# ----------------------------------------------------------------------------- tokenizer
def is_single_token(tokenizer: PreTrainedTokenizerBase, token: str) -> bool:
    """Whether ``token`` in running text encodes to exactly its own id (and not to pieces)."""
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    return len(ids) == 1 and ids[0] == tokenizer.convert_tokens_to_ids(token)


def prepare_tokenizer(path: str | Path | None, image_token: str, prompt_tokens: Sequence[str] = ()
                      ) -> tuple[PreTrainedTokenizerBase, list[str]]:
    """Load a tokenizer folder and make sure the prompt's tokens (ChatML's if it renders ChatML, the image token,
    ``prompt_tokens``: the prompt's other special tokens, Qwen-VL's ``<|vision_start|>``) and a pad token
    work.

    Returns:
        ``(tokenizer, added)``: ``added`` lists the tokens that were not single tokens of
        the folder's tokenizer and are now added special tokens, in the order
        ``<|im_start|>``, ``<|im_end|>``, ``image_token``.
    """
    if path is None:
        raise ValueError("the model needs a tokenizer: set model.tokenizer (or model.llm_model) to a local folder")
    tokenizer = AutoTokenizer.from_pretrained(path)
    added = []
    for token in (*CHATML_TOKENS, image_token, *prompt_tokens) if renders_chatml(tokenizer) \
            else (image_token, *prompt_tokens):
        if not is_single_token(tokenizer, token):
            # special: never split by the BPE, dropped by decode(skip_special_tokens=True).
            tokenizer.add_tokens([AddedToken(token, special=True, normalized=False)], special_tokens=True)
            added.append(token)
    if added:
        logger.info("tokenizer %s: added %s", path, ", ".join(added))
    if tokenizer.pad_token is None:
        # Qwen pads with <|endoftext|>; padded positions are masked, so any real token would do (Llama 3: its eos).
        tokenizer.pad_token = (QWEN_PAD_TOKEN if is_single_token(tokenizer, QWEN_PAD_TOKEN)
                               else tokenizer.eos_token or CHATML_TOKENS[1])
    if tokenizer.pad_token == image_token:
        # Padding would count as image positions and break the placeholder replacement.
        raise ValueError(f"tokenizer {str(path)!r} pads with the image token {image_token!r}; "
                         "set model.image_token to another token")
    return tokenizer, added


def num_token_ids(tokenizer: PreTrainedTokenizerBase) -> int:
    """Rows an embedding needs for every id the tokenizer can produce."""
    return max(tokenizer.get_vocab().values()) + 1


def fit_embeddings(llm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Add embedding (and output) rows if some token id has none; True if it resized.

    New rows are the mean of the old rows: deterministic, unlike transformers'
    default (mean plus random noise), so a model rebuilt from its YAML has the same rows.
    An engine that built the LLM partitioned gets the whole matrices transformers resizes into back in pieces.
    """
    old = llm.get_input_embeddings().num_embeddings
    needed = num_token_ids(tokenizer)
    if needed <= old:
        return False
    llm.resize_token_embeddings(needed, mean_resizing=False)
    matrices = list({id(m.weight): m.weight for m in (llm.get_input_embeddings(), llm.get_output_embeddings())
                     if m is not None}.values())  # once if input and output are tied
    placement = current_placement()
    with placement.gathered(matrices, modifier_rank=0), torch.no_grad():
        for matrix in matrices:
            matrix[old:] = matrix[:old].mean(dim=0, keepdim=True)
    placement.partition_like_the_rest(llm, matrices)
    logger.info("LLM embeddings resized from %d to %d rows", old, needed)
    return True


def build_llm(path: str | Path | None, config: PretrainedConfig | None, dtype: torch.dtype | None,
              tokenizer: PreTrainedTokenizerBase, random_state: torch.Tensor | None = None) -> PreTrainedModel:
    """The causal LM with a row for every token id, where the surrounding ``llm_placement`` puts it.

    ``path``: a Hugging Face folder to load; else a random initialisation of ``config``.
    ``dtype``: None keeps the folder's dtype (fp32 for a random initialisation); an engine that builds
    it partitioned may cast it to its own. Built with the random number generator forked (see
    ``lavis_ds.models.llm_placement``), from ``random_state`` (``torch.random.get_rng_state()``) where given.
    """
    placement = current_placement()
    with torch.random.fork_rng(devices=[]), placement.building():  # resizing builds new matrices: placed too
        if random_state is not None:
            torch.random.set_rng_state(random_state)
        llm = placement.build(Recipe(path, config, dtype))
        fit_embeddings(llm, tokenizer)
    return llm


@dataclass(frozen=True)
class Recipe:
    """The causal LM a model asks for, and the ways a placement can make it (``llm_placement.LLMRecipe``).

    ``AutoModelForCausalLM`` picks the class from the folder's or the config's ``model_type``.
    """

    path: str | Path | None  # a Hugging Face folder, or None: a random initialisation of ``config``
    config: PretrainedConfig | None
    dtype: torch.dtype | None  # None: the folder's (fp32 for a random initialisation)

    def whole(self) -> PreTrainedModel:
        if self.path is not None:
            model_type = _folder_config(self.path).model_type
            own = TEXT_CAUSAL_LMS.get(LANGUAGE_MODEL_OF.get(model_type, model_type))  # not in AutoModelForCausalLM
            with safe_files.library_reads(self.path):  # a .bin weights file is a pickle: refused by name if unsafe
                return (own or AutoModelForCausalLM).from_pretrained(self.path, dtype=self.dtype or "auto")
        llm = causal_lm_class(self.config)(self.config)
        return llm if self.dtype is None else llm.to(self.dtype)

    def from_config(self) -> PreTrainedModel:
        config = self.config if self.path is None else _folder_config(self.path)
        # _from_config: transformers builds it partitioned from the start under a live ZeRO-3 HfDeepSpeedConfig.
        return causal_lm_class(config)._from_config(config, dtype=self.dtype)

    def empty(self) -> PreTrainedModel:
        with empty_weights():
            return self.from_config()

    def with_file_dtype(self) -> Recipe:
        """The same LLM in ``dtype``, else the folder's config.json ``dtype`` (fp32 if it names none, and for a
        random initialisation): every process knows it without reading the weights."""
        if self.dtype is not None:
            return self
        if self.path is None:
            return replace(self, dtype=torch.float32)
        config = self.config or AutoConfig.from_pretrained(self.path)
        named = config.dtype or config.get_text_config().dtype  # a vision-language folder may name it in text_config
        return replace(self, dtype=getattr(torch, named) if isinstance(named, str) else (named or torch.float32))


def _folder_config(path: str | Path) -> PretrainedConfig:
    """The folder's config, said aloud where the folder is a vision-language model: the LLM slot takes
    its language model (``model.language_model.*``, ``lm_head``) and says so, as transformers' causal LM class
    leaves its vision tower (``model.visual.*``) out without a word."""
    config = AutoConfig.from_pretrained(path)
    if config.model_type in LANGUAGE_MODEL_OF:
        logger.warning("lavis_ds: model.llm_model %s is a %s vision-language folder: the LLM slot loads its language "
                       "model only and leaves its vision tower (model.visual.*) unused; the architecture's own image "
                       "path encodes the images", path, config.model_type)
    return config


# ----------------------------------------------------------------------------- trainable token rows
class TokenRowsEmbedding(nn.Module):
    """An input embedding whose rows for ``token_ids`` come from the small trainable ``rows``.

    ``base`` (the LLM's embedding, frozen) still holds every row; the forward pass
    takes the rows of ``token_ids`` from ``rows`` instead. ``rows`` starts as a copy
    of those base rows, so the model is unchanged until it trains.
    """

    def __init__(self, base: nn.Embedding, token_ids: list[int]):
        super().__init__()
        self.base = base
        # Not saved: the ids follow from the tokenizer, which the run's output_dir holds.
        self.register_buffer("token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        # fp32 like peft's adapters: the engine casts it with the rest in bf16/fp16 runs.
        self.rows = nn.Parameter(_rows_of(base.weight, self.token_ids))

    # What transformers and lavis_ds read from an input embedding.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def num_embeddings(self) -> int:
        return self.base.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.base.embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.base(input_ids)
        match = input_ids.unsqueeze(-1) == self.token_ids  # [..., n_rows]
        # One-hot x rows picks each position's row and keeps the gradient path to `rows`.
        picked = match.to(self.rows.dtype) @ self.rows
        return torch.where(match.any(-1, keepdim=True), picked.to(out.dtype), out)


class TokenRowsHead(nn.Module):
    """An output layer whose logits for ``token_ids`` come from trainable ``rows``.

    For tied embeddings pass the ``TokenRowsEmbedding``'s ``rows``: one parameter
    registered in both modules, as transformers ties the full matrices.
    """

    def __init__(self, base: nn.Linear, token_ids: list[int], rows: nn.Parameter | None = None):
        super().__init__()
        if base.bias is not None:
            raise ValueError("TokenRowsHead supports output layers without bias (as the lm_head of Qwen2, Llama, ...)")
        self.base = base
        self.register_buffer("token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        self.rows = rows if rows is not None else nn.Parameter(_rows_of(base.weight, self.token_ids))

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden)
        new = F.linear(hidden, self.rows.to(hidden.dtype)).to(logits.dtype)
        return logits.index_copy(-1, self.token_ids, new)


def _rows_of(matrix: nn.Parameter, token_ids: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of the rows ``token_ids`` of ``matrix`` (gathered first if the build partitioned it)."""
    with current_placement().gathered([matrix]):
        return matrix.detach()[token_ids].float().clone()


def train_token_rows(llm: PreTrainedModel, token_ids: list[int]) -> None:
    """Make the input and output rows of ``token_ids`` trainable, and nothing else of the embeddings."""
    embedding, head = llm.get_input_embeddings(), llm.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    new_embedding = TokenRowsEmbedding(embedding, token_ids)
    llm.set_input_embeddings(new_embedding)
    if head is not None:
        llm.set_output_embeddings(TokenRowsHead(head, token_ids, new_embedding.rows if tied else None))


def fold_token_rows(llm: PreTrainedModel) -> None:
    """Write trained token rows into the plain embedding matrices and put the plain modules back."""
    embedding, head = llm.get_input_embeddings(), llm.get_output_embeddings()
    with torch.no_grad():
        for module in (embedding, head):
            if isinstance(module, (TokenRowsEmbedding, TokenRowsHead)):
                module.base.weight[module.token_ids] = module.rows.to(module.base.weight.dtype)
    if isinstance(embedding, TokenRowsEmbedding):
        llm.set_input_embeddings(embedding.base)
    if isinstance(head, TokenRowsHead):
        llm.set_output_embeddings(head.base)


# ----------------------------------------------------------------------------- LoRA
def lora_target_names(llm: nn.Module) -> list[str]:
    """Names (last component) of the linear layers in the LLM's decoder blocks: what LoRA can target."""
    decoder = llm.get_decoder() if hasattr(llm, "get_decoder") else llm
    return sorted({name.rsplit(".", 1)[-1] for name, module in decoder.named_modules()
                   if name and isinstance(module, nn.Linear)})


def check_lora_targets(llm: nn.Module, targets: list[str]) -> None:
    """Raise ``ValueError`` naming every entry of ``lora_target_modules`` that is no linear layer of ``llm``.

    An entry matches as peft matches it: a module's full name or a dotted suffix of
    it (``q_proj``, ``self_attn.q_proj``).
    """
    valid = lora_target_names(llm)
    if not targets:
        raise ValueError(f"model.lora_target_modules is empty; valid names: {', '.join(valid)}")
    decoder = llm.get_decoder() if hasattr(llm, "get_decoder") else llm
    linear = [name for name, module in decoder.named_modules() if isinstance(module, nn.Linear)]
    problems = []
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in linear):
            hint = did_you_mean(target, valid)
            problems.append(f"{target!r} ({hint})" if hint else repr(target))
    if problems:
        raise ValueError(f"model.lora_target_modules: {', '.join(problems)} is not a linear layer of the LLM "
                         f"({type(llm).__name__}); valid names: {', '.join(valid)} "
                         "(or a dotted suffix such as 'self_attn.q_proj')")


def lora_problem(get_lora: bool, freeze_llm: bool) -> str | None:
    """Why ``get_lora`` cannot be had with ``freeze_llm``, or None: the rule the config check reports and the
    model's constructor refuses."""
    if get_lora and not freeze_llm:
        return "model.get_lora: true trains only the LoRA adapters, so it needs model.freeze_llm: true"
    return None


def add_lora(llm: PreTrainedModel, r: int, alpha: int, dropout: float, targets: list[str]) -> nn.Module:
    """Wrap ``llm`` in a peft LoRA model on ``targets`` (checked first); peft freezes everything else.

    Under ZeRO-3 ``llm`` is partitioned (built inside ``zero.Init``): peft reads only the
    layers' sizes (``in_features``/``out_features``, kept by a partitioned ``nn.Linear``)
    and creates the adapters whole, in the base weights' dtype; the engine partitions them
    with the rest when it wraps the model. What users report failing with ZeRO-3 + peft is not done
    here: ``modules_to_save`` (a deepcopy of partitioned modules), merging partitioned
    weights (``merge_llm`` refuses them), initialisations that read the base weights
    (PiSSA, ...). With meta base weights (FSDP, processes other than 0) the adapters are
    moved to meta too and receive process 0's values with the rest.
    """
    from peft import LoraConfig, get_peft_model  # only LoRA runs need peft

    check_lora_targets(llm, targets)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        task_type="CAUSAL_LM")
    return get_peft_model(llm, config)


def base_llm(llm: nn.Module) -> PreTrainedModel:
    """The transformers model inside a peft wrapper (or ``llm`` itself)."""
    from peft import PeftModel

    return llm.get_base_model() if isinstance(llm, PeftModel) else llm


def merge_llm(llm: nn.Module) -> PreTrainedModel:
    """A plain transformers model with LoRA merged (peft ``merge_and_unload``) and token rows folded in.

    Changes ``llm`` in place (the weights are shared); the result is what
    ``save_pretrained`` writes and ``from_pretrained`` reads back.
    """
    if holds_pieces(list(llm.parameters())):
        raise RuntimeError("merge the LLM of a model outside the training engine: some of these parameters hold "
                           "only this process's piece. Build the model from the run's config.yaml and load the "
                           "checkpoint's trained weights into it (lavis_ds.apps.export does), then merge.")
    from peft import PeftModel

    if isinstance(llm, PeftModel):
        llm = llm.merge_and_unload()
    fold_token_rows(llm)
    # lavis_ds's subclass of a transformers class (Qwen3.5's, for packing) saves as the transformers class
    return llm.as_transformers() if hasattr(llm, "as_transformers") else llm
