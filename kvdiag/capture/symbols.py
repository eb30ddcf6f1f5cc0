"""Name native return addresses read in another process, from its memory map and the ELF symbol tables.

The agent (:mod:`kvdiag.capture.agent`) hands back raw addresses and a copy of the process's
``/proc/PID/maps`` at dump time; this module turns each address into (function, library) the way
pystack and gdb print a native frame. Only the ELF files on disk are read (through ``/proc/PID/root``
when the target lives in another mount namespace): nothing of the target's memory.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import struct
from dataclasses import dataclass
from functools import lru_cache

from kvdiag.osread.maps import Mapping

_SHT_SYMTAB, _SHT_DYNSYM = 2, 11
_PT_LOAD = 1
_STT_FUNC, _STT_GNU_IFUNC = 2, 10
_MAX_TABLE = 256 << 20


@dataclass(frozen=True)
class _Table:
    loads: tuple[tuple[int, int, int], ...]     # (p_offset, p_vaddr, p_filesz) of each PT_LOAD
    starts: tuple[int, ...]                     # sorted st_value of each function symbol
    ends: tuple[int, ...]
    names: tuple[str, ...]


def _read_table(path: str) -> _Table | None:
    try:
        with open(path, "rb") as fh:
            ehdr = fh.read(64)
            if len(ehdr) < 64 or ehdr[:4] != b"\x7fELF" or ehdr[4] != 2 or ehdr[5] != 1:
                return None
            e_phoff, e_shoff = struct.unpack_from("<QQ", ehdr, 32)
            e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", ehdr, 54)
            fh.seek(e_phoff)
            phdrs = fh.read(e_phentsize * e_phnum)
            loads = []
            for i in range(e_phnum):
                p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", phdrs,
                                                                                         i * e_phentsize)
                if p_type == _PT_LOAD:
                    loads.append((p_offset, p_vaddr, p_filesz))
            fh.seek(e_shoff)
            shdrs = fh.read(e_shentsize * e_shnum)
            sections = [struct.unpack_from("<IIQQQQII", shdrs, i * e_shentsize) for i in range(e_shnum)]
            syms: dict[int, tuple[int, str]] = {}
            for table_type in (_SHT_SYMTAB, _SHT_DYNSYM):
                for sec in sections:
                    _name, sh_type, _fl, _addr, sh_offset, sh_size, sh_link, _info = sec
                    if sh_type != table_type or sh_link >= len(sections) or sh_size > _MAX_TABLE:
                        continue
                    str_off, str_size = sections[sh_link][4], sections[sh_link][5]
                    if str_size > _MAX_TABLE:
                        continue
                    fh.seek(str_off)
                    strtab = fh.read(str_size)
                    fh.seek(sh_offset)
                    symtab = fh.read(sh_size)
                    for st_name, st_info, _other, shndx, value, size in struct.iter_unpack("<IBBHQQ",
                                                                                           symtab[:len(symtab) // 24
                                                                                                  * 24]):
                        if value == 0 or shndx == 0 or (st_info & 0xF) not in (_STT_FUNC, _STT_GNU_IFUNC):
                            continue
                        if value in syms and syms[value][0] >= size:
                            continue
                        end = strtab.find(b"\x00", st_name)
                        syms[value] = (size, strtab[st_name:end].decode("utf-8", "replace"))
    except (OSError, struct.error, ValueError):
        return None
    order = sorted(syms)
    return _Table(tuple(loads), tuple(order), tuple(v + max(syms[v][0], 1) for v in order),
                  tuple(syms[v][1] for v in order))


@lru_cache(maxsize=256)
def _table_cached(path: str, mtime_ns: int, size: int) -> _Table | None:
    return _read_table(path)


def _table(path: str) -> _Table | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _table_cached(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=1)
def _demangler() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    return lib


@lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """``_ZN3foo3barEv`` -> ``foo::bar()``; anything else unchanged."""
    if not name.startswith("_Z"):
        return name
    lib = _demangler()
    if lib is None:
        return name
    status = ctypes.c_int(0)
    ptr = lib.__cxa_demangle(name.encode(), None, None, ctypes.byref(status))
    if not ptr or status.value != 0:
        return name
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(ptr))


@dataclass(frozen=True)
class NativeName:
    function: str | None     # None: no symbol covers the address
    library: str | None      # the mapped file ("" paths, [vdso] etc. as the map names them)


class Symbolizer:
    """Addresses of one process at one instant (its maps then) -> function and library names."""

    def __init__(self, pid: int, maps: list[Mapping]) -> None:
        self.pid = pid
        self.maps = sorted((m for m in maps if "x" in m.perms or m.path.startswith("/")), key=lambda m: m.start)
        self._starts = [m.start for m in self.maps]

    def _file(self, path: str) -> str:
        via_root = f"/proc/{self.pid}/root{path}"
        return via_root if os.path.exists(via_root) else path

    def name(self, addr: int, return_address: bool = True) -> NativeName:
        """``return_address``: ``addr`` follows a call (every frame but the innermost), so the call
        instruction before it is what is named."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self.maps[i].end:
            return NativeName(None, None)
        m = self.maps[i]
        path = m.path.removesuffix(" (deleted)")
        if not path.startswith("/"):
            return NativeName(None, path or None)
        table = _table(self._file(path))
        if table is None:
            return NativeName(None, path)
        file_off = addr - (1 if return_address else 0) - m.start + m.offset
        vaddr = next((file_off - off + va for off, va, size in table.loads if off <= file_off < off + size), None)
        if vaddr is None:
            return NativeName(None, path)
        k = bisect.bisect_right(table.starts, vaddr) - 1
        if k < 0 or vaddr >= table.ends[k]:
            return NativeName(None, path)
        return NativeName(demangle(table.names[k]), path)


__all__ = ["NativeName", "Symbolizer", "demangle"]
