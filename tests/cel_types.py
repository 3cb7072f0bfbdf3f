"""CEL as the Kubernetes API server compiles it: declarations derived from structural schemas,
a real CEL type checker, and the API server's static cost estimate. Used by
tests/test_k8s_cel_types.py; the rules' behaviour is tests/test_k8s_cel.py's.

Declarations. `decl_type` restates k8s.io/apiserver/pkg/cel/common/schemas.go `SchemaDeclType`:
an object's properties are fields of their own types (names escaped as `Escape` does, a name it
cannot escape left out); `additionalProperties` makes a map from string and `items` a list, left
out when their values are; `x-kubernetes-int-or-string` is dyn; a schema with no type
(`x-kubernetes-preserve-unknown-fields` alone) is left out, so a rule cannot read it; a string's
`format` byte, duration, date and date-time make bytes, duration and timestamp; the root of a
resource has `apiVersion`, `kind` and a `metadata` of `name` and `generateName` only
(`WithTypeAndObjectMeta`). Sizes are its `MaxElements`: `maxItems`, `maxProperties`,
4 × `maxLength` (bytes per rune), the longest enum value, else what fits in a 3 MiB request.

The checker. `cel-expr-python` (Google's CEL C++ with its type checker) compiles each rule in an
environment whose variables have these types: objects become protobuf messages made here
(descriptor_pb2), dyn is `google.protobuf.Value`, which CEL types as dyn. Two approximations,
both looser than the API server: a list of lists, or a map of lists or maps, is a list or map of
dyn (proto has no repeated repeated); map keys are unbounded strings in the cost estimate (the
API server's key type has no size). The API server's Kubernetes libraries (quantity(), url(),
isSorted(), ...) are not declared here: a rule using one fails to compile until it is. The
environment has what the API server's base environment adds that CEL C++ has (the strings
extension, optional types); homogeneous aggregate literals and regex literals are checked on the
checked AST, as `cel.HomogeneousAggregateLiterals` and `ValidateRegexLiterals` do there.

The cost. cel-expr-python estimates no cost, so `estimate_cost` restates cel-go's
checker/cost.go estimator (the maximum only) with the API server's size estimator over the
declarations above (apiextensions' `sizeEstimator`), presence tests free
(`PresenceTestHasCost(false)`); functions cel-go prices O(1) that the API server's libraries
price by size are priced here by the size of all their arguments, which is never less.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cel.expr import checked_pb2, syntax_pb2  # cel-spec's protos (xds-protos ships them)
from cel_expr_python import cel
from cel_expr_python.ext.ext_optional import ExtOptional
from cel_expr_python.ext.ext_strings import ExtStrings
from google.protobuf import (
    any_pb2,
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    struct_pb2,
    timestamp_pb2,
)

MAX_REQUEST_BYTES = 3 * 1024 * 1024  # apiservercel.DefaultMaxRequestSizeBytes
STATIC_ESTIMATED_COST_LIMIT = 10_000_000  # apiextensions: per rule, or the CRD is refused
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000  # apiextensions: all rules of a CRD together
PER_CALL_LIMIT = 1_000_000  # k8s.io/apiserver/pkg/apis/cel: a rule is stopped past this at run time
_MAX_U64 = 2**64 - 1

# apiservercel.Escape
_RESERVED = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for",
    "function", "if", "import", "let", "loop", "package", "namespace", "return", "var", "void",
    "while",
}  # fmt: skip
_ESCAPES = {"__": "__underscores__", ".": "__dot__", "-": "__dash__", "/": "__slash__"}


def escape(name: str) -> str | None:
    if not name or name[0].isdigit():
        return None
    if name in _RESERVED:
        return f"__{name}__"
    parts = re.split(r"(__|[^a-zA-Z0-9_])", name)
    if any(p not in _ESCAPES for p in parts[1::2]):
        return None
    return "".join(_ESCAPES.get(p, p) if i % 2 else p for i, p in enumerate(parts))


@dataclass
class Decl:
    """apiservercel.DeclType, as much of it as the checker and the cost estimate read."""

    kind: str  # object list map string bytes int double bool timestamp duration dyn
    max_elements: int = 0
    min_size: int = 0
    fields: dict[str, Decl] = field(default_factory=dict)
    elem: Decl | None = None  # a list's items, a map's values


_FORMAT_MAX = {"duration": 32, "date": 10, "date-time": 64}  # estimateMaxStringLengthPerRequest


def decl_type(s: Mapping[str, Any] | None, root: bool = False) -> Decl | None:
    """k8s.io/apiserver/pkg/cel/common/schemas.go SchemaDeclType, restated."""
    if s is None:
        return None
    if s.get("x-kubernetes-int-or-string") or s.get("format") == "int-or-string":
        most = 4 * s["maxLength"] if "maxLength" in s else MAX_REQUEST_BYTES - 2
        return Decl("dyn", most, 1)
    if root:
        s = with_type_and_object_meta(s)
    kind = s.get("type")
    if kind == "array":
        items = s.get("items")
        item = decl_type(items, bool(items and items.get("x-kubernetes-embedded-resource")))
        if item is None:
            return None
        most = s.get("maxItems", (MAX_REQUEST_BYTES - 2) // (item.min_size + 1))
        return Decl("list", max(most, 0), 2, elem=item)
    if kind == "object":
        extra = s.get("additionalProperties")
        if isinstance(extra, Mapping):
            value = decl_type(extra, bool(extra.get("x-kubernetes-embedded-resource")))
            if value is None:
                return None
            most = s.get("maxProperties", (MAX_REQUEST_BYTES - 2) // (value.min_size + 6))
            return Decl("map", max(most, 0), 2, elem=value)
        fields, min_size, required = {}, 2, set(s.get("required", []))
        for name, prop in (s.get("properties") or {}).items():
            typed = decl_type(prop, bool(prop.get("x-kubernetes-embedded-resource")))
            if typed is None:
                continue
            escaped = escape(name)
            if escaped is not None:
                fields[escaped] = typed
            if name in required and "default" not in prop:
                min_size += len(name) + typed.min_size + 4
        return Decl("object", 0, min_size, fields)
    if kind == "string":
        fmt = s.get("format")
        if fmt == "byte":
            return Decl("bytes", s.get("maxLength", MAX_REQUEST_BYTES - 2), 2)
        if fmt in ("duration", "date", "date-time"):
            return Decl("duration" if fmt == "duration" else "timestamp", _FORMAT_MAX[fmt], 4)
        if "maxLength" in s:
            most = 4 * s["maxLength"]
        elif s.get("enum"):
            most = max((len(v) for v in s["enum"] if isinstance(v, str)), default=0)
        else:
            most = MAX_REQUEST_BYTES - 2
        return Decl("string", most, 2)
    simple = {"boolean": ("bool", 4), "number": ("double", 1), "integer": ("int", 1)}
    if kind in simple:
        return Decl(simple[kind][0], 0, simple[kind][1])
    return None  # no type: x-kubernetes-preserve-unknown-fields alone


def with_type_and_object_meta(s: Mapping[str, Any]) -> Mapping[str, Any]:
    props = s.get("properties") or {}
    meta = props.get("metadata") or {}
    if (
        props.get("kind", {}).get("type") == "string"
        and props.get("apiVersion", {}).get("type") == "string"
        and meta.get("type") == "object"
        and (meta.get("properties") or {}).get("name", {}).get("type") == "string"
        and (meta.get("properties") or {}).get("generateName", {}).get("type") == "string"
    ):
        return s
    string = {"type": "string"}
    metadata = {"type": "object", "properties": {"name": string, "generateName": string}}
    return {**s, "properties": {**props, "kind": string, "apiVersion": string,
                                "metadata": metadata}}  # fmt: skip


def obj(**fields: Decl) -> Decl:
    return Decl("object", fields=dict(fields))


def _simple(kind: str) -> Decl:
    return Decl(kind, MAX_REQUEST_BYTES - 2 if kind == "string" else 0)


STRING, INT, BOOL, DYN = _simple("string"), _simple("int"), _simple("bool"), _simple("dyn")
TIMESTAMP = Decl("timestamp", 64)


def list_of(item: Decl) -> Decl:
    return Decl("list", (MAX_REQUEST_BYTES - 2) // (item.min_size + 1), elem=item)


def map_of(value: Decl) -> Decl:
    return Decl("map", (MAX_REQUEST_BYTES - 2) // (value.min_size + 6), elem=value)


# --- declarations → protobuf messages → a CEL environment ---------------------------------

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int": _F.TYPE_INT64,
    "double": _F.TYPE_DOUBLE, "bool": _F.TYPE_BOOL,
}  # fmt: skip
_WELL_KNOWN = {
    "dyn": ".google.protobuf.Value",
    "timestamp": ".google.protobuf.Timestamp",
    "duration": ".google.protobuf.Duration",
}
_PACKAGE = "k8scel"


class _Messages:
    """One proto file with a message per object declaration."""

    def __init__(self) -> None:
        self.file = descriptor_pb2.FileDescriptorProto(
            name="k8scel.proto",
            package=_PACKAGE,
            syntax="proto3",
            dependency=[m.DESCRIPTOR.name for m in (struct_pb2, timestamp_pb2, duration_pb2)],
        )
        self.made: dict[int, str] = {}  # id(declaration) → its message: one type per object

    def message(self, decl: Decl) -> str:
        if id(decl) not in self.made:
            msg = self.file.message_type.add(name=f"T{len(self.made) + 1}")
            self.made[id(decl)] = f"{_PACKAGE}.{msg.name}"
            for number, (name, typed) in enumerate(sorted(decl.fields.items()), start=1):
                self._field(msg, name, number, typed)
        return self.made[id(decl)]

    def _field(self, msg: Any, name: str, number: int, typed: Decl) -> None:
        f = msg.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
        if typed.kind == "list":
            f.label = _F.LABEL_REPEATED
            assert typed.elem is not None
            item = typed.elem if typed.elem.kind not in ("list", "map") else DYN
            self._set_type(f, item)
        elif typed.kind == "map":
            assert typed.elem is not None
            entry = msg.nested_type.add(name=f"{name[0].upper()}{name[1:]}Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, type=_F.TYPE_STRING)
            value = entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL)
            self._set_type(value, typed.elem if typed.elem.kind not in ("list", "map") else DYN)
            f.label = _F.LABEL_REPEATED
            f.type, f.type_name = _F.TYPE_MESSAGE, f".{_PACKAGE}.{msg.name}.{entry.name}"
        else:
            self._set_type(f, typed)

    def _set_type(self, f: Any, typed: Decl) -> None:
        if typed.kind in _SCALARS:
            f.type = _SCALARS[typed.kind]
        elif typed.kind == "object":
            f.type, f.type_name = _F.TYPE_MESSAGE, "." + self.message(typed)
        else:
            f.type, f.type_name = _F.TYPE_MESSAGE, _WELL_KNOWN[typed.kind]

    def cel_type(self, typed: Decl) -> cel.Type:
        simple = {
            "string": cel.Type.STRING, "bytes": cel.Type.BYTES, "int": cel.Type.INT,
            "double": cel.Type.DOUBLE, "bool": cel.Type.BOOL, "dyn": cel.Type.DYN,
            "timestamp": cel.Type.TIMESTAMP, "duration": cel.Type.DURATION,
        }  # fmt: skip
        if typed.kind in simple:
            return simple[typed.kind]
        if typed.kind == "list":
            assert typed.elem is not None
            return cel.Type.List(self.cel_type(typed.elem))
        if typed.kind == "map":
            assert typed.elem is not None
            return cel.Type.Map(cel.Type.STRING, self.cel_type(typed.elem))
        return cel.Type(self.message(typed))

    def pool(self) -> descriptor_pool.DescriptorPool:
        pool = descriptor_pool.DescriptorPool()
        for module in (struct_pb2, timestamp_pb2, duration_pb2):
            proto = descriptor_pb2.FileDescriptorProto()
            module.DESCRIPTOR.CopyToProto(proto)
            pool.Add(proto)
        pool.Add(self.file)
        return pool


class CelError(Exception):
    """The rule would be refused: it does not compile, or breaks a rule of the environment."""


def compile_checked(expression: str, variables: Mapping[str, Decl]) -> checked_pb2.CheckedExpr:
    """Type-check `expression` with `variables` declared; the checked AST, or CelError."""
    messages = _Messages()
    declared = {name: messages.cel_type(typed) for name, typed in variables.items()}
    env = cel.NewEnv(messages.pool(), variables=declared, extensions=[ExtStrings(2), ExtOptional()])
    try:
        compiled = env.compile(expression)
    except RuntimeError as exc:
        raise CelError(str(exc)) from None
    wrapped = any_pb2.Any.FromString(compiled.serialize())
    checked = checked_pb2.CheckedExpr()
    if not wrapped.Unpack(checked):
        raise AssertionError(f"not a checked expression: {wrapped.type_url}")
    _literals(checked.expr, checked)
    return checked


def output_type(checked: checked_pb2.CheckedExpr) -> checked_pb2.Type:
    return checked.type_map[checked.expr.id]


BOOL_TYPE = checked_pb2.Type(primitive=checked_pb2.Type.BOOL)


def _children(e: syntax_pb2.Expr) -> list[syntax_pb2.Expr]:
    which = e.WhichOneof("expr_kind")
    if which == "select_expr":
        return [e.select_expr.operand]
    if which == "call_expr":
        target = [e.call_expr.target] if e.call_expr.HasField("target") else []
        return [*target, *e.call_expr.args]
    if which == "list_expr":
        return list(e.list_expr.elements)
    if which == "struct_expr":
        out = []
        for entry in e.struct_expr.entries:
            out += [entry.map_key, entry.value] if entry.HasField("map_key") else [entry.value]
        return out
    if which == "comprehension_expr":
        c = e.comprehension_expr
        return [c.iter_range, c.accu_init, c.loop_condition, c.loop_step, c.result]
    return []


def _literals(e: syntax_pb2.Expr, checked: checked_pb2.CheckedExpr) -> None:
    """HomogeneousAggregateLiterals and ValidateRegexLiterals, which the API server adds."""
    which = e.WhichOneof("expr_kind")
    groups: list[list[syntax_pb2.Expr]] = []
    if which == "list_expr":
        groups = [list(e.list_expr.elements)]
    elif which == "struct_expr" and not e.struct_expr.message_name:
        entries = e.struct_expr.entries
        groups = [[x.map_key for x in entries], [x.value for x in entries]]
    for group in groups:
        kinds = {checked.type_map[x.id].SerializeToString(deterministic=True) for x in group}
        if len(kinds) > 1:
            raise CelError(f"the elements of a literal have different types: {sorted(kinds)}")
    if which == "call_expr" and e.call_expr.function == "matches":
        pattern = e.call_expr.args[-1]
        if pattern.WhichOneof("expr_kind") == "const_expr":
            try:
                re.compile(pattern.const_expr.string_value)
            except re.error as exc:
                raise CelError(f"invalid regex literal: {exc}") from None
    for child in _children(e):
        _literals(child, checked)


def decl_of_type(t: checked_pb2.Type) -> Decl:
    """A checked type as the API server declares a composited variable of it
    (convertCelTypeToDeclType: lists and maps kept, any object type dyn)."""
    which = t.WhichOneof("type_kind")
    if which == "primitive":
        name = checked_pb2.Type.PrimitiveType.Name(t.primitive)
        kinds = {"BOOL": "bool", "INT64": "int", "DOUBLE": "double", "STRING": "string"}
        return _simple(kinds.get(name, "bytes" if name == "BYTES" else "dyn"))
    if which == "list_type":
        return list_of(decl_of_type(t.list_type.elem_type))
    if which == "map_type":
        key = t.map_type.key_type
        if key.WhichOneof("type_kind") == "primitive" and key.primitive == checked_pb2.Type.STRING:
            return map_of(decl_of_type(t.map_type.value_type))
        return DYN
    if which == "well_known" and t.well_known == checked_pb2.Type.TIMESTAMP:
        return TIMESTAMP
    if which == "well_known" and t.well_known == checked_pb2.Type.DURATION:
        return Decl("duration", 32)
    return DYN


# --- the static cost estimate ---------------------------------------------------------------

_ACCUMULATORS = ("@result", "__result__")
# O(1) in cel-go and in the API server's libraries
_CONSTANT_TIME = {
    "!_", "-_", "_-_", "_*_", "_/_", "_%_", "size", "int", "uint", "double", "bool", "type",
    "duration", "timestamp", "@not_strictly_false", "not_strictly_false",
    "_<_", "_<=_", "_>_", "_>=_", "optional.of", "optional.none", "hasValue", "value",
}  # fmt: skip
_TRAVERSAL = 0.1  # common.StringTraversalCostFactor
_REGEX = 0.25  # common.RegexStringLengthCostFactor


def _cap(x: int) -> int:
    return min(x, _MAX_U64)


def _factor(x: int, f: float) -> int:
    return _MAX_U64 if x >= _MAX_U64 else _cap(math.ceil(x * f))


@dataclass
class _Local:
    path: list[str] | None
    size: int | None


class _Coster:
    """cel-go checker/cost.go `coster`, maxima only."""

    def __init__(self, checked: checked_pb2.CheckedExpr, roots: Mapping[str, Decl]) -> None:
        self.checked, self.roots = checked, roots
        self.paths: dict[int, list[str]] = {}
        self.sizes: dict[int, int] = {}
        self.items: dict[int, int] = {}  # the size of a literal's items
        self.locals: dict[str, list[_Local]] = {}

    def kind(self, e: syntax_pb2.Expr) -> str:
        t = self.checked.type_map.get(e.id)
        return "" if t is None else str(t.WhichOneof("type_kind"))

    def path(self, e: syntax_pb2.Expr) -> list[str] | None:
        if e.WhichOneof("expr_kind") == "ident_expr" and self.locals.get(e.ident_expr.name):
            return self.locals[e.ident_expr.name][-1].path
        return self.paths.get(e.id)

    def size(self, e: syntax_pb2.Expr) -> int:
        if e.id in self.sizes:
            return self.sizes[e.id]
        which = e.WhichOneof("expr_kind")
        if which == "const_expr":
            c = e.const_expr
            if c.WhichOneof("constant_kind") == "string_value":
                return len(c.string_value)
            if c.WhichOneof("constant_kind") == "bytes_value":
                return len(c.bytes_value)
        if which == "list_expr":
            return len(e.list_expr.elements)
        if which == "struct_expr" and not e.struct_expr.message_name:
            return len(e.struct_expr.entries)
        path = self.path(e)
        if path and path[0] in self.roots and path[0] not in _ACCUMULATORS:
            found = self._by_path(path)
            if found is not None:
                return found
        t = self.checked.type_map.get(e.id)
        if t is not None and (
            t.WhichOneof("type_kind") == "well_known"
            or (
                t.WhichOneof("type_kind") == "primitive"
                and t.primitive not in (checked_pb2.Type.STRING, checked_pb2.Type.BYTES)
            )
        ):
            return 1
        if which == "ident_expr" and self.locals.get(e.ident_expr.name):
            local = self.locals[e.ident_expr.name][-1]
            if local.size is not None:
                return local.size
        return _MAX_U64

    def _by_path(self, path: list[str]) -> int | None:
        node: Decl | None = self.roots[path[0]]
        for step in path[1:]:
            if node is None:
                return None
            if step in ("@items", "@values"):
                node = node.elem
            elif step == "@keys":
                return MAX_REQUEST_BYTES - 2  # conservative: the API server's keys have no size
            else:
                node = node.fields.get(step)
        if node is None:
            return None
        return node.max_elements if node.kind in ("string", "bytes", "list", "map", "dyn") else 1

    def push(self, name: str, path: list[str] | None, size: int | None) -> None:
        self.locals.setdefault(name, []).append(_Local(path, size))

    def cost(self, e: syntax_pb2.Expr) -> int:
        which = e.WhichOneof("expr_kind")
        if which == "const_expr":
            return 0
        if which == "ident_expr":
            name = e.ident_expr.name
            local = self.locals.get(name)
            self.paths[e.id] = (local[-1].path or []) if local else [name]
            return 1
        if which == "select_expr":
            sel = e.select_expr
            if sel.test_only:
                return self.cost(sel.operand)  # has(): free (PresenceTestHasCost(false))
            total = self.cost(sel.operand)
            if self.kind(sel.operand) in ("map_type", "message_type", "type_param"):
                total += 1
            self.paths[e.id] = [*(self.path(sel.operand) or ["?"]), sel.field]
            return total
        if which == "call_expr":
            return self.call(e)
        if which == "list_expr":
            elements = e.list_expr.elements
            total = sum(self.cost(x) for x in elements) + 10
            self.items[e.id] = max((self.size(x) for x in elements), default=0)
            return _cap(total)
        if which == "struct_expr":
            total = sum(self.cost(x) for x in _children(e))
            return _cap(total + (40 if e.struct_expr.message_name else 30))
        if which == "comprehension_expr":
            return self.comprehension(e)
        return 0

    def comprehension(self, e: syntax_pb2.Expr) -> int:
        c = e.comprehension_expr
        total = self.cost(c.iter_range) + self.cost(c.accu_init)
        self.push(c.accu_var, self.path(c.accu_init), self.size(c.accu_init))
        range_path = self.path(c.iter_range)
        is_list = self.kind(c.iter_range) == "list_type"
        items = self.items.get(c.iter_range.id)

        def sub(step: str) -> list[str] | None:
            return None if range_path is None else [*range_path, step]

        if c.iter_var2:
            self.push(c.iter_var, sub("@indices" if is_list else "@keys"), None)
            self.push(c.iter_var2, sub("@items" if is_list else "@values"), items)
        else:
            self.push(c.iter_var, sub("@items" if is_list else "@keys"), items)
        per_item = self.cost(c.loop_condition) + self.cost(c.loop_step)
        self.locals[c.iter_var].pop()
        if c.iter_var2:
            self.locals[c.iter_var2].pop()
        total += self.cost(c.result)
        self.locals[c.accu_var].pop()
        count = self.size(c.iter_range)
        if c.accu_init.WhichOneof("expr_kind") in ("list_expr", "struct_expr"):
            self.sizes[e.id] = count
        return _cap(total + _cap(count * per_item))

    def call(self, e: syntax_pb2.Expr) -> int:
        call = e.call_expr
        fn, args = call.function, list(call.args)
        if fn == "dyn" and len(args) == 1:
            total = 1 + self.cost(args[0])
            self.sizes[e.id] = self.size(args[0])
            return total
        costs = [self.cost(a) for a in args]
        target = call.target if call.HasField("target") else None
        total = self.cost(target) if target is not None else 0
        arg_sum = _cap(sum(costs))
        size = self.size
        if fn in ("_&&_", "_||_"):
            return _cap(total + arg_sum)
        if fn == "_?_:_":
            self.sizes[e.id] = max(size(args[1]), size(args[2]))
            return _cap(total + costs[0] + max(costs[1], costs[2]))
        if fn == "_[_]":
            step = "@items" if self.kind(args[0]) == "list_type" else "@values"
            self.paths[e.id] = [*(self.path(args[0]) or ["?"]), step]
            return _cap(total + 1 + arg_sum)
        if fn == "@in":
            if self.kind(args[1]) == "list_type":
                return _cap(total + size(args[1]) + arg_sum)
            return _cap(total + 1 + arg_sum)
        if fn in ("startsWith", "endsWith") and target is not None:
            return _cap(total + _factor(size(args[0]), _TRAVERSAL) + arg_sum)
        if fn == "matches":
            subject, pattern = (target, args[0]) if target is not None else (args[0], args[1])
            strings = _factor(_cap(size(subject) + 1), _TRAVERSAL)
            return _cap(total + _cap(strings * _factor(size(pattern), _REGEX)) + arg_sum)
        if fn == "contains" and target is not None:
            both = _factor(size(target), _TRAVERSAL) * _factor(size(args[0]), _TRAVERSAL)
            return _cap(total + _cap(both) + arg_sum)
        if fn == "_+_" and (self.kind(e) == "list_type" or self.text(e)):
            result = _cap(size(args[0]) + size(args[1]))
            self.sizes[e.id] = result
            if self.kind(e) == "list_type":
                return _cap(total + 1 + arg_sum)
            return _cap(total + _factor(result, _TRAVERSAL) + arg_sum)
        if fn in ("_==_", "_!=_") or (
            fn in ("_<_", "_<=_", "_>_", "_>=_")
            and self.checked.type_map[args[0].id].primitive
            in (checked_pb2.Type.STRING, checked_pb2.Type.BYTES)
        ):
            return _cap(total + _factor(min(size(args[0]), size(args[1])), _TRAVERSAL) + arg_sum)
        if fn in _CONSTANT_TIME:
            return _cap(total + 1 + arg_sum)
        # anything else: linear in everything it is given (never less than the libraries' price)
        given = [*([target] if target is not None else []), *args]
        sized = [size(x) for x in given if self.sized(x)]
        return _cap(total + 1 + _cap(sum(sized)) + arg_sum)

    def text(self, e: syntax_pb2.Expr) -> bool:
        t = self.checked.type_map.get(e.id)
        text = (checked_pb2.Type.STRING, checked_pb2.Type.BYTES)
        return t is not None and t.WhichOneof("type_kind") == "primitive" and t.primitive in text

    def sized(self, e: syntax_pb2.Expr) -> bool:
        """A value whose size a function's cost can grow with: text, a list, a map, dyn."""
        t = self.checked.type_map.get(e.id)
        return (
            t is None
            or self.text(e)
            or t.WhichOneof("type_kind") in ("list_type", "map_type", "dyn")
        )


def estimate_cost(checked: checked_pb2.CheckedExpr, roots: Mapping[str, Decl]) -> int:
    """The most a rule can cost, as the API server estimates it before it admits the rule."""
    return _Coster(checked, roots).cost(checked.expr)


# --- the rules of a CRD -----------------------------------------------------------------------


@dataclass
class CrdRule:
    kind: str
    path: str  # where the rule is, e.g. .spec.perReplica
    rule: dict[str, Any]
    self_type: Decl | None  # None: the API server refuses a rule there
    cardinality: int  # how many times it can run for one object
    correlatable: bool  # oldSelf can be found (no atomic list above it)


def crd_rules(crd: Mapping[str, Any]) -> list[CrdRule]:
    kind = crd["spec"]["names"]["kind"]
    out: list[CrdRule] = []
    for version in crd["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        _walk(kind, root, "", True, 1, True, out)
    return out


def _walk(
    kind: str,
    node: Mapping[str, Any],
    path: str,
    root: bool,
    cardinality: int,
    correlatable: bool,
    out: list[CrdRule],
) -> None:
    typed = decl_type(node, root or bool(node.get("x-kubernetes-embedded-resource")))
    for rule in node.get("x-kubernetes-validations", []):
        out.append(CrdRule(kind, path or ".", rule, typed, cardinality, correlatable))
    for name, prop in (node.get("properties") or {}).items():
        _walk(kind, prop, f"{path}.{name}", False, cardinality, correlatable, out)
    if isinstance(node.get("items"), Mapping):
        times = _cap(cardinality * (typed.max_elements if typed else MAX_REQUEST_BYTES))
        keyed = node.get("x-kubernetes-list-type") == "map"
        _walk(kind, node["items"], f"{path}[*]", False, times, correlatable and keyed, out)
    if isinstance(node.get("additionalProperties"), Mapping):
        times = _cap(cardinality * (typed.max_elements if typed else MAX_REQUEST_BYTES))
        extra = node["additionalProperties"]
        _walk(kind, extra, f"{path}[*]", False, times, correlatable, out)


# --- ValidatingAdmissionPolicies ------------------------------------------------------------
# What the API server declares for a policy's expressions besides `object` and `oldObject`,
# restated from k8s.io/apiserver/pkg/admission/plugin/cel/compile.go (BuildRequestType,
# BuildNamespaceType); `params` is dyn when the policy has a paramKind; `authorizer` is not
# declared here (no expression uses it).
_GVK = obj(group=STRING, version=STRING, kind=STRING)
_GVR = obj(group=STRING, version=STRING, resource=STRING)
REQUEST = obj(
    kind=_GVK, resource=_GVR, subResource=STRING, requestKind=_GVK, requestResource=_GVR,
    requestSubResource=STRING, name=STRING, namespace=STRING, operation=STRING,
    userInfo=obj(username=STRING, uid=STRING, groups=list_of(STRING),
                 extra=map_of(list_of(STRING))),
    dryRun=BOOL, options=DYN,
)  # fmt: skip
NAMESPACE = obj(
    metadata=obj(
        name=STRING, generateName=STRING, namespace=STRING, labels=map_of(STRING),
        annotations=map_of(STRING), UID=STRING, creationTimestamp=TIMESTAMP,
        deletionGracePeriodSeconds=INT, deletionTimestamp=TIMESTAMP, generation=INT,
        resourceVersion=STRING, finalizers=list_of(STRING),
    ),
    spec=obj(finalizers=list_of(STRING)),
    status=obj(
        conditions=list_of(obj(status=STRING, type=STRING, lastTransitionTime=TIMESTAMP,
                               message=STRING, reason=STRING)),
        phase=STRING,
    ),
)  # fmt: skip


def policy_problems(policy: Mapping[str, Any], object_type: Decl) -> list[str]:
    """What the API server's compiler says of a ValidatingAdmissionPolicy's expressions with
    `object` and `oldObject` of `object_type`: its variables in order (each typed, as the API
    server types it, for the ones after it), its matchConditions and validations (bool) and
    messageExpressions (string). With dyn this is the compilation that admits the policy; with a
    kind's type it is the type check the API server reports in status.typeChecking, here also
    applied to the variables and matchConditions."""
    spec = policy["spec"]
    base = {"object": object_type, "oldObject": object_type, "request": REQUEST,
            "namespaceObject": NAMESPACE}  # fmt: skip
    if spec.get("paramKind"):
        base["params"] = DYN
    variables: dict[str, Decl] = {}
    problems: list[str] = []

    def check(where: str, expression: str, want: checked_pb2.Type | None) -> Decl:
        try:
            checked = compile_checked(expression, {**base, "variables": obj(**variables)})
        except CelError as exc:
            problems.append(f"{where}: {exc}")
            return DYN
        got = output_type(checked)
        if want is not None and got != want:  # exactly: dyn is refused (IsExactType)
            problems.append(f"{where}: must evaluate to {want} but got {got}")
        return decl_of_type(got)

    for var in spec.get("variables", []):
        variables[var["name"]] = check(f"variables[{var['name']}]", var["expression"], None)
    for cond in spec.get("matchConditions", []):
        check(f"matchConditions[{cond['name']}]", cond["expression"], BOOL_TYPE)
    string = checked_pb2.Type(primitive=checked_pb2.Type.STRING)
    for i, validation in enumerate(spec.get("validations", [])):
        check(f"validations[{i}]", validation["expression"], BOOL_TYPE)
        if "messageExpression" in validation:
            check(f"validations[{i}].messageExpression", validation["messageExpression"], string)
    return problems


def matched_resources(policy: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(group, version, resource) the type check resolves to kinds: no wildcards, no
    subresources (the API server's typesToCheck)."""
    out = []
    for rule in policy["spec"].get("matchConstraints", {}).get("resourceRules", []):
        for group in rule.get("apiGroups", []):
            for version in rule.get("apiVersions", []):
                for resource in rule.get("resources", []):
                    if "*" not in group + version + resource and "/" not in resource:
                        out.append((group, version, resource))
    return sorted(set(out))
