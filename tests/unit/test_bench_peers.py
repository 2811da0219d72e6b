"""`tandem bench engine --peer` without the peers installed: the missing-extra error, the table's columns,
the JSON keys (a fake peer; no speed is asserted)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import peers


def missing(name: str) -> ModuleType:
    raise ModuleNotFoundError(f"No module named '{name}'")


@pytest.mark.parametrize("name", sorted(peers.PEERS))
def test_missing_extra_is_one_line_naming_pip(name: str) -> None:
    with pytest.raises(peers.PeerUnavailable) as e:
        peers.import_peer(name, importer=missing)
    msg = str(e.value)
    assert "\n" not in msg and f"--peer {name}" in msg and "pip install" in msg and "[peers]" in msg


def test_peer_constructors_fail_cleanly_without_the_extra(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(peers.PeerUnavailable, match="pip install"):
        peers.llamacpp(gguf, threads=2, n_ctx=512, importer=missing)
    with pytest.raises(peers.PeerUnavailable, match="pip install"):
        peers.openvino(gguf, threads=2, peer_python="python", importer=missing)


def test_export_without_optimum_says_what_to_install(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def runner(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ModuleNotFoundError: optimum")

    with pytest.raises(peers.PeerUnavailable, match=r"optimum-intel.*--peer-python") as e:
        peers.export(tmp_path / "m.gguf", tmp_path / "out", "ab" * 32, "/x/python", runner=runner)
    assert "\n" not in str(e.value) and len(calls) == 1 and calls[0][0] == "/x/python"


def test_export_dir_is_beside_the_model_keyed_by_sha256(tmp_path: Path) -> None:
    m = tmp_path / "m.gguf"
    m.write_bytes(b"weights")
    digest = peers.sha256(m)
    assert digest == hashlib.sha256(b"weights").hexdigest() != peers.sha256(tmp_path)
    assert peers.export_dir(m, digest) == tmp_path / "m.gguf.openvino-int8" / digest[:16]


def test_columns_and_ratios() -> None:
    head = peers.header("llama.cpp")
    assert head.split() == ["metric", "tandem", "HF", "vs", "HF", "llama.cpp", "vs", "llama.cpp"]
    assert peers.header(None).split() == ["metric", "tandem", "HF", "vs", "HF"]
    line = peers.row("decode tok/s", 60.0, 40.0, 120.0, with_peer=True)
    assert line.split()[-5:] == ["60.0", "40.0", "1.50x", "120.0", "0.50x"]
    assert len(line) == len(head)
    assert peers.row("batch-16", 400.0, None, None, with_peer=True).split()[-5:] == ["400.0", "-", "-", "-", "-"]
    assert peers.row("m", 1.0, 2.0, 3.0, with_peer=False).split() == ["m", "1.0", "2.0", "0.50x"]
    assert peers.ratio(None, 2.0) == "-" and peers.ratio(3.0, 0.0) == "-" and peers.cell(None) == "-"


def fake_decode(run: peers.Run, prompts: peers.Prompts, new: int) -> float:
    return 10.0 + run(prompts, new)


def fake_prefill(run: peers.Run, prompts: peers.Prompts) -> float:
    return 100.0 + run(prompts, 1)


@pytest.mark.parametrize("batched", [True, False])
def test_measure_fills_the_peer_keys(batched: bool) -> None:
    seen: list[tuple[int, int]] = []

    def run(prompts: peers.Prompts, new: int) -> float:
        seen.append((len(prompts), new))
        if len(prompts[0]) > 1000:
            raise RuntimeError("context full\nmore")
        return 1.0

    peer = peers.Peer("fake", "Fake", run, batched=batched)
    short, long = [[1, 2]] * 16, [[3] * 8] * 4
    long_rows = [("prefill_4k_tok_s", [[4] * 900]), ("decode_8k_tok_s", [[5] * 2000])]
    res = peers.measure(peer, fake_decode, fake_prefill, short, long, 8, long_rows)
    assert set(res) == {"peer_" + k for k in peers.KEYS}
    assert {"peer_decode_tok_s", "peer_prefill_tok_s", "peer_batch16_tok_s"} <= set(res)
    assert res["peer_decode_tok_s"] == 11.0 and res["peer_prefill_tok_s"] == 101.0
    assert res["peer_batch16_tok_s"] == (16 * 8 / 1.0 if batched else None)
    assert (16, 8) in seen if batched else (16, 8) not in seen
    assert res["peer_prefill_4k_tok_s"] == 101.0 and res["peer_decode_8k_tok_s"] is None
    assert res["peer_prefill_8k_tok_s"] is None
    assert peer.notes == ["Fake decode_8k_tok_s '-': RuntimeError: context full"]


def test_no_peer_gives_null_keys() -> None:
    res = peers.measure(None, fake_decode, fake_prefill, [[1]], [[1]], 8)
    assert res == {"peer_" + k: None for k in peers.KEYS}
