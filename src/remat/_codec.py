"""Codecs from the types: a result dataclass's JSON object, written and read from its fields.

NOTE [codecs from the types]
Each stage owns its result types and their JSON (docs/DESIGN.md). A type is written once, as a
dataclass, and its JSON form follows from its fields, in field order, each value by its annotation:

- ``int``, ``float``, ``str``, ``bool``: as they are; read back through ``int()``, ``float()``,
  ``str()``, ``bool()`` (so a float field read from ``3`` holds ``3.0``, and writes ``3.0``). A
  float annotated ``Annotated[float, AS_WRITTEN]`` (:data:`FloatAsWritten`) is read as JSON holds
  it (``3`` stays ``3``: a file read and written again keeps its bytes); one annotated
  ``Annotated[float, NONFINITE]`` (:data:`NonFinite`) writes inf and nan as the strings ``"inf"``,
  ``"-inf"``, ``"nan"`` (JSON has neither; ``float()`` reads them back);
- an ``enum.Enum``: its ``.value``;
- ``X | None``: ``null`` or ``X``;
- ``list[X]`` and ``tuple[X, ...]``: a list; ``tuple[X, Y]``: a list of two;
- ``dict[K, V]``: an object, its keys ``str`` or an enum's values;
- ``Annotated[X, Via(encode, decode)]``: through those two functions (:class:`Via`: a
  ``PlannerSpec`` held typed and written as its text, ``remat.plan.spec.PlannerText``);
- a nested dataclass: its own ``to_json()``/``from_json()`` when it has them, else this codec;
- ``Any`` (and any other union): free-form JSON, written with nested dataclasses and enums
  encoded, read as it is;
- a dataclass annotated ``Annotated[X, ROW]``: a list of its fields' values in field order, not an
  object (a timeline holds thousands of them), read back by position; its spec a ``Tuple`` of its
  fields' specs.

A missing key reads as the field's default; a key no field names is ignored (a reader of
untrusted JSON checks it against its schema first, which refuses both: NOTE [hostile JSON] in
remat/_json.py). The odd field says how it differs with :func:`json_field` (a :class:`JsonField`
in its metadata): another key, a value for which the key is left out, a value read when the key is
missing, properties written after it (computed figures, never read back), its own encoding, a
condition on the whole object under which the key is left out (``omit_if``), its value's keys written
into this object (``inline``: a ``SampleRecord``'s ``StepSample``), or no JSON at all.

The schema that checks a file before it is read comes from the same fields (:func:`schema`): a key
is required unless its field has a default (``json_field(required=True)``: every file has it all
the same), and its spec is the bound in the field's annotation, ``Annotated[int, BYTES]`` (a
:class:`remat._json.Spec`; ``Bytes``, ``Ms``, ``Short`` ... name the shared ones), or follows from
the type: ``Opt`` for ``X | None``, ``List`` for a list (at most ``Len(n)`` items, from the
annotation), ``Tuple``, ``Bool``, an enum's values, a nested dataclass's own schema. A number or a
string never goes unbounded: without a Spec in its annotation, deriving the schema is a TypeError.
A Spec in a nested dataclass's annotation wins over that type's own schema (the receipt holds its
traces to its own spec of one: ``Annotated[StepTrace, STEP_TRACE]`` in remat/receipt/model.py), and
a key written after a field (``then``) may be a constant the file carries (the receipt's ``kind``).
A type whose schema cannot follow from its fields (a ``SampleRecord``'s computed points) keeps a hand
spec beside its fields, and the annotation that holds it names it (``Annotated[SampleRecord, SAMPLE]``).
A file's reader that checks more than the schema (a version, an old format refused by name, the parts
against each other) declares that as a :class:`Reading` the codec follows (NOTE [checked reading]), not
a ``from_json`` of its own.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import sys
import types
import typing
from typing import Annotated, Any, Callable, TypeVar

from ._json import (BYTES, MAX_LIST, MS, SHORT, SIGNED_BYTES, SIGNED_MS, TEXT, Bool, Enum, List, Obj, Opt, Spec,
                    Tuple, show, validate)
from .errors import RematError

T = TypeVar("T")

_UNSET: Any = object()   # a JsonField option not given (None is a value a field may hold)


class _Marker:
    """An annotation marker: how a float field differs from the rule (NOTE [codecs from the types])."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Len:
    """The annotation marker of a list's bounds in the schema: ``Annotated[list[X], Len(10_000)]``."""

    max_len: int
    min_len: int = 0


NONFINITE = _Marker("NONFINITE")
AS_WRITTEN = _Marker("AS_WRITTEN")
ROW = _Marker("ROW")                            # a dataclass written as a list of its fields' values
NonFinite = Annotated[float, NONFINITE]         # verify's encoding of non-finite differences
FloatAsWritten = Annotated[float, AS_WRITTEN]   # read without float(): an int in the file stays an int

# The shared bounds (remat/_json.py) as annotations: ``peak_bytes: Bytes``.
Bytes = Annotated[int, BYTES]
SignedBytes = Annotated[int, SIGNED_BYTES]
Ms = Annotated[float, MS]
SignedMs = Annotated[float, SIGNED_MS]
Short = Annotated[str, SHORT]
Text = Annotated[str, TEXT]


@dataclasses.dataclass(frozen=True)
class JsonField:
    """How one field's JSON differs from the rule its annotation gives (NOTE [codecs from the types])."""

    key: str | None = None               # the JSON key, when it is not the field's name
    omit: Any = _UNSET                   # the key is left out when the field holds this value (==)
    absent: Any = _UNSET                 # what a missing key reads as, for a field with no default
    # properties written after this field (computed, never read back): a property's name, its JSON key
    # too, or (JSON key, property name)
    then: tuple[str | tuple[str, str], ...] = ()
    encode: Callable[[Any], Any] | None = None   # the field's value -> JSON, instead of its annotation's rule
    decode: Callable[[Any], Any] | None = None   # JSON -> the field's value
    skip: bool = False                   # in-process only: not in the JSON
    required: bool = False               # the schema requires the key though the field has a default
    # the key is left out when this holds of the whole object (a receipt's single-process sections, left
    # out of a pipeline run's: NOTE [one receipt] in remat/receipt/model.py)
    omit_if: Callable[[Any], bool] | None = None
    # the field's value, a dataclass, writes its keys into this object (no key of its own) and is read from
    # this whole object (a SampleRecord's StepSample: its keys beside the record's own)
    inline: bool = False


def json_field(*, key: str | None = None, omit: Any = _UNSET, absent: Any = _UNSET,
               then: tuple[str | tuple[str, str], ...] = (),
               encode: Callable[[Any], Any] | None = None, decode: Callable[[Any], Any] | None = None,
               skip: bool = False, required: bool = False, omit_if: Callable[[Any], bool] | None = None,
               inline: bool = False, **field: Any) -> Any:
    """``dataclasses.field(**field)`` carrying a :class:`JsonField` (the other arguments)."""
    spec = JsonField(key=key, omit=omit, absent=absent, then=tuple(then), encode=encode, decode=decode, skip=skip,
                     required=required, omit_if=omit_if, inline=inline)
    return dataclasses.field(metadata={JsonField: spec}, **field)   # the class is the entry's key


# -- one converter per kind of annotation ------------------------------------------------------------

class _Conv:
    """Converts one annotated value to JSON (:meth:`write`) and back (:meth:`read`)."""

    def write(self, v: Any) -> Any:
        raise NotImplementedError

    def read(self, v: Any) -> Any:
        raise NotImplementedError


class _Scalar(_Conv):
    """int, float, str, bool, or an enum (by its value): read back through the type itself."""

    def __init__(self, kind: type, nonfinite: bool = False) -> None:
        self.kind, self.nonfinite = kind, nonfinite

    def write(self, v: Any) -> Any:
        if isinstance(v, enum.Enum):
            return v.value
        if self.nonfinite and isinstance(v, float) and not math.isfinite(v):
            return str(v)   # "inf", "-inf", "nan"
        return v

    def read(self, v: Any) -> Any:
        return self.kind(v)


class _Optional(_Conv):
    def __init__(self, inner: _Conv) -> None:
        self.inner = inner

    def write(self, v: Any) -> Any:
        return None if v is None else self.inner.write(v)

    def read(self, v: Any) -> Any:
        return None if v is None else self.inner.read(v)


class _Sequence(_Conv):
    """``list[X]`` or ``tuple[X, ...]``: a JSON list either way."""

    def __init__(self, item: _Conv, kind: type) -> None:
        self.item, self.kind = item, kind

    def write(self, v: Any) -> Any:
        return [self.item.write(x) for x in v]

    def read(self, v: Any) -> Any:
        return self.kind(self.item.read(x) for x in v)


class _Fixed(_Conv):
    """``tuple[X, Y, ...]`` of a fixed length: a JSON list, one converter per position."""

    def __init__(self, items: list[_Conv]) -> None:
        self.items = items

    def write(self, v: Any) -> Any:
        return [c.write(x) for c, x in zip(self.items, v)]

    def read(self, v: Any) -> Any:
        return tuple(c.read(x) for c, x in zip(self.items, v))


class _Mapping(_Conv):
    def __init__(self, key: _Conv, value: _Conv) -> None:
        self.key, self.value = key, value

    def write(self, v: Any) -> Any:
        return {self.key.write(k): self.value.write(x) for k, x in v.items()}

    def read(self, v: Any) -> Any:
        return {self.key.read(k): self.value.read(x) for k, x in v.items()}


class _Dataclass(_Conv):
    """A nested dataclass: through its own ``to_json``/``from_json`` when it has them."""

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def write(self, v: Any) -> Any:
        return v.to_json() if hasattr(v, "to_json") else to_json(v)

    def read(self, v: Any) -> Any:
        return self.kind.from_json(v) if hasattr(self.kind, "from_json") else from_json(self.kind, v)


class _Row(_Conv):
    """``Annotated[X, ROW]``: the dataclass ``X`` as the list of its fields' values, in field order."""

    def __init__(self, kind: type) -> None:
        self.kind = kind

    def write(self, v: Any) -> Any:
        return [s.encode(getattr(v, s.name)) for s in _slots(self.kind)]

    def read(self, v: Any) -> Any:
        return self.kind(**{s.name: s.decode(x) for s, x in zip(_slots(self.kind), v, strict=True)})


class _Free(_Conv):
    """``Any``: free-form JSON; nested dataclasses and enums written as JSON, read back as they are."""

    def write(self, v: Any) -> Any:
        return plain(v)

    def read(self, v: Any) -> Any:
        return v


def plain(v: Any) -> Any:
    """``v`` as JSON values: dataclasses through their codec, enums by value, containers copied."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _Dataclass(type(v)).write(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


_SCALARS = (bool, int, float, str)


def _converter(hint: Any) -> _Conv:
    """The converter for one annotation (NOTE [codecs from the types])."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _converter_annotated(args[0], hint.__metadata__)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return _Optional(_converter(rest[0]))
        return _Free()
    if origin is list:
        return _Sequence(_converter(args[0]), list)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _Sequence(_converter(args[0]), tuple)
        return _Fixed([_converter(a) for a in args])
    if origin is dict:
        return _Mapping(_converter(args[0]), _converter(args[1]))
    if hint in _SCALARS or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return _Scalar(hint)
    if dataclasses.is_dataclass(hint):
        return _Dataclass(hint)
    return _Free()


class Via(_Conv):
    """The annotation marker of a type written as another JSON value, through two functions (itself its
    converter): ``Annotated[PlannerSpec, SHORT, Via(str, PlannerSpec.parse)]`` holds the type and writes its
    text (one alias for every field of that type: ``remat.plan.spec.PlannerText``)."""

    def __init__(self, encode: Callable[[Any], Any], decode: Callable[[Any], Any]) -> None:
        self.write, self.read = encode, decode   # type: ignore[method-assign]


def _converter_annotated(hint: Any, metadata: tuple[Any, ...]) -> _Conv:
    via = [m for m in metadata if isinstance(m, Via)]
    if via:
        return via[0]
    if NONFINITE in metadata:
        return _Scalar(float, nonfinite=True)
    if AS_WRITTEN in metadata:
        return _Free()
    if ROW in metadata:
        return _Row(hint)
    return _converter(hint)


# -- a dataclass's slots: one per field in the JSON ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Slot:
    name: str            # the field's name
    key: str             # its JSON key
    conv: _Conv
    opts: JsonField
    field: dataclasses.Field

    def encode(self, v: Any) -> Any:
        return self.opts.encode(v) if self.opts.encode is not None else self.conv.write(v)

    def decode(self, v: Any) -> Any:
        return self.opts.decode(v) if self.opts.decode is not None else self.conv.read(v)

    def then(self) -> list[tuple[str, str]]:
        """(JSON key, property name) of each computed key written after this field."""
        return [(t, t) if isinstance(t, str) else t for t in self.opts.then]

    def missing(self) -> Any:
        """What the field holds when its key is missing: its default, else ``absent``, else KeyError."""
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        if self.opts.absent is not _UNSET:
            return self.opts.absent
        raise KeyError(self.key)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]), include_extras=True)


@functools.cache
def _slots(cls: type) -> tuple[_Slot, ...]:
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        opts = f.metadata.get(JsonField, JsonField())
        if not opts.skip:
            out.append(_Slot(name=f.name, key=opts.key or f.name, conv=_converter(hints[f.name]), opts=opts, field=f))
    return tuple(out)


def to_json(obj: Any) -> dict[str, Any]:
    """``obj`` (a dataclass instance) as a JSON object, in field order (NOTE [codecs from the types])."""
    d: dict[str, Any] = {}
    for s in _slots(type(obj)):
        v = getattr(obj, s.name)
        if s.opts.omit_if is not None and s.opts.omit_if(obj):
            continue
        if s.opts.inline:
            d.update(s.encode(v))
        elif s.opts.omit is _UNSET or v != s.opts.omit:
            d[s.key] = s.encode(v)
        for key, name in s.then():
            d[key] = plain(getattr(obj, name))
    return d


def from_json(cls: type[T], d: dict[str, Any]) -> T:
    """``cls`` built from the JSON object ``to_json`` writes (NOTE [codecs from the types]);
    KeyError for a missing key that has no default."""
    kw = {s.name: s.decode(d) if s.opts.inline else s.decode(d[s.key]) if s.key in d else s.missing()
          for s in _slots(cls)}
    return cls(**kw)


@functools.cache
def schema(cls: type) -> Obj:
    """The :class:`remat._json.Obj` that checks ``cls``'s JSON before :func:`from_json` reads it (NOTE
    [codecs from the types]), keys in field order: required unless the field has a default (or says
    ``json_field(required=True)``: its files always hold it), and each key's spec from its annotation
    (:func:`spec_of`); a computed key (``then``) is required, its spec from its property's return annotation. One object per class: every reader of the type checks against the same one."""
    hints = _hints(cls)
    required: dict[str, Spec] = {}
    optional: dict[str, Spec] = {}
    for s in _slots(cls):
        has_default = s.field.default is not dataclasses.MISSING or s.field.default_factory is not dataclasses.MISSING
        spec = spec_of(hints[s.name], f"{cls.__name__}.{s.name}")
        if s.opts.inline and isinstance(spec, Obj):   # its keys are this object's
            required.update(spec.required)
            optional.update(spec.optional)
        else:
            (optional if has_default and not s.opts.required else required)[s.key] = spec
        for key, name in s.then():
            required[key] = spec_of(_property_hint(cls, name), f"{cls.__name__}.{name}")   # always written
    return Obj(required, optional)


def _property_hint(cls: type, name: str) -> Any:
    """The return annotation of property ``name`` of ``cls``: the spec of a computed key."""
    getter = getattr(cls, name).fget
    return typing.get_type_hints(getter, globalns=vars(sys.modules[cls.__module__]), include_extras=True)["return"]


def spec_of(hint: Any, where: str, length: Len = Len(MAX_LIST)) -> Spec:
    """The spec of one annotation: the :class:`Spec` in its ``Annotated`` metadata (the bound), else
    derived from the type: ``X | None`` as ``Opt``, ``tuple[X, Y]`` as ``Tuple``, a bool as ``Bool``, an enum
    by its values, a dataclass by :func:`schema`, a list by its item's spec and a :class:`Len` (else
    at most MAX_LIST items). A number, string or mapping has no bound but the one given: TypeError
    without it (``where`` names the field)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        given = [m for m in hint.__metadata__ if isinstance(m, Spec)]
        lengths = [m for m in hint.__metadata__ if isinstance(m, Len)]
        if not given and ROW in hint.__metadata__:
            fields = _hints(args[0])
            return Tuple(*(spec_of(fields[s.name], f"{where}.{s.name}") for s in _slots(args[0])))
        return given[0] if given else spec_of(args[0], where, *lengths)
    spec = _generic_spec(origin, args, where, length)
    if spec is None:
        spec = _plain_spec(hint)
    if spec is None:
        raise TypeError(f"{where}: {hint!r} needs its bound in the annotation (Annotated[..., <a Spec>])")
    return spec


def _generic_spec(origin: Any, args: tuple[Any, ...], where: str, length: Len) -> Spec | None:
    """``X | None``, ``list[X]``, ``tuple[X, ...]`` and ``tuple[X, Y]``; None for any other origin."""
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return Opt(spec_of(rest[0], where)) if len(rest) == 1 and len(rest) < len(args) else None
    if origin is list or (origin is tuple and Ellipsis in args):
        return List(spec_of(args[0], where), max_len=length.max_len, min_len=length.min_len)
    if origin is tuple:
        return Tuple(*(spec_of(a, where) for a in args))
    return None


def _plain_spec(hint: Any) -> Spec | None:
    """A bool, an enum by its values, a dataclass by :func:`schema`; None for anything else."""
    if hint is bool:
        return Bool()
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return Enum(*(m.value for m in hint))
    if dataclasses.is_dataclass(hint):
        return schema(hint)
    return None


# NOTE [checked reading]
# A file's top-level type (a plan, a pipeline plan, a frontier, a receipt) is read from untrusted JSON, so
# ``from_json`` checks before it builds, in this order: the top level is an object; ``refuse``: a format the
# file names that this remat no longer reads (a typed error saying how to make it again); ``schema_version``
# is an integer this remat reads (said so, not the schema's "expected one of"); the schema (NOTE [hostile
# JSON] in remat/_json.py); ``shape``: what the schema cannot say (which keys come together); the build, an
# error among ``wrap`` becoming the type's "malformed ..."; ``check``: the built parts against each other.
# The type declares it once, in its class line (``class Plan(JsonCodec, reading=Reading(...))``);
# ``from_json(d, source=...)`` names the JSON (a file's path) in messages in place of ``what``.

@dataclasses.dataclass(frozen=True)
class Reading:
    """How a top-level type's JSON is checked before and after it is built (NOTE [checked reading])."""

    error: type[RematError]                 # what every refusal raises
    what: str                               # the JSON's name in messages: "plan", "receipt"
    version: int | None = None              # the ``schema_version`` read (None: the schema says)
    version_tip: str | None = None
    schema: bool = True                     # False: checked by another's schema where it is read
    refuse: Callable[[dict[str, Any]], None] | None = None
    shape: Callable[[dict[str, Any]], None] | None = None
    wrap: tuple[type[Exception], ...] = ()
    check: Callable[[Any], None] | None = None


_READINGS: dict[type, Reading] = {}


def read(cls: type[T], d: Any, reading: Reading, source: str | None = None) -> T:
    """``cls`` from untrusted JSON, checked as ``reading`` says (NOTE [checked reading])."""
    what, error = source or reading.what, reading.error
    if not isinstance(d, dict):
        raise error(f"malformed {what}: the top level must be a JSON object, got {show(d)}")
    if reading.refuse is not None:
        reading.refuse(d)
    if reading.version is not None:
        _check_version(d.get("schema_version"), reading, what)
    if reading.schema:
        validate(d, schema(cls), error=error, what=what)
    if reading.shape is not None:
        reading.shape(d)
    try:
        obj = from_json(cls, d)
    except error:
        raise
    except reading.wrap as exc:
        msg = exc.message if isinstance(exc, RematError) else f"{type(exc).__name__}: {exc}"
        raise error(f"malformed {what}: {msg}") from exc
    if reading.check is not None:
        reading.check(obj)
    return obj


def _check_version(v: Any, reading: Reading, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise reading.error(f"malformed {what}: $.schema_version: expected an integer, got {show(v)}")
    if v != reading.version:
        raise reading.error(f"{what} schema_version {v} is not supported (this remat reads {reading.version})",
                            tip=reading.version_tip)


class JsonCodec:
    """``to_json``/``from_json`` from the dataclass's fields, for callers that ask the type (NOTE
    [codecs from the types]); a top-level type names its :class:`Reading` in its class line (NOTE
    [checked reading]). A type whose JSON is the distributed stack's hand codec overrides them."""

    def __init_subclass__(cls, *, reading: Reading | None = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if reading is not None:
            _READINGS[cls] = reading

    def to_json(self) -> dict[str, Any]:
        return to_json(self)

    @classmethod
    def from_json(cls: type[T], d: Any, *, source: str | None = None) -> T:
        """Built from ``d``; checked first when the type has a :class:`Reading` (``source`` names the JSON in its
        messages)."""
        reading = _READINGS.get(cls)
        return from_json(cls, d) if reading is None else read(cls, d, reading, source)

