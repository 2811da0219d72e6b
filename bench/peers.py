"""Peers for `tandem bench engine --peer`: llama.cpp and OpenVINO GenAI on our model, prompts and threads.

llama.cpp (PyPI llama-cpp-python) runs the same GGUF file. OpenVINO GenAI runs an int8 weight-only
export (NNCF int8_asym, per output channel, via optimum-intel) of the same weights, made once and cached
beside the model in `<model>.openvino-int8/<sha256[:16]>/`. Both come from the optional `peers` extra and
are imported lazily. The export needs optimum-intel, which pins its own transformers: it runs in a
subprocess under `--peer-python` (this file run as a script, `python bench/peers.py SRC OUT`, is the
export, and imports nothing from this project).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

# name -> (the module the extra provides, column label)
PEERS = {"llamacpp": ("llama_cpp", "llama.cpp"), "openvino": ("openvino_genai", "OpenVINO")}
INSTALL = "pip install -e '.[peers]'"
EXPORT_INSTALL = "pip install 'optimum-intel[openvino]' accelerate gguf"
DONE = "tandem-export.json"
# the rows a peer is measured on, in the bench's JSON (prefixed "peer_"), None where not run
KEYS = ("decode_tok_s", "prefill_tok_s", "batch16_tok_s", "prefill_4k_tok_s", "prefill_8k_tok_s", "decode_8k_tok_s")

Importer = Callable[[str], ModuleType]
Runner = Callable[..., "subprocess.CompletedProcess[str]"]
Run = Callable[[list[list[int]], int], float]  # (prompts, new tokens) -> seconds
Prompts = list[list[int]]


class PeerUnavailable(Exception):
    """Why a peer cannot run, in one line (printed without a traceback)."""


@dataclass
class Peer:
    name: str
    label: str
    run: Run
    batched: bool  # can generate for many prompts at once (the batch-16 row)
    notes: list[str] = field(default_factory=list)  # footnotes under the table


def import_peer(name: str, importer: Importer = importlib.import_module) -> ModuleType:
    """The peer's package, or PeerUnavailable naming the pip command when the extra is missing."""
    module = PEERS[name][0]
    try:
        return importer(module)
    except ImportError as e:
        raise PeerUnavailable(f"--peer {name} needs the optional `peers` extra ({e}); install it: {INSTALL}") from None


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def llamacpp(model: Path, threads: int, n_ctx: int, importer: Importer = importlib.import_module) -> Peer:
    llama_cpp = import_peer("llamacpp", importer)
    if not model.is_file():
        raise PeerUnavailable(f"--peer llamacpp needs a GGUF file, not {model}")
    llm = llama_cpp.Llama(
        model_path=str(model),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )

    def one(prompt: list[int], new: int) -> None:
        # greedy; Llama.generate never stops at EOS itself, so this is exactly `new` tokens
        for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), 1):
            if i == new:
                break

    def run(prompts: Prompts, new: int) -> float:
        t = time.perf_counter()
        for p in prompts:
            one(p, new)
        return time.perf_counter() - t

    return Peer(
        "llamacpp",
        "llama.cpp",
        run,
        batched=False,
        notes=[
            f"llama.cpp: llama-cpp-python {llama_cpp.__version__} on the same GGUF file (its quantized weights "
            "as stored), flash attention on, n_batch 512",
            "llama.cpp batch-16 '-': llama-cpp-python has no batched generation (one sequence per context)",
        ],
    )


def sha256(path: Path) -> str:
    """The file's sha256 (as sha256sum prints it); for an HF directory, over its files' names and contents."""
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if f.is_file():
            if f != path:
                h.update(str(f.relative_to(path)).encode())
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def export_dir(model: Path, digest: str) -> Path:
    """`<model>.openvino-int8/<sha256[:16]>` beside the model, or under ~/.cache/tandem if that is read-only."""
    base = model.parent if os.access(model.parent, os.W_OK) else Path.home() / ".cache" / "tandem"
    return base / f"{model.name}.openvino-int8" / digest[:16]


def export(model: Path, out: Path, digest: str, peer_python: str, runner: Runner = subprocess.run) -> None:
    """The int8 weight-only OpenVINO export of `model` into `out`, in a subprocess under `peer_python`."""
    check = runner([peer_python, "-c", "import optimum.intel, accelerate, gguf"], capture_output=True, text=True)
    if check.returncode != 0:
        raise PeerUnavailable(
            f"the OpenVINO export needs optimum-intel in --peer-python ({peer_python}); "
            f"in a separate venv: {EXPORT_INSTALL}, then pass --peer-python VENV/bin/python"
        )
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"exporting {model.name} to OpenVINO int8 (once) in {out} ...", file=sys.stderr, flush=True)
    r = runner([peer_python, __file__, str(model), str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        (log := out.parent / "export.log").write_text(r.stdout + r.stderr)
        raise PeerUnavailable(f"the OpenVINO export failed (exit {r.returncode}); its output is in {log}")
    meta = {"source": str(model), "sha256": digest, "weights": "int8_asym per-channel, weight-only (NNCF)"}
    (tmp / DONE).write_text(json.dumps(meta))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def openvino(
    model: Path,
    threads: int,
    peer_python: str,
    importer: Importer = importlib.import_module,
    runner: Runner = subprocess.run,
) -> Peer:
    og = import_peer("openvino", importer)
    import numpy as np

    ov = importer("openvino")
    digest = sha256(model)
    out = export_dir(model, digest)
    if not (out / DONE).is_file():
        export(model, out, digest, peer_python, runner)
    pipe = og.LLMPipeline(str(out), "CPU", INFERENCE_NUM_THREADS=threads)

    def run(prompts: Prompts, new: int) -> float:
        x = np.array(prompts, dtype=np.int64)  # one batch: the bench's prompts in a call are all one length
        inputs = og.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))
        cfg = og.GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, ignore_eos=True)
        return timed(lambda: pipe.generate(inputs, cfg))

    return Peer(
        "openvino",
        "OpenVINO",
        run,
        batched=True,
        notes=[
            f"OpenVINO: openvino-genai {og.__version__} LLMPipeline on CPU, greedy, an int8 weight-only export "
            f"(NNCF int8_asym per-channel; activations and KV cache at OpenVINO's CPU defaults) in {out}"
        ],
    )


def load(name: str, model: Path, threads: int, n_ctx: int, peer_python: str | None) -> Peer:
    if name == "llamacpp":
        return llamacpp(model, threads, n_ctx)
    return openvino(model, threads, peer_python or sys.executable)


def measure(
    peer: Peer | None,
    decode_rate: Callable[[Run, Prompts, int], float],
    prefill_rate: Callable[[Run, Prompts], float],
    short: Prompts,
    long: Prompts,
    new: int,
    long_rows: Sequence[tuple[str, Prompts]] = (),
) -> dict[str, float | None]:
    """The peer's rows as `peer_<key>` (None where not run), measured as ours are."""
    res: dict[str, float | None] = {"peer_" + k: None for k in KEYS}
    if peer is None:
        return res
    peer.run(short[:4], 4)  # warm-up
    res["peer_decode_tok_s"] = decode_rate(peer.run, short[:1], new)
    res["peer_prefill_tok_s"] = prefill_rate(peer.run, long)
    if peer.batched:
        res["peer_batch16_tok_s"] = 16 * new / peer.run(short[:16], new)
    for key, prompts in long_rows:
        try:
            rate = decode_rate(peer.run, prompts, new) if key.startswith("decode") else prefill_rate(peer.run, prompts)
        except (RuntimeError, ValueError) as e:  # a context the peer cannot hold: "-" and a footnote
            peer.notes.append(f"{peer.label} {key} '-': {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        res["peer_" + key] = rate
    return res


def cell(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def header(peer_label: str | None) -> str:
    line = f"{'metric':<34}{'tandem':>10}{'HF':>10}{'vs HF':>8}"
    return line + (f"{peer_label:>11}{'vs ' + peer_label:>14}" if peer_label else "")


def row(label: str, ours: float | None, ref: float | None, peer: float | None, with_peer: bool) -> str:
    line = f"{label:<34}{cell(ours):>10}{cell(ref):>10}{ratio(ours, ref):>8}"
    return line + (f"{cell(peer):>11}{ratio(ours, peer):>14}" if with_peer else "")


def _export_main(src: Path, out: Path) -> None:
    """Run by --peer-python: GGUF (or HF dir) -> HF dir -> optimum-intel's int8 weight-only OpenVINO export."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as hf:
        if src.is_file():
            kw = {"gguf_file": src.name}
            AutoModelForCausalLM.from_pretrained(str(src.parent), **kw).save_pretrained(hf)
            AutoTokenizer.from_pretrained(str(src.parent), **kw).save_pretrained(hf)
        cli = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--weight-format", "int8"]
        source = hf if src.is_file() else str(src)
        subprocess.run([*cli, "-m", source, "--task", "text-generation-with-past", str(out)], check=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _export_main(Path(sys.argv[1]), Path(sys.argv[2]))
