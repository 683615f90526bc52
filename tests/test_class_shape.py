"""Every class of ``lavis_ds.models`` and ``lavis_ds.runners`` answers for at most 25 public names (constants and
annotations included, over the lavis_ds classes it inherits: ``class_shape.public_members``), and every attribute a
method sets on ``self`` is declared by a constructor or a class body of the class or one of its bases
(``class_shape.late_attributes``): an object is complete once built, and a class that needs more names holds
parts instead.
"""
from __future__ import annotations

import pytest

from class_shape import late_attributes, package_classes, public_members

PACKAGES = ("lavis_ds.models", "lavis_ds.runners")
MAX_MEMBERS = 25


@pytest.fixture(scope="module")
def classes() -> dict[str, type]:
    found = package_classes(*PACKAGES)
    # the scan sees both packages, their subpackages included
    assert {"lavis_ds.runners.trainer.Trainer", "lavis_ds.runners.deepspeed.engine.DeepSpeedEngine",
            "lavis_ds.models.base.BaseModel", "lavis_ds.models.towers.eva.EvaTower"} <= set(found)
    return found


def test_every_class_answers_for_at_most_25_public_members(classes):
    over = {name: len(public_members(cls)) for name, cls in classes.items() if len(public_members(cls)) > MAX_MEMBERS}
    assert not over, (f"more than {MAX_MEMBERS} public members (name: count): {over}; hold a part that answers for "
                      "some of them rather than answering for all")


def test_no_method_sets_an_attribute_that_no_constructor_declares(classes):
    late = {name: late_attributes(cls) for name, cls in classes.items()}
    added = {f"{name}.{attr} (first set in {method})" for name, attrs in late.items() for attr, method in attrs.items()}
    assert not added, (f"attributes first set outside __init__: {sorted(added)}; declare each in the constructor "
                       "with its empty value, or build the object complete")


SAMPLE = '''
import dataclasses
import torch.nn as nn

class Base:
    LIMIT = 3
    hinted: int

    def __init__(self):
        self.in_base, self.other = 1, 2

    def start(self):
        self.started = True


class Child(Base):
    def __init__(self):
        super().__init__()
        self.count = 0

    def method(self, files):
        self.in_base = 2
        self.count += 1
        self.hinted = 3
        self.a, (self.b, *self.c) = 1, (2, 3)
        with open(files) as self.handle:
            pass
        setattr(self, "dynamic", 1)

        def inner():
            self.closure = 1


class Orphan(Base):
    def __init__(self):
        self.own = 1

    def reset(self):
        self.in_base = 0


@dataclasses.dataclass
class Record:
    field: int

    def update(self):
        self.field = 2


class Module(nn.Module):
    def freeze(self):
        self.training = False
'''


def test_the_checks_follow_bases_and_see_every_way_to_set_an_attribute(tmp_path, monkeypatch):
    """Tuple and starred targets, augmented assignment, ``with ... as``, ``setattr``, closures; a base's constructor
    declares where the class's own runs it, a bare annotation does not (a dataclass's field does, and torch's own
    ``training``)."""
    (tmp_path / "shape_sample.py").write_text(SAMPLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sample = package_classes("shape_sample")
    assert set(sample) == {f"shape_sample.{name}" for name in ("Base", "Child", "Orphan", "Record", "Module")}
    assert late_attributes(sample["shape_sample.Child"], "shape_sample") == {
        attr: "method" for attr in ("hinted", "a", "b", "c", "handle", "dynamic", "closure")}
    late = {name.split(".")[1]: late_attributes(cls, "shape_sample") for name, cls in sample.items()}
    assert late["Base"] == {"started": "start"} and late["Record"] == late["Module"] == {}
    assert late["Orphan"] == {"in_base": "reset"}  # its constructor never runs Base's
    assert public_members(sample["shape_sample.Child"], "shape_sample") == {"LIMIT", "hinted", "start", "method"}
