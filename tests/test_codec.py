"""The codec from the types (NOTE [codecs from the types] in remat/_codec.py): each rule and each
per-field override, and the schema derived from the same fields refusing what it should."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Annotated, Any

import pytest

from remat._codec import (ROW, Bytes, FloatAsWritten, JsonCodec, Len, NonFinite, Reading, Short,
                          from_json, json_field, schema, to_json)
from remat._json import Enum, Int, Map, Num, validate
from remat.plan.spec import PlannerText
from remat.errors import PlanError


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner(JsonCodec):
    name: Short
    size: Bytes


@dataclasses.dataclass(kw_only=True)
class Outer(JsonCodec):
    color: Color
    inner: Inner
    items: Annotated[list[Inner], Len(3)]
    pair: tuple[Annotated[int, Int(0, 9)], Short]
    by_color: Annotated[dict[Color, float], Map(Num(0, 1), key="red|blue")] = json_field(default_factory=dict)
    parent: Short | None = json_field(absent=None)
    ratio: Annotated[float, Num(0, 10)] = 1.0
    as_written: Annotated[FloatAsWritten, Num(0, 10)] = 0
    diff: Annotated[NonFinite, Num(nonfinite=True)] = 0.0
    nbytes: Bytes = json_field(default=0, key="bytes")
    calls: Annotated[int, Int(1, 100)] = json_field(default=1, omit=1)
    note: Short = json_field(default="", then=("twice",))
    cache: Any = json_field(default=None, skip=True)

    @property
    def twice(self) -> Bytes:
        return 2 * self.nbytes


def outer(**kw: Any) -> Outer:
    return Outer(color=Color.RED, inner=Inner(name="a", size=1), items=[Inner(name="b", size=2)], pair=(3, "x"),
                 parent=None, **kw)


def test_writes_in_field_order_with_each_override():
    d = outer(by_color={Color.BLUE: 0.5}, diff=float("-inf"), nbytes=7, calls=2).to_json()
    assert list(d) == ["color", "inner", "items", "pair", "by_color", "parent", "ratio", "as_written", "diff",
                       "bytes", "calls", "note", "twice"]
    assert d["color"] == "red" and d["pair"] == [3, "x"] and d["by_color"] == {"blue": 0.5}
    assert d["diff"] == "-inf" and d["twice"] == 14
    assert "calls" not in outer().to_json()   # omitted at 1


def test_reads_back_what_it_wrote():
    o = outer(by_color={Color.BLUE: 0.5}, diff=float("inf"), nbytes=7, calls=2, note="n")
    back = Outer.from_json(json.loads(json.dumps(o.to_json())))
    assert back == o and back.pair == (3, "x") and isinstance(back.inner, Inner)


def test_numbers_read_as_their_annotation_says():
    d = outer().to_json() | {"ratio": 3, "as_written": 3}
    back = from_json(Outer, d)
    assert type(back.ratio) is float and type(back.as_written) is int
    assert json.dumps(to_json(back)).count('"as_written": 3,') == 1


def test_missing_keys_read_as_defaults_or_absent_else_keyerror():
    d = {k: v for k, v in outer().to_json().items() if k not in ("parent", "ratio", "note", "twice")}
    back = Outer.from_json(d)
    assert back.parent is None and back.ratio == 1.0 and back.note == ""
    with pytest.raises(KeyError, match="inner"):
        Outer.from_json({"color": "red"})


def test_schema_follows_the_fields_and_refuses():
    spec = schema(Outer)
    assert list(spec.required) == ["color", "inner", "items", "pair", "parent", "twice"]
    good = outer().to_json()
    validate(good, spec, error=PlanError, what="x")
    bad = [good | {"color": "green"}, good | {"pair": [10, "x"]}, good | {"items": [good["inner"]] * 4},
           good | {"inner": {"name": "a", "size": -1}}, good | {"zzz": 1}, {k: v for k, v in good.items() if k != "pair"},
           good | {"twice": "x"}, good | {"calls": True}, good | {"by_color": {"red": 2}}, good | {"ratio": "1"}]
    for b in bad:
        with pytest.raises(PlanError, match="malformed x"):
            validate(b, spec, error=PlanError, what="x")


def test_an_unbounded_number_has_no_schema():
    @dataclasses.dataclass
    class Loose:
        n: int

    with pytest.raises(TypeError, match="Loose.n"):
        schema(Loose)


# -- Via, inline, and the checked reading (NOTE [checked reading]) -----------------------------------------

@dataclasses.dataclass(kw_only=True)
class Planned(JsonCodec):
    planner: PlannerText


def test_a_planner_spec_is_held_typed_and_written_as_its_text():
    """Via: the field holds a PlannerSpec and its JSON is the spec's text; the text a user would write is the
    ground truth, and text no planner spells is refused as it would be on the command line."""
    from remat.plan.spec import PlannerKind, PlannerSpec
    spec = PlannerSpec.parse("optimal->all")
    d = Planned(planner=spec).to_json()
    assert d == {"planner": "optimal->all"}
    back = Planned.from_json(d).planner
    assert isinstance(back, PlannerSpec) and back.kind is PlannerKind.ALL and back.fallback_of.kind is PlannerKind.OPTIMAL
    assert schema(Planned).required["planner"].check("x" * 2000, "$") is None   # SHORT: 2,000 characters fit
    with pytest.raises(PlanError, match="unknown planner 'sac-matmuls'"):
        Planned.from_json({"planner": "sac-matmuls"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample(JsonCodec):
    steps: Annotated[int, Int(1, 9)] = 1
    note: Short = ""


@dataclasses.dataclass(kw_only=True)
class Record(JsonCodec):
    sample: Sample = json_field(inline=True, then=("doubled",))
    peaks: Annotated[list[Bytes], Len(4)] = json_field(default_factory=list)

    @property
    def doubled(self) -> Annotated[int, Int(2, 18)]:
        return 2 * self.sample.steps


def test_an_inline_field_writes_its_keys_into_the_object_and_reads_from_it():
    r = Record(sample=Sample(steps=3, note="n"), peaks=[5])
    assert json.dumps(r.to_json()) == '{"steps": 3, "note": "n", "doubled": 6, "peaks": [5]}'   # written by hand
    assert Record.from_json(r.to_json()) == r
    s = schema(Record)
    assert sorted(s.required) == ["doubled"] and sorted(s.optional) == ["note", "peaks", "steps"]
    with pytest.raises(PlanError, match=r"\$.steps"):
        validate({**r.to_json(), "steps": 10}, s, error=PlanError, what="record")   # the inline type's bound
    validate(r.to_json(), s, error=PlanError, what="record")   # the safe twin


def _refuse_old(d: dict[str, Any]) -> None:
    if d.get("kind") == "old":
        raise PlanError("an old document: make it again")


def _two_or_none(d: dict[str, Any]) -> None:
    if ("a" in d) != ("b" in d):
        raise PlanError("malformed doc: a and b come together")


def _ordered(doc: "Doc") -> None:
    if doc.a is not None and doc.b is not None and doc.a > doc.b:
        raise PlanError("malformed doc: a is after b")


@dataclasses.dataclass(kw_only=True)
class Doc(JsonCodec, reading=Reading(error=PlanError, what="doc", version=2, version_tip="make it again",
                                     refuse=_refuse_old, shape=_two_or_none, check=_ordered)):
    schema_version: Annotated[int, Int(0, 9)] = json_field(default=2, required=True)
    kind: Annotated[str, Enum("doc", "old")] = "doc"
    a: Annotated[int, Int(0, 9)] | None = None
    b: Annotated[int, Int(0, 9)] | None = None


@pytest.mark.parametrize("bad, message", [
    ([1], "malformed doc: the top level must be a JSON object, got list [1]"),
    ({"schema_version": 2, "kind": "old"}, "an old document: make it again"),
    ({"kind": "old"}, "an old document: make it again"),                      # refused before the version
    ({"schema_version": True}, "malformed doc: $.schema_version: expected an integer, got bool True"),
    ({}, "malformed doc: $.schema_version: expected an integer, got NoneType None"),
    ({"schema_version": 3}, "doc schema_version 3 is not supported (this remat reads 2)\nTip: make it again"),
    ({"schema_version": 2, "a": 10, "b": 1}, "malformed doc: $.a: expected an integer in [0, 9]"),   # the schema
    ({"schema_version": 2, "a": 1}, "malformed doc: a and b come together"),
    ({"schema_version": 2, "a": 2, "b": 1}, "malformed doc: a is after b"),
])
def test_a_checked_reading_refuses_in_order(bad, message):
    with pytest.raises(PlanError) as exc:
        Doc.from_json(bad)
    assert str(exc.value).startswith(message)


def test_a_checked_reading_names_its_source_and_reads_the_safe_twin():
    with pytest.raises(PlanError, match="^doc /tmp/d.json schema_version 3 is not supported"):
        Doc.from_json({"schema_version": 3}, source="doc /tmp/d.json")
    assert Doc.from_json({"schema_version": 2, "a": 1, "b": 2}) == Doc(a=1, b=2)
    assert Doc.from_json({"schema_version": 2}) == Doc()


def test_a_checked_reading_wraps_only_the_errors_it_names():
    """``wrap``: a build error it names becomes the type's "malformed ..."; any other propagates as it is."""
    @dataclasses.dataclass(kw_only=True)
    class Wrapped(JsonCodec, reading=Reading(error=PlanError, what="w", schema=False, wrap=(ValueError,))):
        n: int = json_field(default=0, decode=lambda v: int(v))

    with pytest.raises(PlanError, match="^malformed w: ValueError: invalid literal"):
        Wrapped.from_json({"n": "x"})

    @dataclasses.dataclass(kw_only=True)
    class Unwrapped(JsonCodec, reading=Reading(error=PlanError, what="u", schema=False)):
        n: int = json_field(default=0, decode=lambda v: int(v))

    with pytest.raises(ValueError):
        Unwrapped.from_json({"n": "x"})
    assert Wrapped.from_json({"n": "3"}).n == 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Span:
    kind: Short
    mb: Annotated[int, Int(-1, 10)]
    start_ms: Annotated[float, Num(0, 1e3)]


@dataclasses.dataclass(kw_only=True)
class Spans(JsonCodec, reading=Reading(error=PlanError, what="spans file")):
    spans: list[Annotated[Span, ROW]]


def test_a_row_is_a_list_of_its_fields_and_a_reading_refuses_with_its_own_error():
    """ROW: a dataclass as the list of its fields' values; its spec a Tuple of theirs. A Reading checks the schema
    before reading and raises the type's own error; the safe twin reads back what it wrote."""
    s = Spans(spans=[Span(kind="forward", mb=1, start_ms=2.0), Span(kind="p2p:send", mb=-1, start_ms=0.5)])
    d = json.loads(json.dumps(s.to_json()))
    assert d == {"spans": [["forward", 1, 2.0], ["p2p:send", -1, 0.5]]}
    assert Spans.from_json(d) == s
    for bad, words in (({"spans": [["forward", 1]]}, "list of 3"), ({"spans": [["forward", 11, 2.0]]}, "in \\[-1, 10\\]"),
                       ([], "must be a JSON object"), ({"spans": [], "zz": 1}, "unknown field")):
        with pytest.raises(PlanError, match=words):
            Spans.from_json(bad)
