"""A minimal stand-in for the agent's table writer, for the plugin tests only.

It creates a flow table file exactly as ``flowsched/shm/layout.py`` documents it (header with
magic/version/sizes, a config area with class map, default levels and level markings) and
reads/writes slot fields, so the tests do not depend on the agent's own table module.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

from flowsched.shm import layout

HEADER = {name: (off, fmt) for name, off, fmt in layout.HEADER_FIELDS}
SLOT = {name: (off, fmt) for name, off, fmt in layout.SLOT_FIELDS}

#: the compiled-in defaults of the plugin (nccl_plugin/src/class_defaults.h)
DSCP = (46, 40, 34, 32, 18, 10, 8, 1)
SO_PRIORITY = (6, 5, 4, 3, 2, 1, 0, 0)


class TestTable:
    """A flow table file mapped read-write, with helpers to set the config and read slots."""

    __test__ = False  # not a pytest test class

    def __init__(self, path: Path, num_slots: int = 64) -> None:
        self.path = path
        self.num_slots = num_slots
        size = layout.table_size(num_slots)
        with open(path, "wb") as f:
            f.truncate(size)
        os.chmod(path, 0o600)
        self._fd = os.open(path, os.O_RDWR)
        self.mem = mmap.mmap(self._fd, size)
        self.configure()

    def close(self) -> None:
        self.mem.close()
        os.close(self._fd)

    def put(self, name: str, value: Any, base: int = 0, table: dict[str, Any] = HEADER) -> None:
        off, fmt = table[name]
        values = value if isinstance(value, tuple) else (value,)
        struct.pack_into(fmt, self.mem, base + off, *values)

    def get(self, name: str) -> int:
        """A scalar header field."""
        off, fmt = HEADER[name]
        value: int = struct.unpack_from(fmt, self.mem, off)[0]
        return value

    def configure(
        self,
        class_map: dict[int, int] | None = None,
        default_level: tuple[int, ...] = (0, 3, 2, 1, 2, 7),
        fallback_class: int = 0,
        num_levels: int = 8,
        dscp: tuple[int, ...] = DSCP,
    ) -> None:
        """(Re)write the header and config area, like an agent starting up: under the
        config_seq seqlock (odd while written, then even and larger than before)."""
        seq = self.get("config_seq")
        self.put("config_seq", (seq + 1) | 1)
        self._write_config(class_map, default_level, fallback_class, num_levels, dscp)
        self.put("config_seq", ((seq + 1) | 1) + 1)

    def _write_config(
        self,
        class_map: dict[int, int] | None,
        default_level: tuple[int, ...],
        fallback_class: int,
        num_levels: int,
        dscp: tuple[int, ...],
    ) -> None:
        for name, value in (
            ("magic", layout.MAGIC),
            ("version", layout.VERSION),
            ("header_size", layout.HEADER_SIZE),
            ("slot_size", layout.SLOT_SIZE),
            ("num_slots", self.num_slots),
            ("num_levels", num_levels),
            ("agent_pid", os.getpid()),
            ("generation", 1),
            ("flags", layout.FLAG_AGENT_ATTACHED),
        ):
            self.put(name, value)
        pairs = sorted((class_map or {}).items())
        flat: list[int] = []
        for tc, cls in pairs + [(0, 0)] * (layout.MAX_CLASS_MAP - len(pairs)):
            flat += [tc, cls]
        self.put("num_class_map", len(pairs))
        self.put("fallback_class", fallback_class)
        self.put("class_map", tuple(flat))
        levels = list(default_level) + [0] * (layout.MAX_CLASSES - len(default_level))
        self.put("default_level", tuple(levels))
        marks: list[int] = []
        for level in range(layout.MAX_LEVELS):
            i = min(level, len(SO_PRIORITY) - 1)
            marks += [dscp[min(level, len(dscp) - 1)], SO_PRIORITY[i]]
        self.put("level_marking", tuple(marks))

    def corrupt(self) -> None:
        """Break the magic number."""
        self.put("magic", 0xDEADBEEF)

    def slot(self, index: int) -> dict[str, Any]:
        """Every field of slot ``index``."""
        base = layout.slot_offset(index)
        out: dict[str, Any] = {}
        for name, (off, fmt) in SLOT.items():
            out[name] = struct.unpack_from(fmt, self.mem, base + off)[0]
        return out

    def slots(self, state: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """(index, fields) of every slot not FREE (or in ``state``)."""
        found = []
        for i in range(self.num_slots):
            s = self.slot(i)
            if (state is None and s["state"] != layout.SLOT_FREE) or s["state"] == state:
                found.append((i, s))
        return found

    def set_level(self, index: int, level: int) -> int:
        """Write a slot's level as the agent does (one 4-byte store, then level_set_ns)."""
        base = layout.slot_offset(index)
        self.put("level", level, base, SLOT)
        now = time.monotonic_ns()
        self.put("level_set_ns", now, base, SLOT)
        return now
