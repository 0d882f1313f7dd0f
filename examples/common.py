#!/usr/bin/python3
"""What the example programs (editor.py, rag.py, streaming.py, worker.py)
share: the --socket option, the toy model with a name that carries its
config and seed, and reaching the daemon with a clear message when it is not
running or this libkvrope lacks a verb the example needs. Kept apart from
llama.py, which is the model alone.
"""
import hashlib
import json
import sys

import kvrope
import llama as L


def add_socket_arg(ap):
    """The --socket option, defaulting to kvrope's own default."""
    ap.add_argument("--socket", default=None,
                    help="daemon socket (default: $KVROPE_SOCKET, else the daemon's default, "
                         f"here {kvrope.default_socket()})")


def toy_model(rope, seed, prefix):
    """(config, model, name, digest): the toy Llama of RoPE family `rope`
    with weights from `seed`, registered as prefix-llama-<hash>; the name
    carries a hash of config + seed, so another config never collides."""
    config = L.make_config(rope)
    model = L.LlamaModel(config, seed=seed)
    digest = hashlib.sha1((json.dumps(config, sort_keys=True) + f"/{seed}").encode())
    return config, model, f"{prefix}-llama-{digest.hexdigest()[:10]}", digest


def connect(socket, needs=None):
    """(client, path) of the daemon at `socket` (None: the default). The
    client is None, after saying on stderr what to do, if the daemon cannot
    be reached (start it) or, with `needs` = (C function, what it does), if
    this libkvrope predates that verb (rebuild it)."""
    sock = socket or kvrope.default_socket()
    try:
        c = kvrope.connect(sock)
    except kvrope.KvropeError as e:
        print(f"cannot reach kvroped at {sock}: {e.message}\n"
              f"start it with `make run` (or pass --socket PATH)", file=sys.stderr)
        return None, sock
    if needs and not c._lib.has(needs[0]):
        print(f"this libkvrope has no {needs[1]}; rebuild it (make build/libkvrope.so)",
              file=sys.stderr)
        c.close()
        return None, sock
    return c, sock
