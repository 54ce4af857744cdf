"""What ``$ref`` does to a JSON schema, checked before llguidance sees it.

    ref_depth(schema)      # levels the schema nests once its refs are followed (an upper bound)
    endless_refs(schema)   # () if some finite JSON value can match; else the $refs that trap it

Depth: a request's JSON nests at most 128 levels (demo.request_json), but refs chain without
nesting; llguidance 1.9 compiles a schema recursively and crashed the whole process (SIGSEGV, a
stack overflow) on a chain of 2,500 refs (a 90 KB body), or 1,000 objects each holding the next
by ref, even in a request thread. ``ref_depth`` is the longest path through the schema's objects,
nested or referred to, a cycle counted whole: an upper bound on any walk's depth.

No finite value: ``{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}``, or a
required property whose schema refers round ``a -> b -> a``, passes llguidance's check: the grammar compiles, and the
matcher stops in an error state once it has written what it can (``""`` or ``{"x": ``). Which
subschemas admit a finite value is a least fixpoint over an AND/OR graph: a schema needs its
``$ref`` target, every ``allOf`` item, one ``anyOf`` / ``oneOf`` item and one of its types (an
object: its required properties; an array: its first ``minItems`` items and ``contains``; any
other type: nothing). What the graph does not model (``not``, ``if``, patterns, bounds, a ref it
cannot resolve) counts as satisfiable: only a cycle it can prove endless is refused, and
whatever else cannot be enforced is llguidance's to name (and the grammar hook's, at depth).
Both are linear in the schema's size and iterative (neither recurses, whatever the chain).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_COMPOSITE = ("object", "array")


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` ("#", "#/$defs/a") points at; None if it is not local or
    points at nothing (a dangling ref is llguidance's to report)."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Graph:
    """AND/OR nodes: an AND node holds when all its children hold (none: at once), an OR node
    when one does."""

    def __init__(self):
        self.is_and: list[bool] = []
        self.children: list[list[int]] = []

    def add(self, is_and: bool, children: list[int] | None = None) -> int:
        self.is_and.append(is_and)
        self.children.append(children if children is not None else [])
        return len(self.is_and) - 1

    def holding(self) -> list[bool]:
        n = len(self.is_and)
        parents: list[list[int]] = [[] for _ in range(n)]
        waiting = [0] * n
        for p, kids in enumerate(self.children):
            waiting[p] = len(kids)
            for c in kids:
                parents[c].append(p)
        holds = [False] * n
        ready = [i for i in range(n) if self.is_and[i] and not self.children[i]]
        for i in ready:
            holds[i] = True
        while ready:
            c = ready.pop()
            for p in parents[c]:
                if holds[p]:
                    continue
                waiting[p] -= 1
                if not self.is_and[p] or waiting[p] == 0:
                    holds[p] = True
                    ready.append(p)
        return holds


def _objects(root: Any) -> tuple[list[Any], list[list[int]]]:
    """Every object (dict) in ``root`` and, per object, the objects it holds (inside it, through
    lists too) or refers to (a resolvable local ``$ref``), as indices."""
    objects: list[Any] = []
    index: dict[int, int] = {}
    edges: list[list[int]] = []

    def add(d: dict) -> int:
        if id(d) not in index:
            index[id(d)] = len(objects)
            objects.append(d)
            edges.append([])
            todo.append(d)
        return index[id(d)]

    todo: list[dict] = []
    if isinstance(root, dict):
        add(root)
    while todo:
        d = todo.pop()
        out = edges[index[id(d)]]
        ref = d.get("$ref")
        target = _resolve(root, ref) if isinstance(ref, str) else None
        if isinstance(target, dict):
            out.append(add(target))
        inside = list(d.values())
        while inside:
            v = inside.pop()
            if isinstance(v, dict):
                out.append(add(v))
            elif isinstance(v, list):
                inside += v
    return objects, edges


def ref_depth(root: Any) -> int:
    """The objects on the longest path through ``root`` (nesting and refs), each cycle's objects
    counted whole: the depth a walk that follows refs can reach. Iterative (Tarjan's strongly
    connected components, then the longest path over them)."""
    objects, edges = _objects(root)
    n = len(objects)
    order, low, component = [-1] * n, [0] * n, [-1] * n
    stack, on_stack, components = [], [False] * n, []
    counter = 0
    for first in range(n):
        if order[first] != -1:
            continue
        work = [(first, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                order[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if order[w] == -1:
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], order[w])
                continue
            if low[v] == order[v]:  # v roots a component: pop it
                members = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    component[w] = len(components)
                    members.append(w)
                    if w == v:
                        break
                components.append(members)
            if work:  # back in v's parent: its low takes v's
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    # Tarjan emits a component after every component it reaches: longest paths in that order
    longest = [0] * len(components)
    for c, members in enumerate(components):
        reach = max(
            (longest[component[w]] for v in members for w in edges[v] if component[w] != c), default=0
        )
        longest[c] = len(members) + reach
    return max(longest, default=0)


def endless_refs(root: Any) -> tuple[str, ...]:
    """() if some finite JSON value can match ``root`` (as far as the graph can tell), else the
    ``$ref`` values of the subschemas with no finite value (sorted; at least one)."""
    graph, nodes, refs = _Graph(), {}, {}
    always = graph.add(True)

    def node(schema: Any) -> int:
        """The node of ``schema`` (made now, its children filled in by the loop below)."""
        if not isinstance(schema, dict):  # true, false (llguidance refuses false itself), junk
            return always
        key = id(schema)
        if key not in nodes:
            nodes[key] = graph.add(True)
            todo.append(schema)
        return nodes[key]

    todo: list[dict] = []
    start = node(root)
    while todo:
        schema = todo.pop()
        kids = graph.children[nodes[id(schema)]]
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref)
            if target is not None:
                kids.append(node(target))
                refs[id(schema)] = ref
        every = schema.get("allOf")
        kids += [node(item) for item in every] if isinstance(every, list) else []
        for word in ("anyOf", "oneOf"):
            options = schema.get(word)
            if isinstance(options, list):
                kids.append(graph.add(False, [node(o) for o in options]))
        if "const" in schema or "enum" in schema:
            continue  # a literal: written as it is
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
        if kinds is None or any(k not in _COMPOSITE for k in kinds):
            continue  # a scalar type allowed (or any type): that branch needs nothing
        branches = []
        for kind in kinds:
            needs = []
            if kind == "object":
                props, required = schema.get("properties"), schema.get("required")
                if isinstance(props, dict) and isinstance(required, list):
                    needs = [node(props[r]) for r in required if isinstance(r, str) and r in props]
            else:
                needs = _array_needs(schema, node)
            branches.append(graph.add(True, needs))
        kids.append(graph.add(False, branches))
    holds = graph.holding()
    if holds[start]:
        return ()
    return tuple(sorted({ref for key, ref in refs.items() if not holds[nodes[key]]}))


def _array_needs(schema: dict, node) -> list[int]:
    """The nodes an array of ``schema`` needs: its first minItems items, and ``contains``."""
    needs = []
    low = schema.get("minItems")
    low = low if isinstance(low, int) and not isinstance(low, bool) else 0
    prefix = schema.get("prefixItems", schema.get("items") if isinstance(schema.get("items"), list) else None)
    prefix = prefix if isinstance(prefix, list) else []
    rest = schema.get("items") if isinstance(schema.get("items"), dict) else None
    needs += [node(s) for s in prefix[: max(low, 0)]]
    if low > len(prefix) and rest is not None:
        needs.append(node(rest))
    contains, at_least = schema.get("contains"), schema.get("minContains", 1)
    if contains is not None and at_least != 0:
        needs.append(node(contains))
    return needs
