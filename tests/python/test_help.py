"""kvrope's help is per command, --version prints the number, and kvrope(1)
agrees with the help text (issue 31).

The commands are read from `kvrope --help` itself, so a new command is
checked as soon as it is in the help: `kvrope CMD --help` must print that
command's entries only (exit 0), and the man page must have an entry for it;
every --option the man page's COMMANDS section names must be one the help
knows. scripts/gen-gguf.py --help describes every option. No daemon is needed.
"""
import os
import re
import shutil
import subprocess

import pytest

from conftest import BUILD, ROOT

KV = os.path.join(BUILD, "kvrope")
MAN = os.path.join(ROOT, "dist", "man", "kvrope.1")


def kv(*args):
    if not os.access(KV, os.X_OK):
        pytest.skip("build/kvrope is not built")
    env = dict(os.environ, KVROPE_SOCKET="/nonexistent/kvr-help.sock")
    return subprocess.run([KV, *args], capture_output=True, text=True, timeout=30, env=env)


def entries(text):
    """The help's command entries: lines of two spaces then a word."""
    return [ln[2:] for ln in text.splitlines() if re.match(r"  [a-z]", ln)]


def full_help():
    r = kv("--help")
    assert r.returncode == 0, r.stderr
    commands = r.stdout.split("\nCommands:\n", 1)[1].split("\nExit status:", 1)[0]
    return r.stdout, commands


def command_names():
    _, commands = full_help()
    names = []
    for e in entries(commands):
        for part in e.split(" | "):   # "pin CTX | unpin CTX" names two
            w = part.split()[0]
            if re.match(r"[a-z]", w) and w not in names:
                names.append(w)
    return names


def test_every_command_has_its_own_help():
    full, _ = full_help()
    names = command_names()
    for want in ("put", "get", "edit", "assemble", "payload", "llama", "rope", "unpin"):
        assert want in names, names
    for name in names:
        if name == "rope":
            continue
        r = kv(name, "--help")
        assert r.returncode == 0, (name, r.stderr)
        assert r.stdout.startswith(f"usage: kvrope [global options] {name}"), r.stdout
        got = entries(r.stdout)
        assert got, (name, r.stdout)
        for e in got:
            words = [p.split()[0] for p in e.split(" | ")]   # pin CTX | unpin CTX
            assert name in words, f"`kvrope {name} --help` shows another command: {e}"
        assert len(r.stdout) < len(full) / 2, f"`kvrope {name} --help` prints the whole help"


def test_subcommand_help_narrows():
    r = kv("llama", "export", "--help")
    assert r.returncode == 0
    assert "llama export CTX" in r.stdout and "llama import" not in r.stdout
    r = kv("models", "add", "--help")
    assert "models add NAME --config" in r.stdout and "models rm" not in r.stdout
    r = kv("help", "put")   # `kvrope help CMD` too
    assert r.returncode == 0 and "put CTX FILE" in r.stdout and "get CTX" not in r.stdout
    r = kv("frobnicate", "--help")
    assert r.returncode == 2 and "kvrope --help" in r.stderr


def test_rope_verb_help():
    for verb in ("apply", "remove", "reposition"):
        r = kv("rope", verb, "--help")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("usage: kvrope rope apply|remove|reposition"), r.stdout


def test_version_prints_the_number():
    with open(os.path.join(ROOT, "daemon", "daemon.h")) as f:
        ver = re.search(r'#define KVR_DAEMON_VERSION "([^"]+)"', f.read()).group(1)
    r = kv("--version")
    assert r.returncode == 0
    assert r.stdout.startswith(f"kvrope {ver} "), r.stdout


def man_commands():
    """kvrope(1)'s COMMANDS section as groff renders it: (tags, whole text)."""
    if not shutil.which("groff"):
        pytest.skip("groff is not installed (Debian groff-base): man page not checked")
    r = subprocess.run(["groff", "-man", "-Tascii", "-P-cbou", MAN], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    sec = r.stdout.split("\nCOMMANDS\n", 1)[1].split("\nENVIRONMENT\n", 1)[0]
    tags = [ln[7:] for ln in sec.splitlines() if re.match(r" {7}\S", ln)]
    # Words broken across lines by hyphenation ("--po-\n sitions") are joined.
    text = re.sub(r"-\n\s+", "", sec)
    return tags, text


def test_man_page_matches_the_help():
    full, _ = full_help()
    rope = kv("rope", "--help").stdout
    tags, text = man_commands()
    for name in command_names():
        assert any(re.match(rf"{name}\b", t) or re.search(rf"\b{name}\b", t.split("  ")[0])
                   for t in tags), f"kvrope(1) has no entry for `{name}` (tags: {tags})"
    known = set(re.findall(r"--[a-z][a-z0-9-]*", full + rope))
    for opt in sorted(set(re.findall(r"--[a-z][a-z0-9-]*", text))):
        assert opt in known, f"kvrope(1) names {opt}, which kvrope --help does not know"


def test_man_page_formats_cleanly():
    if not shutil.which("groff"):
        pytest.skip("groff is not installed (Debian groff-base): man page not formatted")
    r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", MAN], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr, r.stderr
    r = subprocess.run(["groff", "-man", "-Tascii", "-P-cbou", MAN], capture_output=True,
                       text=True, timeout=60)
    # The ls entry's tag is whole (it was split across the tag and the body).
    assert re.search(r"^ {7}ls \[--model M\]\s*$", r.stdout, re.M), r.stdout
    for tag in ("llama import CTX STATE_FILE", "llama export CTX", "payload --model M"):
        assert tag in r.stdout, tag


def test_gen_gguf_describes_every_option():
    """scripts/gen-gguf.py --help: every option has a description (argparse
    prints an option with no help= as its name alone on its line)."""
    r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "gen-gguf.py"),
                        "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "\noptions:\n" in r.stdout, r.stdout
    body = r.stdout.split("\noptions:\n", 1)[1]
    # An option entry starts with two spaces and a dash; its description is
    # on the same line (after two or more spaces) or on the next, deeper one.
    lines = body.splitlines()
    opts = {}
    for i, ln in enumerate(lines):
        m = re.match(r"  (-\S.*?)(?: {2,}(\S.*))?$", ln)
        if not m:
            continue
        name = re.findall(r"--[\w-]+", m.group(1))[-1]
        desc = m.group(2) or ""
        if not desc and i + 1 < len(lines) and re.match(r" {6,}\S", lines[i + 1]):
            desc = lines[i + 1].strip()
        opts[name] = desc
    for want in ("--out", "--arch", "--layers", "--kv-heads", "--rope-scaling",
                 "--yarn-log-mul", "--dtype", "--seed", "--fim", "--hf"):
        assert want in opts, (want, sorted(opts))
    missing = [o for o, d in opts.items() if not d]
    assert not missing, f"options without a description: {missing}"
