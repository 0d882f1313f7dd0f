"""Issue 12 through the Python binding: ids with an embedded NUL are refused
(ValueError, before anything is sent), never cut short and aliased to
another context; a config.json text with a NUL is refused by libkvrope."""
import numpy as np
import pytest

import kvrope


def test_nul_ids_refused_never_aliased(client, uid):
    m = f"m-{uid}"
    client.register_model(m, n_layers=2, n_kv_heads=2, head_dim=16, dtype="f32")
    a = f"alice-{uid}"
    kv = np.zeros((2, 2, 3, 2, 16), dtype=np.float32)
    client.put(a, m, [1, 2, 3], kv)
    bad = a + "\0x"
    calls = [
        lambda: client.delete(bad),
        lambda: client.delete(bad.encode()),
        lambda: client.stat(bad),
        lambda: client.pin(bad),
        lambda: client.fork(a, bad),
        lambda: client.fork(bad, a + "-copy"),
        lambda: client.shift(bad, 0, 1, 5),
        lambda: client.keep(bad, 0, 1),
        lambda: client.get(bad),
        lambda: client.put(bad, m, [1, 2, 3], kv),
        lambda: client.put(a, m + "\0", [4], kv[:, :, :1]),
        lambda: client.layout(bad),
        lambda: client.set_retention(bad, 1, 1),
        lambda: client.register_model(m + "\0y", n_layers=2, n_kv_heads=2, head_dim=16),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(ValueError):
            call()
    st = client.stat(a)
    assert st.n_tokens == 3, "a call with a NUL id changed the context it would alias"
    assert not client.exists(a + "-copy")
    client.ping()


def test_nul_in_config_json_refused(client, uid):
    with pytest.raises(kvrope.KvropeError):
        client.register_model(f"cfg-{uid}", '{"hidden_size": 64, "num_attention_heads": 2,'
                              ' "num_hidden_layers": 1, "model_type": "llama\0x"}')
    client.ping()


def test_remove_model(client, uid):
    m = f"rm-{uid}"
    client.register_model(m, n_layers=2, n_kv_heads=2, head_dim=16, dtype="f32")
    kv = np.zeros((2, 2, 1, 2, 16), dtype=np.float32)
    client.put(f"c-{uid}", m, [1], kv)
    with pytest.raises(kvrope.KvropeError) as e:
        client.remove_model(m)
    assert e.value.name == "E_BUSY"
    client.delete(f"c-{uid}")
    client.remove_model(m)
    assert m not in [x.name for x in client.models()]
    with pytest.raises(kvrope.UnknownModel):
        client.remove_model(m)
