"""The storage engine's rooms, read from its imports: each room imports only the rooms before it (docs/design.md).

``core/store/`` keeps the directory's file access at its root and its modules in rooms by role. The order
below is the one docs/design.md draws; a room of one level never imports another room of that level.
"""

from __future__ import annotations

import re

from test_imports import PACKAGE, ROOT, graph

STORE = f"{PACKAGE}.core.store"

#: The rooms bottom to top ("": the modules at the root of core/store/, which every room opens files through).
ROOMS: list[tuple[str, ...]] = [
    ("",),
    ("shards",),
    ("snapshots", "tags", "vectors"),
    ("writing",),
    ("reading",),
    ("maintenance",),
]


def room_of(module: str) -> tuple[int, str]:
    """``(level, room)`` of a module below core/store (its root's modules are room ``""``)."""
    parts = module.removeprefix(STORE + ".").split(".")
    room = parts[0] if len(parts) > 1 or (ROOT / "core" / "store" / parts[0]).is_dir() else ""
    levels = [level for level, rooms in enumerate(ROOMS) if room in rooms]
    assert levels, f"{module}: core/store/{room}/ is a room docs/design.md and ROOMS do not place"
    return levels[0], room


def room_breaches(edges: dict[str, set[str]]) -> list[str]:
    """``source -> target`` for each import of a room at its own level or above (another room's)."""
    breaches = []
    for source, targets in sorted(edges.items()):
        if not source.startswith(STORE + "."):
            continue  # the package's __init__ gathers the public names of every room
        level, room = room_of(source)
        for target in sorted(t for t in targets if t.startswith(STORE + ".")):
            target_level, target_room = room_of(target)
            if target_room != room and target_level >= level:
                breaches.append(f"{source} -> {target}")
    return breaches


def test_the_breach_finder_finds_an_import_of_a_room_above_or_beside() -> None:
    edges = {
        f"{STORE}.shards.journal": {f"{STORE}.writing.writer", f"{STORE}.files", f"{STORE}.shards.manifest"},
        f"{STORE}.tags.book": {f"{STORE}.vectors.vector_files", f"{STORE}.shards.journal"},
        f"{STORE}.maintenance.repair": {f"{STORE}.reading.health", f"{STORE}.tags.tag_cache"},
    }
    assert room_breaches(edges) == [
        f"{STORE}.shards.journal -> {STORE}.writing.writer",
        f"{STORE}.tags.book -> {STORE}.vectors.vector_files",
    ]


def test_each_room_imports_only_the_rooms_before_it() -> None:
    assert room_breaches(graph()) == []


def test_every_room_is_placed_and_drawn_in_the_design_page() -> None:
    on_disk = {path.parent.name for path in (ROOT / "core" / "store").glob("*/__init__.py")}
    placed = {room for rooms in ROOMS for room in rooms if room}
    assert on_disk == placed
    page = (ROOT.parent / "docs" / "design.md").read_text()
    section = page.split("## The store's rooms")[1].split("\n## ")[0]
    drawn = set(re.findall(r"`([a-z_]+)/`", section))
    assert placed <= drawn, sorted(placed - drawn)
