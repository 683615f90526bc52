"""The ``demo_shapes`` builder: the embedded demo's data, generated on first use by the build (never by the
config check, which only reads)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from lavis_ds.common import registry as reg
from lavis_ds.datasets.builders import BaseDatasetBuilder, local_path
from lavis_ds.datasets.demo_shapes import DemoShapesSpec, check_existing, ensure_demo_shapes, needs_generation


@reg.builders.register("demo_shapes")
class DemoShapesBuilder(BaseDatasetBuilder):
    """The embedded demo: coloured shapes, generated into ``build_info.storage`` on first use.

    ``build_info`` keys: ``storage`` (folder; default under ``$LAVIS_DS_CACHE`` or
    ``~/.cache/lavis_ds``), ``num_train``, ``num_val``, ``num_test``, ``image_size``, ``seed``, ``size_jitter``
    (images of random sizes around ``image_size``).
    """

    SPEC_KEYS: ClassVar[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(DemoShapesSpec))
    BUILD_INFO_KEYS: ClassVar[tuple[str, ...]] = ("storage", *SPEC_KEYS)

    @property
    def storage(self) -> Path:
        storage = self.build_info.get("storage")
        if not isinstance(storage, str) or not storage:
            raise ValueError(f"{self.where}.build_info.storage: required; the folder the demo data is "
                             f"generated into, got {storage!r}")
        return local_path(storage)

    @property
    def tokenizer_dir(self) -> Path:
        """The ChatML tokenizer trained on the demo texts (exists after ``prepare()``)."""
        return self.storage / "tokenizer"

    def spec(self) -> DemoShapesSpec:
        try:
            return DemoShapesSpec(**{k: self.build_info[k] for k in self.SPEC_KEYS if k in self.build_info})
        except ValueError as e:
            raise ValueError(f"{self.where}.build_info: {e}") from None

    def prepare(self) -> None:
        ensure_demo_shapes(self.storage, self.spec())

    def generates(self) -> list[Path]:
        try:
            return [self.storage] if needs_generation(self.storage, self.spec()) else []
        except ValueError:
            return []  # reported by check()

    def check(self) -> list[str]:
        """The section's problems; demo data not generated yet has none but its settings' (the build makes it)."""
        try:
            spec = self.spec()
            if needs_generation(self.storage, spec):
                return []
        except ValueError as e:
            return [str(e)]
        try:
            check_existing(self.storage, spec)  # another dataset, or other parameters, in that folder
        except (ValueError, FileExistsError) as e:
            return [f"{self.where}.build_info.storage: {str(e).removeprefix('demo_shapes: ')}"]
        return super().check()

    def annotation_files(self, problems: list[str] | None = None) -> dict[str, list[Path]]:
        try:
            storage = self.storage
        except ValueError as e:
            if problems is not None:
                problems.append(str(e))
            return {}
        return {split: [storage / "annotations" / f"{split}.json"] for split in ("train", "val", "test")}

    def annotation_key(self, split: str) -> str:
        return f"{self.where}.build_info.storage"

    def image_root(self, problems: list[str] | None = None) -> Path | None:
        try:
            return self.storage / "images"
        except ValueError:
            return None  # already reported by annotation_files

    def image_root_key(self) -> str:
        return f"{self.where}.build_info.storage"
