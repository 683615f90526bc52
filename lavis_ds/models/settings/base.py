"""What a merged ``model:`` section means, read without building the model: ``ModelSettings``.

Each registered model class names its settings class in ``SETTINGS``; the config loader, the image config, the
commands and the export ask ``model_settings(arch_cls, section)`` (one object per merged section) for the
constructor's arguments, the section's problems, the files it reads, the image side and processing its tower takes,
the longest text, the prompt. Class-level facts of an architecture that only the config side reads (nested schemas,
replaced presets, file keys, default image processors) are attributes of the settings class.

A model's config keys are its constructor's keyword arguments, so a settings object is made from the model class
as well as the section (``model_settings`` hands it the class it was asked for): it reads the schema from that
class's constructor, so a user's subclass with keywords of its own has them in its settings too, whichever
settings class it names.
"""
from __future__ import annotations

from typing import Any, Mapping, Self

from omegaconf import DictConfig

from lavis_ds.common.errors import InputError
from lavis_ds.common.schema import fields_of


class ModelSettings:
    """The config side of any ``BaseModel``: its ``model:`` section read, nothing built, no weights read.

    A model with rules of its own across keys subclasses this and names it in its class's ``SETTINGS``
    (docs/extending.md); the defaults say nothing beyond the constructor's signature."""

    # model key holding a dict -> the class (or callable) whose keyword arguments its keys are
    NESTED_SCHEMAS: dict[str, Any] = {}
    # model_types of other frameworks this model cannot load -> (the preset to use instead, why)
    REPLACED_MODEL_TYPES: dict[str, tuple[str, str]] = {}
    # keys of the `model:` section naming local files or folders the model reads (checked before any rank loads)
    FILE_KEYS: tuple[str, ...] = ()
    # The image processors (train, eval) a dataset section gets when it names none; empty: its builder's defaults.
    IMAGE_PROCESSORS: dict[str, str] = {}
    # What the model's prepare_batch takes: pack_to=N, packing samples into rows (run.packing), and
    # on_image_cut="drop", leaving out the samples truncation would cut into an image (run.sft.on_image_cut).
    PACKS = False
    CUTS_IMAGE_SAMPLES = False

    def __init__(self, arch: type, section: Mapping[str, Any]):
        """``arch``: the model class whose constructor's keyword arguments are the section's keys; ``section``: one
        merged ``model:`` section (a plain mapping: what ``from_config`` would build from)."""
        self.arch = arch
        self.section = dict(section)

    def arguments(self) -> dict[str, Any]:
        """The constructor's arguments the section gives, defaults filled in (no weights read)."""
        return constructor_arguments(self.arch, self.section)

    def _for_section(self, section: Mapping[str, Any]) -> Self:
        """The same model's settings of another section (the section as a published folder completes it)."""
        return type(self)(self.arch, section)

    def problems(self) -> list[str]:
        """Problems of the section that involve several keys (the validator checks each key's type and range from
        the signature). Each names its key path. Default: none."""
        return []

    def image_size(self) -> int | None:
        """The image side the model's vision tower takes (the image processors must make it); None: no say."""
        return None

    def image_processing(self) -> Any:
        """The ``processors.image.ImageProcessing`` the model's vision tower was trained with (size, mean/std,
        resize, padding: what ``tower_image_*`` processors are filled with); None: no say."""
        return None

    def text_length(self) -> int | None:
        """The longest token sequence the model makes of a sample (it truncates there); None: no say."""
        return None

    def files(self) -> dict[str, str]:
        """Key -> local path of each file or folder the section makes the model read: ``FILE_KEYS``, and
        ``pretrained`` when ``load_pretrained`` is true."""
        keys = list(self.FILE_KEYS) + (["pretrained"] if self.section.get("load_pretrained") else [])
        return {key: self.section[key] for key in keys if self.section.get(key)}

    def with_published(self) -> dict[str, Any]:
        """The section with the settings a published folder in ``pretrained`` fixes. Default: as given."""
        return dict(self.section)

    @classmethod
    def preset_under(cls, defaults: DictConfig, section: DictConfig) -> DictConfig:
        """The preset's ``model:`` section as the user's ``section`` is merged over it. Default: all of it (a model
        whose sections depend on a name, such as a part's, drops the preset's keys of another part)."""
        return defaults


def constructor_arguments(arch: type, section: Mapping[str, Any]) -> dict[str, Any]:
    """``arch``'s constructor arguments ``section`` gives, its defaults where the section leaves one out."""
    args = {name: default for name, (_, default) in fields_of(arch).items()}
    args.update((key, value) for key, value in section.items() if key in args)
    return args


def settings_class(arch_cls: type) -> type[ModelSettings]:
    """``arch_cls.SETTINGS``, or a ``lavis_ds:`` error naming the registered class that has none."""
    settings = getattr(arch_cls, "SETTINGS", None)
    if isinstance(settings, type) and issubclass(settings, ModelSettings):
        return settings
    raise InputError(f"model.arch: {arch_cls.__module__}.{arch_cls.__name__} has no SETTINGS (a "
                     "lavis_ds.models.settings.base.ModelSettings subclass that reads its model: section), so its "
                     "config cannot be checked; register a subclass of lavis_ds.models.base.BaseModel, which has one")


def model_settings(arch_cls: type, section: Mapping[str, Any]) -> ModelSettings:
    """What ``section`` (one merged ``model:`` section) means to model class ``arch_cls``: its ``SETTINGS`` made
    from the class and the section (the one way a settings object is made outside the settings classes)."""
    return settings_class(arch_cls)(arch_cls, section)
