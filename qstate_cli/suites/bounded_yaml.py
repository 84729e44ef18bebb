"""YAML read with limits: a suite (or a `--set` value) can neither hang nor exhaust memory.

PyYAML's SafeLoader never runs code, but it will compose whatever the text describes: an
"alias bomb" of 10 levels of 10 aliases each is 520 bytes and 10^10 nodes once followed;
`a: &a [*a]` is a node that contains itself. Everything after the loader (duplicate-key
check, schema, point expansion, JSON) follows aliases, so the limits are enforced on the
composed node graph, before any of that runs:

    MAX_BYTES    1 MiB     of YAML text (suites are a few KiB)
    MAX_ALIASES  100       `*name` references in one document
    MAX_NODES    100,000   nodes with every alias followed (counted on the graph, memoized,
                           so counting a bomb costs the size of the text, not of the bomb)
    MAX_DEPTH    64        levels of nesting (with aliases followed)
    no cycles              an alias inside the node it names is refused

A violation is a `YAMLLimitError` (a yaml.YAMLError with a mark), so callers report it
like a syntax error: FILE:LINE: message.
"""
from __future__ import annotations

import yaml

MAX_BYTES = 1 << 20
MAX_ALIASES = 100
MAX_NODES = 100_000
MAX_DEPTH = 64


class YAMLLimitError(yaml.YAMLError):
    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases while composing (see module docstring)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.alias_count = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self.alias_count += 1
            if self.alias_count > MAX_ALIASES:
                raise YAMLLimitError(f"more than {MAX_ALIASES} aliases (*name); write the values out",
                                     event.start_mark)
        return super().compose_node(parent, index)


def check_graph(node) -> None:
    """Refuse a composed node graph that is cyclic, too deep or too large once aliases are
    followed (YAMLLimitError). Each distinct node is visited once."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(n, depth: int) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise YAMLLimitError("a recursive alias: the node contains itself", n.start_mark)
        if depth > MAX_DEPTH:
            raise YAMLLimitError(f"nested deeper than {MAX_DEPTH} levels", n.start_mark)
        open_.add(key)
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [x for pair in n.value for x in pair]
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_NODES:
                raise YAMLLimitError(f"more than {MAX_NODES:,} values once aliases are expanded (an alias bomb?)",
                                     n.start_mark)
        open_.discard(key)
        sizes[key] = total
        return total

    size(node, 0)


def compose(text: str):
    """(root node or None, loader): the text composed and checked; call
    `loader.construct_document(node)` for the data, then `loader.dispose()`."""
    if len(text.encode("utf-8", "replace")) > MAX_BYTES:
        raise YAMLLimitError(f"larger than {MAX_BYTES >> 20} MiB; a suite is a few KiB")
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            check_graph(node)
    except RecursionError:
        loader.dispose()
        raise YAMLLimitError(f"nested deeper than {MAX_DEPTH} levels") from None
    except BaseException:
        loader.dispose()
        raise
    return node, loader


def safe_load(text: str):
    """yaml.safe_load with the limits above."""
    node, loader = compose(text)
    try:
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()
