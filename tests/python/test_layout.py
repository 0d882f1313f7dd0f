#!/usr/bin/python3
"""The ctypes structs of kvrope._lib against client/kvrope.h: a small C
program prints sizeof and offsetof of every struct and field the binding
declares, compiled with the system C compiler; every number must match.

Run: /usr/bin/python3 -m pytest -q tests/python/test_layout.py
"""
import ctypes
import os
import shutil
import subprocess

import pytest

from conftest import ROOT

from kvrope import _lib


def c_layout(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "client/kvrope.h"',
             'int main(void) {']
    for name, cls in _lib.STRUCTS.items():
        lines.append(f'    printf("{name} %zu %zu\\n", sizeof({name}), _Alignof({name}));')
        for f in cls._fields_:
            lines.append(f'    printf("{name}.{f[0]} %zu\\n", offsetof({name}, {f[0]}));')
    lines += ['    return 0;', '}']
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    r = subprocess.run([cc, "-std=c11", "-I", ROOT, "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"layout probe does not compile (a field renamed?):\n{r.stderr}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        key, *nums = line.split()
        got[key] = tuple(int(x) for x in nums)
    return got


def test_ctypes_structs_match_the_header(tmp_path):
    c = c_layout(tmp_path)
    bad = []
    for name, cls in _lib.STRUCTS.items():
        if c[name] != (ctypes.sizeof(cls), ctypes.alignment(cls)):
            bad.append(f"{name}: C sizeof/align {c[name]}, ctypes "
                       f"{(ctypes.sizeof(cls), ctypes.alignment(cls))}")
        for f in cls._fields_:
            off = getattr(cls, f[0]).offset
            if c[f"{name}.{f[0]}"] != (off,):
                bad.append(f"{name}.{f[0]}: C offset {c[name + '.' + f[0]][0]}, ctypes {off}")
    assert not bad, "\n".join(bad)


def test_edit_structs_are_declared():
    for s in ("kvr_edit_range", "kvr_edit_args", "kvr_edit_span_res", "kvr_edit_res",
              "kvr_refresh_args", "kvr_context_edit"):
        assert s in _lib.STRUCTS
    assert os.path.exists(os.path.join(ROOT, "client", "kvrope.h"))
