"""Reading a YAML (or JSON) file a person wrote: ``sites.yaml``, a rollout spec, a backup, the
advisor's constraints.

``yaml.safe_load`` takes three things such a file gets wrong without a word, or with a traceback;
``read_yaml`` names each where it stands, as a field error is named (``sites[0] (site-a).max_nodes``):

- a key given twice: YAML keeps the last one's value and drops the first (a second ``sites:``
  block pasted at the end loses every site of the first). Named with the lines of both. A key a
  merged mapping gives (``<<: *store``) that the mapping sets again is an override, not a repeat.
- a key YAML reads as no string (an unquoted ``on``, ``yes``, ``1``, ``2024-01-01``): it becomes
  ``True``, ``1`` or a date, which no field is named.
- nesting deeper than ``MAX_DEPTH``: the parser recurses per level, and some thousand brackets
  end in its ``RecursionError``. No file a person writes nests near it.

Pure (no file access): each caller reads the file and says which one in its own words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from typing import Any

import yaml

#: Levels of nesting a file may hold under its top value. The workers' input guard holds every
#: workflow input to the same (``workflows.inputs.MAX_DEPTH``); no file of ours nests half as deep.
MAX_DEPTH = 32
_MERGE_KEY = "tag:yaml.org,2002:merge"
_STR = "tag:yaml.org,2002:str"
_KINDS = {"tag:yaml.org,2002:bool": "a boolean", "tag:yaml.org,2002:int": "a number",
          "tag:yaml.org,2002:float": "a number", "tag:yaml.org,2002:null": "null",
          "tag:yaml.org,2002:timestamp": "a date", "tag:yaml.org,2002:seq": "a list",
          "tag:yaml.org,2002:map": "a mapping"}


class NotYaml(ValueError):
    """The text is not one YAML document ``read_yaml`` reads; the message (``not valid YAML: ...``)
    says why and, where the parser knows, the line."""


@dataclass(frozen=True)
class YamlDocument:
    """The document's value, and what it says that its value would lose or misname."""

    data: Any
    #: Keys given twice: ``sites: given twice (lines 10 and 44); YAML keeps only the last ...``.
    twice: list[str] = field(default_factory=list)
    #: Keys YAML reads as no string: ``(top level): the key True is a boolean to YAML ...``.
    not_strings: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        return self.twice + self.not_strings


class _TooDeep(Exception):
    def __init__(self, mark: yaml.Mark | None) -> None:
        super().__init__()
        self.mark = mark


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that stops composing past ``MAX_DEPTH`` levels, before Python's stack does."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:  # the top value is level 1 here
                raise _TooDeep(self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_yaml(text: str) -> YamlDocument:
    """``text``'s one document as ``yaml.safe_load`` reads it, with the keys it gives twice and
    those YAML reads as no string; ``NotYaml`` where it is no YAML document (or nests too deep)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        # Before constructing: construction folds merged mappings (``<<``) into the node's keys.
        twice, not_strings = _keys(node, loader)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise NotYaml(f"not valid YAML: {exc}") from None
    except _TooDeep as deep:
        line = f", line {deep.mark.line + 1}" if deep.mark is not None else ""
        raise NotYaml(f"not valid YAML: nested too deeply (more than {MAX_DEPTH} levels{line})") from None
    except RecursionError:  # a backstop: the depth above stops well before Python's stack would
        raise NotYaml("not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()
    return YamlDocument(data, twice, not_strings)


def _name_of(node: yaml.Node) -> str:
    """A list entry's ``name:`` as written, to say where it stands (``sites[2] (site-c)``)."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == "name" and isinstance(value, yaml.ScalarNode):
                return str(value.value)
    return ""


def _keys(root: yaml.Node | None, loader: yaml.SafeLoader) -> tuple[list[str], list[str]]:
    twice: list[str] = []
    not_strings: list[str] = []
    seen: set[int] = set()  # a node an alias repeats is looked at once (no alias bomb)
    todo: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while todo:
        node, where = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            inner: list[tuple[yaml.Node, str]] = []
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag == _MERGE_KEY:
                    inner.append((value, where))
                    continue
                if key.tag != _STR:
                    not_strings.append(f"{where or '(top level)'}: {_not_a_string(key, loader)}")
                    inner.append((value, where))
                    continue
                at = f"{where}.{key.value}" if where else key.value
                name = (key.tag, key.value)
                if name in first:
                    twice.append(f"{at}: given twice (lines {first[name] + 1} and {key.start_mark.line + 1}); "
                                 f"YAML keeps only the last, so the first would be lost: keep one")
                first.setdefault(name, key.start_mark.line)
                inner.append((value, at))
            todo.extend(reversed(inner))  # in the file's order
        elif isinstance(node, yaml.SequenceNode):
            inner = []
            for i, item in enumerate(node.value):
                name = _name_of(item)
                inner.append((item, f"{where}[{i}]" + (f" ({name})" if name else "")))
            todo.extend(reversed(inner))
    return twice, not_strings


def _not_a_string(key: yaml.Node, loader: yaml.SafeLoader) -> str:
    """Why a mapping's ``key`` names no field, in the words of ``fleet.config.parse_config``."""
    if not isinstance(key, yaml.ScalarNode):  # ``? [a, b]: 1``
        return f"a key that is {_KINDS.get(key.tag, 'no string')} to YAML: a key is a name (a string)"
    given = loader.construct_object(key, deep=True)
    what = _KINDS.get(key.tag) or ("a date" if isinstance(given, date) else type(given).__name__)
    return (f"the key {given} is {what} to YAML, not a string (so is an unquoted yes, no, on, off, null, number "
            f"or date): quote it")
