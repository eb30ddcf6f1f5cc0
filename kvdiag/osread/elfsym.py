"""Find a symbol's run-time address in a live process from /proc maps and the ELF symbol tables.

Just enough ELF64 (little endian) reading to look up one symbol such as
``_PyRuntime``: section headers, ``.dynsym``/``.symtab`` and their string
tables, and the first PT_LOAD segment to compute the load bias. ``_PyRuntime``
is exported in the dynamic table, so this works on stripped interpreters.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvdiag.osread.maps import Mapping, read_maps
from kvdiag.osread.process import read_exe

_ELF_MAGIC = b"\x7fELF"
_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
_PT_LOAD = 1
_ET_EXEC = 2
_SYM_SIZE = 24          # sizeof(Elf64_Sym)


@dataclass(frozen=True)
class ElfSymbol:
    name: str
    value: int           # st_value: link-time address
    size: int


def _read_at(fh: BinaryIO, offset: int, size: int) -> bytes:
    fh.seek(offset)
    return fh.read(size)


def elf_symbol(path: str | Path, name: str, max_table_bytes: int = 64 << 20) -> tuple[ElfSymbol, int, int] | None:
    """Look ``name`` up in ``path``; returns (symbol, e_type, first PT_LOAD vaddr) or None.

    Reads only the ELF header, section headers, symbol tables and program headers.
    """
    want = name.encode()
    try:
        with open(path, "rb") as fh:
            ehdr = fh.read(64)
            if len(ehdr) < 64 or ehdr[:4] != _ELF_MAGIC or ehdr[4] != 2 or ehdr[5] != 1:
                return None   # only ELF64 little endian (x86_64, aarch64)
            e_type = struct.unpack_from("<H", ehdr, 16)[0]
            e_phoff, e_shoff = struct.unpack_from("<QQ", ehdr, 32)
            e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", ehdr, 54)
            first_load = 0
            phdrs = _read_at(fh, e_phoff, e_phentsize * e_phnum)
            for i in range(e_phnum):
                p_type = struct.unpack_from("<I", phdrs, i * e_phentsize)[0]
                if p_type == _PT_LOAD:
                    first_load = struct.unpack_from("<Q", phdrs, i * e_phentsize + 16)[0]
                    break
            shdrs = _read_at(fh, e_shoff, e_shentsize * e_shnum)
            sections = []
            for i in range(e_shnum):
                base = i * e_shentsize
                sh_type = struct.unpack_from("<I", shdrs, base + 4)[0]
                sh_offset, sh_size = struct.unpack_from("<QQ", shdrs, base + 24)
                sh_link = struct.unpack_from("<I", shdrs, base + 40)[0]
                sections.append((sh_type, sh_offset, sh_size, sh_link))
            for table_type in (_SHT_DYNSYM, _SHT_SYMTAB):
                for sh_type, sh_offset, sh_size, sh_link in sections:
                    if sh_type != table_type or sh_link >= len(sections) or sh_size > max_table_bytes:
                        continue
                    str_off, str_size = sections[sh_link][1], sections[sh_link][2]
                    if str_size > max_table_bytes:
                        continue
                    strtab = _read_at(fh, str_off, str_size)
                    symtab = _read_at(fh, sh_offset, sh_size)
                    for off in range(0, len(symtab) - _SYM_SIZE + 1, _SYM_SIZE):
                        st_name = struct.unpack_from("<I", symtab, off)[0]
                        if strtab[st_name:st_name + len(want) + 1] != want + b"\x00":
                            continue
                        st_value, st_size = struct.unpack_from("<QQ", symtab, off + 8)
                        if st_value == 0:
                            continue   # an undefined reference, not the definition
                        return ElfSymbol(name, st_value, st_size), e_type, first_load
    except (OSError, struct.error):
        return None
    return None


def _open_path(pid: int, path: str) -> str:
    """The target's file as seen from here: via /proc/PID/root when it lives in another mount ns."""
    via_root = f"/proc/{pid}/root{path}"
    return via_root if os.path.exists(via_root) else path


@dataclass(frozen=True)
class RuntimeSymbol:
    address: int         # run-time address in the target
    size: int
    object_path: str     # the ELF that defines it (libpython or the python binary)


def find_runtime_symbol(pid: int, name: str = "_PyRuntime") -> RuntimeSymbol | None:
    """Run-time address of ``name`` in ``pid``, searching libpython first, then the executable."""
    by_path: dict[str, list[Mapping]] = {}
    for m in read_maps(pid) or []:
        if m.path.startswith("/"):
            by_path.setdefault(m.path, []).append(m)
    exe = read_exe(pid) or ""
    candidates = [p for p in by_path if "libpython" in os.path.basename(p)]
    if exe in by_path:
        candidates.append(exe)
    for path in candidates:
        found = elf_symbol(_open_path(pid, path), name)
        if found is None:
            continue
        sym, e_type, first_load = found
        if e_type == _ET_EXEC:
            bias = 0
        else:
            zero = [m.start for m in by_path[path] if m.offset == 0]
            if not zero:
                continue
            bias = min(zero) - (first_load & ~0xFFF)
        return RuntimeSymbol(bias + sym.value, sym.size, path)
    return None
