"""``ckpttool.fast.frozen.quick_init``: a frozen slotted dataclass built through its slots' descriptors is the same
object as the dataclass's own ``__init__`` builds: fields, defaults, ``__post_init__``, equality, hashing,
frozenness, ``replace`` and pickling."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from ckpttool.layout.layout import Box, Piece
from ckpttool.fast.frozen import quick_init


@dataclasses.dataclass(frozen=True, slots=True)
class Plain:
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError(f"a={self.a}")


@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class Quick:
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError(f"a={self.a}")


def test_built_as_the_dataclass_builds_it():
    for args, kwargs in [((1,), {}), ((1, "x"), {}), ((1,), {"c": (2, 3)}), ((), {"a": 4, "b": "y", "c": (5,)})]:
        plain, quick = Plain(*args, **kwargs), Quick(*args, **kwargs)
        assert (plain.a, plain.b, plain.c) == (quick.a, quick.b, quick.c)
        assert quick == Quick(*args, **kwargs) and hash(quick) == hash(Quick(*args, **kwargs))
    assert str(inspect.signature(Quick)) == str(inspect.signature(Plain))
    with pytest.raises(ValueError, match="a=-1"):  # __post_init__ runs
        Quick(-1)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'a'"):
        Quick()


def test_still_frozen_and_replaced_and_pickled_as_before():
    piece = Piece("f", "k", Box((0, 0), (2, 3)), "F32", byte_length=24)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'file'"):
        piece.file = "g"  # type: ignore[misc]
    assert dataclasses.replace(piece, key="z") == Piece("f", "z", Box((0, 0), (2, 3)), "F32", byte_length=24)
    assert pickle.loads(pickle.dumps(piece)) == piece
    assert repr(Box((1,), (2,))) == "Box(offsets=(1,), sizes=(2,))"
    with pytest.raises(Exception, match="box has 1 offsets but 2 sizes"):
        Box((0,), (1, 2))


def test_refuses_what_it_cannot_build_the_same_way():
    @dataclasses.dataclass(slots=True)
    class Mutable:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    with pytest.raises(TypeError, match="quick_init: Mutable is not a frozen dataclass with slots"):
        quick_init(Mutable)
    with pytest.raises(TypeError, match="quick_init: NoSlots is not a frozen dataclass with slots"):
        quick_init(NoSlots)
    with pytest.raises(TypeError, match="quick_init: field 'a' of Factory is not a plain argument"):
        quick_init(Factory)
