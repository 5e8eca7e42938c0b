"""The shape of the code: no import circle in `kvrelay/`, arrows only downwards between rooms,
and a room of the proxy, like the dev tools, entered only through its face by the code that uses
it (tests may open a room: they test its modules).

Imports are read with `ast`, not run. Every import counts wherever it stands: at the top of a
module, inside a function, under `if TYPE_CHECKING:`. An import inside a function still ties the
two modules together (it only moves the failure from start-up to a call), so a circle dodged
that way is still a circle here.

The rooms, from the bottom up, are `LAYERS`; an import from one room to another must point to a
lower one. A room of the proxy (`kvrelay/proxy/<room>/`) shows the rest of the code its face,
`kvrelay/proxy/<room>/__init__.py`, and what that face's `__all__` names; its modules are its
own. Inside a room, modules import each other directly (never through their own face). A face
names what other rooms, the bench and the scripts use; the tests import a room's modules where
they test them (as a library's own tests do), so no name sits on a face only for a test.
`kvrelay/devtools/` has a face too: code outside it takes its names, or its modules as
namespaces, from `kvrelay/devtools/__init__.py`.

Why a test and not import-linter's contracts: its layers and acyclic-siblings contracts could
say the arrows and the circles, and a protected contract per room (its modules, `room.*`, only
imported by the room) the entering through faces, with an ignore line for each module a face
exports as a namespace and each of its importers. Four rules read a face's own text, which no
contract sees: a room never imports through its own face (the circle a face makes), a face
exports only what it imports, no face name is taken by tests only, and every import names a
module that exists (the import graph leaves out what it cannot find). One reader of the imports
for all of them, rather than two that could disagree.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A new top-level package or proxy room must be placed here.
LAYERS = (
    "kvrelay",
    "kvrelay.prometheus_text",
    "kvrelay.connector",
    "kvrelay.kvcache_map",
    "kvrelay.enginesim",
    "kvrelay.devtools",
    "kvrelay.proxy.base",
    "kvrelay.proxy.config",
    "kvrelay.proxy.telemetry",
    "kvrelay.proxy.engines",
    "kvrelay.proxy.fleet",
    "kvrelay.proxy.tenants",
    "kvrelay.proxy.turn",
    "kvrelay.proxy.http",
    "kvrelay.proxy",  # the entry points: cli, demo
)
PROXY = "kvrelay.proxy"
DEVTOOLS = "kvrelay.devtools"
# Code outside kvrelay/ that must use the proxy's rooms through their faces too; the tests, which
# test the rooms' modules, import them directly (`ROOM_TESTERS`).
CLIENTS = ("tests", "bench", "scripts", "deploy")
ROOM_TESTERS = ("tests",)


@dataclass(frozen=True)
class Import:
    """One imported module (or one name of a `from` import) of one source file."""

    importer: str  # dotted module name of the file
    line: int
    target: str  # the module the import loads
    via: str | None = None  # `from via import name`: the package the name was taken from


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources(root: Path, tops: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` file below `root/<top>`."""
    out: dict[str, Path] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            out[module_name(path, root)] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> Iterator[Import]:
    """Every kvrelay import of one file, wherever it stands in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvrelay":
                    yield Import(name, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "kvrelay":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in modules:  # a module taken from its package
                    yield Import(name, node.lineno, sub, via=source)
                else:
                    yield Import(name, node.lineno, source)


def face_exports(face: Path) -> set[str]:
    """The names in a face's `__all__`."""
    for node in ast.parse(face.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return set(value)
    return set()


def room_of(module: str, rooms: Iterable[str]) -> str:
    """The innermost room in `rooms` holding `module`."""
    best = ""
    for room in rooms:
        if (module == room or module.startswith(room + ".")) and len(room) > len(best):
            best = room
    return best


def proxy_rooms(modules: dict[str, Path]) -> set[str]:
    """The proxy's sub-packages: `kvrelay.proxy.<room>`."""
    return {
        m for m, p in modules.items()
        if p.name == "__init__.py" and m.startswith(PROXY + ".") and m.count(".") == 2
    }  # fmt: skip


def proxy_room(module: str, rooms: set[str]) -> str | None:
    """`kvrelay.proxy.<room>` for a module inside a proxy sub-package, else None."""
    room = ".".join(module.split(".")[:3])
    return room if room in rooms else None


def edge_target(imp: Import, exports: dict[str, set[str]]) -> str:
    """What an import depends on: a module exported by a face is reached through the face."""
    via = imp.via
    exported = via in exports and imp.target.rpartition(".")[2] in exports[via]
    if exported and proxy_room(imp.importer, set(exports)) != via:
        return via
    return imp.target


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def faces(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {room: face_exports(modules[room]) for room in proxy_rooms(modules)}


def kvrelay_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    exports = faces(modules)
    names = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for imp in imports_of(name, path, names):
            target = edge_target(imp, exports)
            if target in names and target != name:
                graph[name].add(target)
    return graph


def private_reaches(modules: dict[str, Path], clients: dict[str, Path], root: Path) -> list[str]:
    """Imports of a proxy room's own module from outside that room, not through its face."""
    exports = faces(modules)
    rooms = set(exports)
    names = set(modules)
    bad = []
    for name, path in {**modules, **clients}.items():
        for imp in imports_of(name, path, names):
            room = proxy_room(imp.target, rooms)
            if room is None or imp.target == room or proxy_room(name, rooms) == room:
                continue
            if imp.via == room and imp.target.rpartition(".")[2] in exports.get(room, set()):
                continue  # a module the face exports as a namespace
            bad.append(f"{path.relative_to(root)}:{imp.line} imports {imp.target}; use {room}")
    return bad


def devtools_reaches(modules: dict[str, Path], clients: dict[str, Path], root: Path) -> list[str]:
    """Imports of a dev-tools module from outside `kvrelay/devtools`, not through its face."""
    exported = face_exports(modules[DEVTOOLS])
    bad = []
    for name, path in {**modules, **clients}.items():
        if room_of(name, [DEVTOOLS]):
            continue
        for imp in imports_of(name, path, set(modules)):
            if not imp.target.startswith(DEVTOOLS + "."):
                continue
            if imp.via == DEVTOOLS and imp.target.rpartition(".")[2] in exported:
                continue  # a module the face exports as a namespace
            bad.append(f"{path.relative_to(root)}:{imp.line} imports {imp.target}; use {DEVTOOLS}")
    return list(dict.fromkeys(bad))  # one line per import, not per name it takes


def names_taken(path: Path, rooms: set[str]) -> Iterator[tuple[str, str]]:
    """(room, name) for each name one file takes from a proxy room's face: `from room import
    name`, or `short.name` where the file imported the room itself (`from kvrelay.proxy import
    fleet`)."""
    tree = ast.parse(path.read_text(), str(path))
    as_module: dict[str, str] = {}  # local name -> room
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if node.module in rooms:
                    yield node.module, alias.name
                elif f"{node.module}.{alias.name}" in rooms:
                    as_module[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            room = as_module.get(node.value.id)
            if room is not None:
                yield room, node.attr


def names_only_tests_take(modules: dict[str, Path], clients: dict[str, Path]) -> list[str]:
    """Names on a proxy room's face that no code outside the room but the tests takes."""
    exports = faces(modules)
    rooms = set(exports)
    testers = set(ROOM_TESTERS)
    taken: dict[tuple[str, str], set[str]] = {}
    for name, path in {**modules, **clients}.items():
        user = name.partition(".")[0]  # kvrelay, tests, bench, ...
        for room, taken_name in names_taken(path, rooms):
            if proxy_room(name, rooms) != room:
                taken.setdefault((room, taken_name), set()).add(user)
    return sorted(
        f"{room}.{n} is taken by tests only: they import it from its module"
        for room, names in exports.items()
        for n in names
        if set() < taken.get((room, n), set()) <= testers
    )


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    rank = {room: i for i, room in enumerate(LAYERS)}
    bad = []
    for a, targets in sorted(graph.items()):
        ra = room_of(a, LAYERS)
        for b in sorted(targets):
            rb = room_of(b, LAYERS)
            if ra != rb and rank[rb] > rank[ra]:
                bad.append(f"{a} ({ra}) imports {b} ({rb}), a room above it")
    return bad


# -- the checks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return sources(ROOT, ["kvrelay"])


@pytest.fixture(scope="module")
def clients() -> dict[str, Path]:
    """Every module of the code outside kvrelay/ that uses it (`CLIENTS`)."""
    return sources(ROOT, [c for c in CLIENTS if (ROOT / c).is_dir()])


def test_no_import_circle_in_kvrelay(modules: dict[str, Path]) -> None:
    assert cycles(kvrelay_graph(modules)) == []


def test_every_module_sits_in_a_layer(modules: dict[str, Path]) -> None:
    found = proxy_rooms(modules)
    rooms = {proxy_room(m, found) or room_of(m, LAYERS) for m in modules}
    assert rooms <= set(LAYERS), f"place these in LAYERS: {sorted(rooms - set(LAYERS))}"


def test_imports_only_point_down(modules: dict[str, Path]) -> None:
    assert upward_arrows(kvrelay_graph(modules)) == []


def test_proxy_rooms_are_entered_through_their_faces(
    modules: dict[str, Path], clients: dict[str, Path]
) -> None:
    users = {n: p for n, p in clients.items() if n.partition(".")[0] not in ROOM_TESTERS}
    assert private_reaches(modules, users, ROOT) == []


def test_no_face_names_what_only_tests_take(
    modules: dict[str, Path], clients: dict[str, Path]
) -> None:
    assert names_only_tests_take(modules, clients) == []


def test_devtools_are_entered_through_their_face(
    modules: dict[str, Path], clients: dict[str, Path]
) -> None:
    assert devtools_reaches(modules, clients, ROOT) == []


def test_each_proxy_room_has_a_face_that_exports_what_it_names(modules: dict[str, Path]) -> None:
    rooms = sorted(proxy_rooms(modules))
    assert rooms, "no proxy rooms found"
    for room in rooms:
        exported = face_exports(modules[room])
        assert exported, f"{room}/__init__.py has no __all__"
        assert ast.get_docstring(ast.parse(modules[room].read_text())), f"{room}: no docstring"
        bound = set()
        for node in ast.parse(modules[room].read_text()).body:
            if isinstance(node, ast.ImportFrom):
                bound |= {a.asname or a.name for a in node.names}
        assert exported <= bound, f"{room} exports names it does not import: {exported - bound}"


# -- the checks check: each finds what it is for in a made-up tree --------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sources(tmp_path, ["kvrelay"])


def test_a_circle_through_a_function_or_type_checking_import_is_found(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "kvrelay/__init__.py": "",
        "kvrelay/a.py": "from kvrelay.b import x\n",
        "kvrelay/b.py": "def f():\n    from kvrelay.a import y\n",
        "kvrelay/c.py": "from kvrelay import d\n",
        "kvrelay/d.py": "import typing\nif typing.TYPE_CHECKING:\n    import kvrelay.c\n",
    })  # fmt: skip
    circles = cycles(kvrelay_graph(modules))
    assert circles == [["kvrelay.a", "kvrelay.b"], ["kvrelay.c", "kvrelay.d"]]


def test_a_room_reached_past_its_face_is_found(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "kvrelay/__init__.py": "",
        "kvrelay/proxy/__init__.py": "",
        "kvrelay/proxy/room/__init__.py": (
            "from kvrelay.proxy.room import spaced\nfrom kvrelay.proxy.room.inner import Thing\n"
            "__all__ = ['Thing', 'spaced']\n"
        ),
        "kvrelay/proxy/room/inner.py": "Thing = 1\n",
        "kvrelay/proxy/room/spaced.py": "",
        "kvrelay/proxy/other/__init__.py": "__all__: list[str] = []\n",
        "kvrelay/proxy/other/ok.py": "from kvrelay.proxy.room import Thing, spaced\n",
        "kvrelay/proxy/other/bad.py": "from kvrelay.proxy.room.inner import Thing\n",
    })  # fmt: skip
    assert private_reaches(modules, {}, tmp_path) == [
        "kvrelay/proxy/other/bad.py:1 imports kvrelay.proxy.room.inner; use kvrelay.proxy.room"
    ]


def test_devtools_reached_past_their_face_are_found(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "kvrelay/__init__.py": "",
        "kvrelay/devtools/__init__.py": (
            "from kvrelay.devtools import spaced\nfrom kvrelay.devtools.inner import Thing\n"
            "__all__ = ['Thing', 'spaced']\n"
        ),
        "kvrelay/devtools/inner.py": "Thing = 1\n",
        "kvrelay/devtools/spaced.py": "",
        "kvrelay/devtools/unnamed.py": "from kvrelay.devtools.inner import Thing\n",
        "kvrelay/proxy/__init__.py": "",
        "kvrelay/proxy/ok.py": "from kvrelay.devtools import Thing, spaced\n",
        "kvrelay/proxy/bad.py": "from kvrelay.devtools.inner import Thing\n",
        "kvrelay/proxy/unnamed.py": "from kvrelay.devtools import unnamed\n",
    })  # fmt: skip
    clients = {"tests.bad": tmp_path / "tests" / "bad.py"}
    clients["tests.bad"].parent.mkdir()
    clients["tests.bad"].write_text("def f():\n    import kvrelay.devtools.spaced\n")
    assert devtools_reaches(modules, clients, tmp_path) == [
        "kvrelay/proxy/bad.py:1 imports kvrelay.devtools.inner; use kvrelay.devtools",
        "kvrelay/proxy/unnamed.py:1 imports kvrelay.devtools.unnamed; use kvrelay.devtools",
        "tests/bad.py:2 imports kvrelay.devtools.spaced; use kvrelay.devtools",
    ]


def test_an_arrow_up_is_found(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "kvrelay/__init__.py": "",
        "kvrelay/connector/__init__.py": "",
        "kvrelay/connector/protocol.py": "def f():\n    from kvrelay.kvcache_map import KVMap\n",
        "kvrelay/kvcache_map/__init__.py": "from kvrelay.connector import protocol\n",
    })  # fmt: skip
    assert upward_arrows(kvrelay_graph(modules)) == [
        "kvrelay.connector.protocol (kvrelay.connector) imports kvrelay.kvcache_map"
        " (kvrelay.kvcache_map), a room above it"
    ]


def test_every_kvrelay_import_names_a_module_that_exists(
    modules: dict[str, Path], clients: dict[str, Path]
) -> None:
    """A stale path (a module that moved to a room) fails here, even inside a function or a
    TYPE_CHECKING block that no test runs."""
    files = {**modules, **clients}
    stale = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {imp.target}"
        for name, path in files.items()
        for imp in imports_of(name, path, set(modules))
        if imp.target not in modules
    ]
    assert stale == []


def test_a_room_never_imports_through_its_own_face(modules: dict[str, Path]) -> None:
    """`from kvrelay.proxy.<room> import x` inside that room goes through the face, which
    imports the room's modules: a circle (face -> module -> face) however it is spelt."""
    rooms = proxy_rooms(modules)
    own_face = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {imp.via or imp.target}"
        for name, path in modules.items()
        if path.name != "__init__.py" and (room := proxy_room(name, rooms)) is not None
        for imp in imports_of(name, path, set(modules))
        if room in (imp.via, imp.target)
    ]
    assert own_face == []


def test_a_face_name_only_tests_take_is_found(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "kvrelay/__init__.py": "",
        "kvrelay/proxy/__init__.py": "",
        "kvrelay/proxy/room/__init__.py": (
            "from kvrelay.proxy.room.inner import Used, Attr, ForTests\n"
            "__all__ = ['Attr', 'ForTests', 'Used']\n"
        ),
        "kvrelay/proxy/room/inner.py": "Used = Attr = ForTests = 1\n",
        "kvrelay/proxy/other/__init__.py": "__all__: list[str] = []\n",
        "kvrelay/proxy/other/a.py": "from kvrelay.proxy.room import Used\n",
        "kvrelay/proxy/other/b.py": "from kvrelay.proxy import room\nx = room.Attr\n",
    })  # fmt: skip
    test = tmp_path / "tests" / "test_room.py"
    test.parent.mkdir()
    test.write_text("from kvrelay.proxy.room import ForTests, Used\n")
    assert names_only_tests_take(modules, {"tests.test_room": test}) == [
        "kvrelay.proxy.room.ForTests is taken by tests only: they import it from its module"
    ]
