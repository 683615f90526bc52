"""Dataset builders: one ``datasets.<name>`` config section in, ``{split: Dataset}`` out.

Section layout (LAVIS):

    datasets:
      minigpt4qwen_instruction:            # key = builder name, unless `builder:` says otherwise
        data_type: images
        build_info:
          annotations:
            train: {storage: [a.json, b.json]}   # a path or a list of paths
            val: {storage: val.json}
          images: {storage: path/to/images/}
          max_frames: 32                   # optional: frames sampled uniformly from each video record (default
                                           # 32, or the processor's own sampling: Qwen3-VL's 2 frames a second)
        vis_processor: {train: {name: blip2_image_train}, eval: {name: blip2_image_eval}}
        text_processor: {train: {name: plain_text}, eval: {name: plain_text}}   # optional

The folder that records' ``image`` and ``video`` paths are relative to is
``build_info.<data_type>.storage`` (MPP-LLaVA's rule): ``images`` by default,
``videos`` with ``data_type: videos``.
The "train" split uses the ``train`` processors, every other split the ``eval`` ones.
Relative paths are relative to the working directory; ``~`` is expanded.

Besides that layout a section may set the options of its builder's ``OPTIONS``
dataclass (every builder: ``sample_ratio``, ``skip_bad_records``; some add their
own); the config validator checks them against those fields. The processor keys are read and checked in
:mod:`lavis_ds.datasets.processor_sections`.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, ClassVar, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.utils.data import Dataset

from lavis_ds.common import dist
from lavis_ds.common import registry as reg
from lavis_ds.common.schema import check_section, fields_of
from lavis_ds.datasets.coco_caption import parse_coco_caption_file
from lavis_ds.datasets.instruction import DEFAULT_MAX_FRAMES, InstructionDataset, parse_instruction_file
from lavis_ds.datasets.llava import llava_parser
from lavis_ds.datasets.messages import parse_messages_file
from lavis_ds.datasets.loading import BadRecordsError, ParsedFiles, ParseFile, RecordLoader, describe_bad
from lavis_ds.datasets.options import LAYOUT_KEYS, CocoCaptionOptions, LlavaOptions, PairOptions, SectionOptions
from lavis_ds.datasets.preference import PairDataset, pair_parser
from lavis_ds.datasets.processor_sections import (PROCESSOR_KINDS, build_processor, merge_section_defaults,
                                                  processor_problems, processor_stage)

logger = logging.getLogger(__name__)

_DEFAULT_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "datasets"

def path_list(value: Any) -> list[str] | None:
    """A `storage` value as a list of paths, or None if it is neither a string nor a list of strings."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    return None


def local_path(path: str) -> Path:
    return Path(os.path.expanduser(path))


class BaseDatasetBuilder:
    """Builds the splits of one instruction dataset from its config section.

    Life cycle (the config loader runs the first two on every rank):
    ``prepare()`` (idempotent: generate/download data) -> ``check()`` (list every
    problem) -> ``build()`` (datasets per split).
    """

    OPTIONS: ClassVar[type[SectionOptions]] = SectionOptions
    BUILD_INFO_KEYS: ClassVar[tuple[str, ...]] = ("annotations", "images", "videos", "max_frames")
    ANNOTATION_SPLIT_KEYS: ClassVar[tuple[str, ...]] = ("storage",)
    DATA_TYPES: ClassVar[tuple[str, ...]] = ("images", "videos")
    dataset_cls: ClassVar[type[InstructionDataset]] = InstructionDataset

    def __init__(self, cfg: DictConfig | Mapping[str, Any] | None = None, *, section_name: str | None = None,
                 parsed_files: ParsedFiles | None = None) -> None:
        """
        Args:
            cfg: the ``datasets.<name>`` section; this builder's default YAML is merged under it.
            section_name: the ``<name>`` key, for error messages (default: the key ``cfg`` has in
                its parent config, else the builder's registered name).
            parsed_files: annotation files already parsed in this process (the config check's, handed
                to the build); default: this builder's own, shared by its ``check()`` and ``build()``.
        """
        self.parsed_files = ParsedFiles() if parsed_files is None else parsed_files
        if section_name is None and isinstance(cfg, DictConfig) and cfg._get_parent() is not None:
            # A node taken from `cfg.datasets` knows its key; messages then name the user's section.
            section_name = str(cfg._key())
        self.section_name = section_name or self.registered_name() or type(self).__name__
        self.where = f"datasets.{self.section_name}"
        if isinstance(cfg, DictConfig):
            # Resolve while the node still knows its root, so `${run.x}`-style interpolations work.
            cfg = OmegaConf.to_container(cfg, resolve=True)
        try:
            merged = merge_section_defaults(self.default_config(), OmegaConf.create(cfg or {}))
        except OmegaConfBaseException as e:
            raise ValueError(f"{self.where}: does not fit the builder's defaults: {e}") from None
        self.cfg: dict[str, Any] = OmegaConf.to_container(merged, resolve=True)

    # ---- defaults -------------------------------------------------------------------------------

    @classmethod
    def registered_name(cls) -> str | None:
        """The name this class is registered under, if any."""
        return next((name for name in reg.builders if reg.builders.get(name) is cls), None)

    @classmethod
    def default_config_path(cls) -> Path | None:
        """``lavis_ds/configs/datasets/<registered name>.yaml`` (layout ``datasets: {<name>: {...}}``), if it
        exists; a subclass without one of its own (a user's builder) has its nearest registered parent's."""
        name = cls._defaults_owner()
        return _DEFAULT_CONFIG_DIR / f"{name}.yaml" if name else None

    @classmethod
    def _defaults_owner(cls) -> str | None:
        for klass in cls.__mro__:
            name = klass.registered_name() if issubclass(klass, BaseDatasetBuilder) else None
            if name and (_DEFAULT_CONFIG_DIR / f"{name}.yaml").is_file():
                return name
        return None

    @classmethod
    def default_config(cls) -> DictConfig:
        """This builder's default section (empty if it has no default YAML)."""
        name = cls._defaults_owner()
        if name is None:
            return OmegaConf.create({})
        return OmegaConf.load(_DEFAULT_CONFIG_DIR / f"{name}.yaml").datasets.get(name, OmegaConf.create({}))

    # ---- options --------------------------------------------------------------------------------

    @classmethod
    def section_problems(cls, section: Mapping[str, Any], where: str) -> list[str]:
        """Unknown keys (with the closest valid one), wrong types and bad values of a section's options."""
        problems: list[str] = []
        check_section(dict(section), fields_of(cls.OPTIONS), where, problems, extra_keys=LAYOUT_KEYS)
        if not problems:
            try:
                cls.OPTIONS(**{k: v for k, v in section.items() if k not in LAYOUT_KEYS})
            except ValueError as e:
                problems.append(f"{where}.{e}")
        return problems

    def options(self) -> SectionOptions:
        """The section's options (call after ``check()`` reported none of its problems)."""
        return self.OPTIONS(**{k: v for k, v in self.cfg.items() if k not in LAYOUT_KEYS})

    def parse_file(self) -> ParseFile:
        """This builder's annotation format. Default: MiniGPT4Qwen instruction JSON."""
        return parse_instruction_file

    @functools.cached_property
    def loader(self) -> RecordLoader:
        """Reads this section's files once for ``check()`` and ``build()``, with its skip policy."""
        return RecordLoader(self.parse_file(), skip=self.options().skipped_kinds(), parsed_files=self.parsed_files)

    def loader_for(self, split: str) -> RecordLoader:
        """The loader of one split. Default: one for all; formats whose evaluation samples keep several
        references together (COCO's captions per image) read evaluation splits with another."""
        return self.loader

    # ---- where the data is ----------------------------------------------------------------------

    @property
    def build_info(self) -> dict[str, Any]:
        info = self.cfg.get("build_info")
        return info if isinstance(info, dict) else {}

    def annotation_files(self, problems: list[str] | None = None) -> dict[str, list[Path]]:
        """``{split: [annotation files]}``; structural problems are appended to ``problems``."""
        problems = [] if problems is None else problems
        annotations = self.build_info.get("annotations")
        key = f"{self.where}.build_info.annotations"
        if not isinstance(annotations, dict) or not annotations:
            problems.append(f"{key}: required; map each split to {{storage: path or list of paths}}, "
                            f"e.g. annotations: {{train: {{storage: train.json}}}}")
            return {}
        files = {}
        for split, entry in annotations.items():
            if not isinstance(entry, dict):
                problems.append(f"{key}.{split}: expected {{storage: path or list of paths}}, got {entry!r}")
                continue
            for extra in entry:
                if extra == "url":
                    problems.append(f"{key}.{split}.url: downloading is not supported; remove `url` and "
                                    f"point `storage` at the local file")
                elif extra not in self.ANNOTATION_SPLIT_KEYS:
                    problems.append(f"{key}.{split}.{extra}: unknown key; valid keys: storage")
            paths = path_list(entry.get("storage"))
            if paths is None:
                problems.append(f"{key}.{split}.storage: expected a path or a non-empty list of paths, "
                                f"got {entry.get('storage')!r}")
                continue
            files[str(split)] = [local_path(p) for p in paths]
        return files

    def annotation_key(self, split: str) -> str:
        """Config key path that names ``split``'s annotation files (for messages)."""
        return f"{self.where}.build_info.annotations.{split}.storage"

    def _data_type(self) -> str:
        data_type = self.cfg.get("data_type", "images")
        return data_type if data_type in self.DATA_TYPES else "images"

    def image_root(self, problems: list[str] | None = None) -> Path | None:
        """Folder the records' image and video paths are relative to: ``build_info.<data_type>.storage``."""
        images = self.build_info.get(self._data_type())
        storage = images.get("storage") if isinstance(images, dict) else None
        if not isinstance(storage, str) or not storage:
            if problems is not None:
                problems.append(f"{self.image_root_key()}: required; the folder the records' `image` and `video` "
                                f"paths are relative to, got {storage!r}")
            return None
        return local_path(storage)

    def image_root_key(self) -> str:
        return f"{self.where}.build_info.{self._data_type()}.storage"

    def max_frames(self, problems: list[str] | None = None) -> int:
        """``build_info.max_frames``: frames sampled from each video record (MPP-LLaVA's key; default 32)."""
        value = self.build_info.get("max_frames", DEFAULT_MAX_FRAMES)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            if problems is not None:
                problems.append(f"{self.where}.build_info.max_frames: expected a positive integer (frames sampled "
                                f"uniformly from each video), got {value!r}")
            return DEFAULT_MAX_FRAMES
        return value

    # ---- life cycle -----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Idempotent setup before files are checked (generate or fetch data); the build calls it, the config
        check does not (it writes nothing). Default: nothing."""

    def generates(self) -> list[Path]:
        """Folders ``prepare()`` would still create: the config check looks for nothing inside them. Default:
        none."""
        return []

    def check(self) -> list[str]:
        """Every problem of this section, each naming its key path; empty if it can be built."""
        problems = self.section_problems(self.cfg, self.where)
        options_valid = not problems  # the skip policy, and so the record checks, depend on them
        data_type = self.cfg.get("data_type", "images")
        if data_type not in self.DATA_TYPES:
            problems.append(f"{self.where}.data_type: {data_type!r} is not supported; use one of {self.DATA_TYPES}")
        for key in self.build_info:
            if key not in self.BUILD_INFO_KEYS:
                problems.append(f"{self.where}.build_info.{key}: unknown key; valid keys: "
                                f"{', '.join(self.BUILD_INFO_KEYS)}")
        files = self.annotation_files(problems)
        self.max_frames(problems)
        root = self.image_root(problems)
        if root is not None and not root.is_dir():
            problems.append(f"{self.image_root_key()}: image folder {root} does not exist")
            root = None  # records are still checked, their image files cannot be
        if options_valid:
            problems.extend(self._record_problems(files, root))
        problems.extend(processor_problems(self.cfg, self.where, files))
        return problems

    def _record_problems(self, files: Mapping[str, list[Path]], root: Path | None) -> list[str]:
        """Missing or unreadable annotation files, and bad records the skip policy does not cover."""
        problems = []
        for split, paths in files.items():
            key = self.annotation_key(split)
            readable = True
            loader = self.loader_for(split)
            for path in paths:
                try:
                    loader.read(path, root)
                except (OSError, ValueError) as e:  # missing file, not JSON, wrong layout: the message names it
                    problems.append(f"{key}: {e}")
                    readable = False
            if not readable:
                continue
            try:
                loader.load(paths, root)
            except BadRecordsError as e:
                lines = describe_bad(e.bad)
                problems += [f"{key}: {line.strip()}" for line in lines[1:]]
                problems.append(f"{key}: {len(e.bad)} bad record(s); fix them, or set "
                                f"{self.where}.skip_bad_records: true to skip such records (counted in the log)")
            except ValueError as e:  # nothing usable left
                problems.append(f"{key}: {e}")
        return problems

    def build(self) -> dict[str, Dataset]:
        """``{split: dataset}``. Runs ``prepare()`` and ``check()`` first, so it works standalone."""
        self.prepare()
        problems = self.check()
        if problems:
            raise ValueError(f"{self.where}: cannot build:\n" + "\n".join(f"  - {p}" for p in problems))
        processors = {
            kind: {stage: build_processor(cfg) for stage, cfg in (self.cfg.get(kind) or {}).items()}
            for kind in PROCESSOR_KINDS
        }
        image_root = self.image_root()
        splits = {}
        for split, paths in self.annotation_files().items():
            splits[split] = dataset = self.dataset_cls(
                paths,
                image_root,
                vis_processor=processors["vis_processor"][processor_stage(split)],
                text_processor=processors["text_processor"].get(processor_stage(split)),
                loader=self.loader_for(split),
                replace_unreadable_images=self.options().skip_bad_records,
                # not given: the processor's own video sampling where it has one (Qwen3-VL's 2 frames a second)
                max_frames=self.max_frames() if "max_frames" in self.build_info else None,
            )
            if dataset.skip_summary and dist.is_main_process():  # every rank loads; one warning is enough
                logger.warning("%s: %s", self.annotation_key(split), dataset.skip_summary)
        return splits


@reg.builders.register("minigpt4qwen_instruction")
class InstructionBuilder(BaseDatasetBuilder):
    """MiniGPT4Qwen instruction JSON files + an image folder (the layout in the module docstring)."""


@reg.builders.register("llava_conversation")
class LlavaConversationBuilder(BaseDatasetBuilder):
    """LLaVA conversation JSON (LLaVA-Instruct-150K, llava_v1_5_mix665k) + the image folder its
    ``image`` paths are relative to; see :mod:`lavis_ds.datasets.llava` for the conversion."""

    OPTIONS = LlavaOptions

    def parse_file(self) -> ParseFile:
        return llava_parser(self.options().skip_text_only)


@reg.builders.register("chat_messages")
class ChatMessagesBuilder(BaseDatasetBuilder):
    """SFT chat records with roles (LLaMA-Factory's sharegpt, ms-swift's messages), each with its own system turn if
    it has one, + the image folder; see :mod:`lavis_ds.datasets.messages`."""

    def parse_file(self) -> ParseFile:
        return parse_messages_file


@reg.builders.register("preference_pairs")
class PreferencePairsBuilder(BaseDatasetBuilder):
    """Preference pairs (chosen and rejected answers to one prompt) in LLaMA-Factory's, ms-swift's, RLAIF-V's or
    RLHF-V's format (``pair_format``) + the image folder; see :mod:`lavis_ds.datasets.preference`."""

    OPTIONS = PairOptions
    dataset_cls = PairDataset
    SAMPLES = "pairs"  # what its samples are: the objective (run.task) must train on them

    def parse_file(self) -> ParseFile:
        return pair_parser(self.options().pair_format)


@reg.builders.register("coco_caption")
class CocoCaptionBuilder(BaseDatasetBuilder):
    """COCO-caption JSON (LAVIS/Karpathy lists or official ``captions_*.json``) + the image folder;
    every sample asks ``prompt`` and answers with a caption (see :mod:`lavis_ds.datasets.coco_caption`)."""

    OPTIONS = CocoCaptionOptions

    def parse_file(self) -> ParseFile:
        return functools.partial(parse_coco_caption_file, prompt=self.options().prompt)

    @functools.cached_property
    def eval_loader(self) -> RecordLoader:
        """Evaluation splits: one sample per image, all its captions as references (CIDEr needs them together)."""
        parse = functools.partial(parse_coco_caption_file, prompt=self.options().prompt, group_references=True)
        return RecordLoader(parse, skip=self.options().skipped_kinds(), parsed_files=self.parsed_files)

    def loader_for(self, split: str) -> RecordLoader:
        return self.loader if processor_stage(split) == "train" else self.eval_loader


# MiniGPT4Qwen's builder names (Coobiw/MPP-LLaVA, lavis/datasets/builders/minigpt4qwen_builder.py). Both of
# its builders read the same InstructionDataset: the instruction JSON (`image`, `instruction`, `output`);
# its llava_instruction data is LLaVA converted to that format (`llava_minigpt4qwen_format.json`).
reg.builders.register_alias("minigpt4_instruction", "minigpt4qwen_instruction")
reg.builders.register_alias("llava_instruction", "minigpt4qwen_instruction")
# MPP-LLaVA's video builder: the same instruction JSON with a `video` key per record, `build_info.max_frames`
# (32) frames each; its default YAML keeps the videos under `build_info.images.storage` with data_type images.
reg.builders.register_alias("videochatgpt_100k", "minigpt4qwen_instruction")
