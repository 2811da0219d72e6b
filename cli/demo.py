"""`tandem serve` until the HTTP router lands: load the bundled model and stream chat answers."""

from __future__ import annotations

import argparse
import sys
import time

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Give me three tips for writing clear code."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem serve", description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16", "int8"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("prompt", nargs="*", help="questions to answer (default: two examples)")
    args = ap.parse_args(argv)
    path = args.model or str(default_model_path())
    t = time.perf_counter()
    print(f"loading {path} ({args.dtype}) ...", flush=True)
    engine = Engine.from_path(path, EngineConfig(dtype=args.dtype))
    print(f"loaded in {time.perf_counter() - t:.1f} s; the HTTP API comes with the router.\n", flush=True)
    assert engine.tokenizer is not None
    for q in args.prompt or QUESTIONS:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        engine.add_request("demo", prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0))
        print(f"> {q}\n", flush=True)
        start, n = time.perf_counter(), 0
        while engine.has_unfinished():
            for out in engine.step():
                n += len(out.new_token_ids)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        print(f"\n\n[{n} tokens, {n / (time.perf_counter() - start):.1f} tok/s]\n", flush=True)
    return 0
