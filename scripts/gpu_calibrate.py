#!/usr/bin/env python3
"""Measure engine iteration times on a GPU for `dynamo-ppd engine calibrate`.

Standalone (needs only PyTorch >= 2.5; nothing is downloaded): builds a Llama-3.1-8B-shaped decoder
with random bf16 weights and times single iterations of the shapes the engine model prices:
decode-only batches (1..256 sequences, 1K..8K cached tokens each), prefill chunks (128..8192 new
tokens, with and without cached context) and mixed iterations (a decode batch plus prefill chunks,
including the paper's batch-200 full-1024 / append-128 points). Writes the points JSON
(``{"hardware": ..., "points": [...]}``) after every point, so a run cut short still leaves data.

How an iteration is run, and why not with transformers' LlamaForCausalLM:
- TensorRT-LLM packs all tokens of an iteration (one per decoding sequence, plus every prefill
  chunk) into one batch: every GEMM runs once over all tokens, attention runs per sequence over its
  own KV. HF's forward cannot pack decode and prefill sequences of different lengths into one
  forward, and its cache/mask code differs between versions. So this script has its own packed
  forward (~40 lines: RMSNorm, fused QKV, RoPE, attention, O, gated MLP, LM head on the sampled rows
  only, greedy argmax) over the real shapes; the FLOPs and bytes are those of the real model.
- Decode attention: each sequence's query heads of one KV head attend together to that sequence's
  KV (GQA without copying KV); the new token's KV is written into the cache first.
- Prefill chunk attention: new tokens attend causally (lower-right aligned) to cached + new KV.
- Timing: on CUDA each shape is captured once in a CUDA graph and replayed (TensorRT-LLM also
  replays graphs for decode; a Python eager loop would measure kernel-launch overhead instead),
  falling back to eager if capture fails; CUDA events, warm-up, median of repeats.
The KV cache and activations hold random values: kernel times do not depend on them.

Usage:  python scripts/gpu_calibrate.py --out points.json   (H200: ~25 s of kernels, ~1-2 min in all)
        python scripts/gpu_calibrate.py --tiny --device cpu --out tiny.json   (CPU test, seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # a clear line instead of a traceback on a machine without PyTorch
    sys.exit("gpu_calibrate.py needs PyTorch (a GPU node's TensorRT-LLM image has it; for a CPU "
             "check: pip install torch, then --tiny --device cpu)")


@dataclass(frozen=True)
class Shape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


LLAMA_8B = Shape(32, 4096, 32, 8, 128, 14336, 128256)  # meta-llama/Llama-3.1-8B config.json
TINY = Shape(4, 256, 8, 2, 32, 768, 2048)

Chunk = tuple[int, int, bool]  # (new_tokens, context_tokens, samples)


@dataclass(frozen=True)
class Spec:
    """One iteration: ``num_decode`` sequences with ``context`` cached tokens each, plus chunks."""

    num_decode: int
    context: int
    chunks: tuple[Chunk, ...] = ()

    @property
    def kv_tokens(self) -> int:
        return self.num_decode * (self.context + 1) + sum(n + ctx for n, ctx, _ in self.chunks)

    def label(self) -> str:
        parts = [f"decode {self.num_decode}x{self.context}"] if self.num_decode else []
        parts += [f"prefill {n}" + (f"@{ctx}" if ctx else "") for n, ctx, _ in self.chunks]
        return " + ".join(parts)


def grid(tiny: bool) -> list[Spec]:
    """Shapes that exercise every term of the cost model: weight-bound and compute-bound GEMMs,
    KV-read-bound decode attention, compute-bound prefill attention, and their mixtures."""
    if tiny:
        decode = [Spec(b, c) for b in (1, 4, 16) for c in (128, 512)]
        prefill = [Spec(0, 0, ((n, 0, True),)) for n in (32, 128, 512)]
        prefill += [Spec(0, 0, ((32, 512, True),)), Spec(0, 0, ((128, 1024, False),))]
        mixed = [Spec(4, 128, ((128, 0, True),)), Spec(16, 128, ((32, 512, True),)),
                 Spec(8, 128, ((64, 0, True),) * 2)]
        return decode + prefill + mixed
    decode = [Spec(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (1024, 2048, 4096, 8192)
              if b * c <= 524288]
    prefill = [Spec(0, 0, ((n, 0, True),)) for n in (128, 256, 512, 1024, 2048, 4096, 8192)]
    prefill += [Spec(0, 0, ((n, ctx, True),)) for n in (128, 512, 2048) for ctx in (4096, 16384, 32768)]
    prefill += [Spec(0, 0, ((8192, 24576, False),))]  # a middle chunk of a 32K prompt
    mixed = [Spec(b, 1024, (chunk,)) for b in (32, 128)
             for chunk in ((128, 0, True), (1024, 0, True), (4096, 0, True), (128, 8192, True))]
    mixed += [Spec(64, 1024, ((1024, 0, True),) * 4),
              Spec(200, 1024, ((1024, 0, True),)), Spec(200, 1024, ((128, 1024, True),)),  # the paper's
              Spec(200, 1024, ((1024, 0, True),) * 4), Spec(200, 1024, ((128, 1024, True),) * 4)]
    return decode + prefill + mixed


class PackedLlama:
    """Random-weight Llama decoder that runs one packed iteration (decode tokens + prefill chunks)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, kv_tokens: int):
        self.shape, self.device, self.dtype = shape, device, dtype
        s = shape
        q, kv = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

        self.layers = [{"qkv": weight(q + 2 * kv, s.hidden_size), "o": weight(s.hidden_size, q),
                        "gate_up": weight(2 * s.intermediate_size, s.hidden_size),
                        "down": weight(s.hidden_size, s.intermediate_size),
                        "ln1": torch.ones(s.hidden_size, device=device, dtype=dtype),
                        "ln2": torch.ones(s.hidden_size, device=device, dtype=dtype)}
                       for _ in range(s.num_layers)]
        self.norm = torch.ones(s.hidden_size, device=device, dtype=dtype)
        self.lm_head = weight(s.vocab_size, s.hidden_size)
        # One flat K and V buffer per layer; each iteration views its sequences' caches out of it.
        self.k_cache = [torch.randn(kv_tokens * kv, device=device, dtype=dtype) for _ in range(s.num_layers)]
        self.v_cache = [torch.randn(kv_tokens * kv, device=device, dtype=dtype) for _ in range(s.num_layers)]
        self.gqa_native = True  # SDPA's enable_gqa; falls back to repeating KV heads if unsupported

    def prepare(self, spec: Spec) -> Callable[[], torch.Tensor]:
        """Allocate the iteration's inputs and return a closure that runs it (graph-capturable:
        no host synchronisation, no allocation that depends on values)."""
        s, dev, dt = self.shape, self.device, self.dtype
        kvh, d, groups = s.num_kv_heads, s.head_dim, s.num_attention_heads // s.num_kv_heads
        tokens = spec.num_decode + sum(n for n, _, _ in spec.chunks)
        x_in = torch.randn(tokens, s.hidden_size, device=dev, dtype=dt)
        angles = torch.rand(tokens, 1, d // 2, device=dev) * 6.28
        cos, sin = angles.cos().to(dt), angles.sin().to(dt)
        sampled = list(range(spec.num_decode))
        offset = spec.num_decode
        for n, _, samples in spec.chunks:
            offset += n
            if samples:
                sampled.append(offset - 1)
        sample_rows = torch.tensor(sampled, device=dev, dtype=torch.long)

        def views(layer: int, start: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
            size = batch * kvh * length * d
            return (self.k_cache[layer][start * kvh * d:start * kvh * d + size].view(batch, kvh, length, d),
                    self.v_cache[layer][start * kvh * d:start * kvh * d + size].view(batch, kvh, length, d))

        def rope(t: torch.Tensor) -> torch.Tensor:
            a, b = t[..., :d // 2], t[..., d // 2:]
            return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs, row, kv_at = [], 0, 0
            b, c = spec.num_decode, spec.context
            if b:
                kc, vc = views(layer, 0, b, c + 1)
                kc[:, :, c] = k[:b]
                vc[:, :, c] = v[:b]
                out = F.scaled_dot_product_attention(q[:b].view(b, kvh, groups, d), kc, vc)
                outs.append(out.reshape(b, -1))
                row, kv_at = b, b * (c + 1)
            for n, ctx, _ in spec.chunks:
                kc, vc = views(layer, kv_at, 1, ctx + n)
                kc[0, :, ctx:] = k[row:row + n].transpose(0, 1)
                vc[0, :, ctx:] = v[row:row + n].transpose(0, 1)
                out = self._causal(q[row:row + n].transpose(0, 1).unsqueeze(0), kc, vc)
                outs.append(out[0].transpose(0, 1).reshape(n, -1))
                row, kv_at = row + n, kv_at + ctx + n
            return torch.cat(outs) if len(outs) > 1 else outs[0]

        def run() -> torch.Tensor:
            x = x_in
            for i, w in enumerate(self.layers):
                h = F.rms_norm(x, (s.hidden_size,), w["ln1"])
                q, k, v = F.linear(h, w["qkv"]).split(
                    [s.num_attention_heads * d, kvh * d, kvh * d], dim=-1)
                q = rope(q.view(tokens, s.num_attention_heads, d))
                k = rope(k.view(tokens, kvh, d))
                x = x + F.linear(attention(i, q, k, v.view(tokens, kvh, d)), w["o"])
                gate, up = F.linear(F.rms_norm(x, (s.hidden_size,), w["ln2"]), w["gate_up"]).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, w["down"])
            logits = F.linear(F.rms_norm(x[sample_rows], (s.hidden_size,), self.norm), self.lm_head)
            return logits.argmax(dim=-1)

        return run

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the last q.shape[2] positions over k/v (lower-right aligned)."""
        from torch.nn.attention.bias import causal_lower_right

        n, total = q.shape[2], k.shape[2]
        mask = None if n == total else causal_lower_right(n, total)
        if self.gqa_native:
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                      enable_gqa=True)
            except (RuntimeError, TypeError, ValueError) as exc:
                print(f"  note: SDPA with enable_gqa failed ({exc}); repeating KV heads instead")
                self.gqa_native = False
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def time_iteration(run: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int,
                   graphs: bool) -> tuple[float, str]:
    """Median seconds of one iteration, and how it ran ("graph", "eager")."""
    if device.type != "cuda":
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times), "eager"
    mode, replay = "eager", run
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and pick kernels) outside the capture
        for _ in range(max(warmup, 1)):
            run()
    torch.cuda.current_stream().wait_stream(side)
    if graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            mode, replay = "graph", graph.replay
        except RuntimeError as exc:
            print(f"  note: CUDA graph capture failed ({str(exc).splitlines()[0]}); timing eagerly")
            torch.cuda.synchronize()
    for _ in range(warmup):
        replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), mode


def to_point(spec: Spec, seconds: float) -> dict:
    return {"num_decode": spec.num_decode, "decode_context_tokens": spec.num_decode * spec.context,
            "prefill": [{"new_tokens": n, "context_tokens": ctx, "samples": samples}
                        for n, ctx, samples in spec.chunks],
            "measured_s": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("points.json"), help="points JSON to write")
    parser.add_argument("--tiny", action="store_true", help="tiny model and grid (CPU testing)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up runs per shape")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per shape (median kept)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="time eager launches on CUDA")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="stop measuring new shapes after this many seconds (the file is kept)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    device = torch.device(args.device)
    shape = TINY if args.tiny else LLAMA_8B
    dtype = torch.bfloat16
    torch.manual_seed(0)
    specs = grid(args.tiny)
    kv_bytes_per_token = 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize * shape.num_layers
    kv_tokens = max(spec.kv_tokens for spec in specs)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        weights = 2 * shape.num_layers * shape.hidden_size * (
            (shape.num_attention_heads + shape.num_kv_heads) * shape.head_dim
            + 3 * shape.intermediate_size) + 2 * shape.vocab_size * shape.hidden_size
        fits = int((free - weights - 16e9) // kv_bytes_per_token)  # 16 GB for activations, graphs
        if fits < kv_tokens:
            dropped = [s.label() for s in specs if s.kv_tokens > fits]
            print(f"only {fits} KV tokens fit; skipping {len(dropped)} shapes: {', '.join(dropped)}")
            specs = [s for s in specs if s.kv_tokens <= fits]
            kv_tokens = max(spec.kv_tokens for spec in specs)
        hardware = torch.cuda.get_device_name(device)
    else:
        import platform

        hardware = f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"
    mode_note = "eager" if device.type != "cuda" or args.no_cuda_graphs else "CUDA graphs"
    hardware += f", torch {torch.__version__}, packed bf16 forward, {mode_note}"
    print(f"{hardware}: model {shape}; KV buffer {kv_tokens} tokens "
          f"({kv_tokens * kv_bytes_per_token / 1e9:.1f} GB); {len(specs)} shapes", flush=True)
    with torch.inference_mode():
        model = PackedLlama(shape, device, dtype, kv_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"model built in {time.monotonic() - started:.1f} s", flush=True)
        points: list[dict] = []
        for i, spec in enumerate(specs, 1):
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: stopping after {len(points)} shapes")
                break
            seconds, mode = time_iteration(model.prepare(spec), device, args.warmup, args.repeats,
                                           graphs=not args.no_cuda_graphs)
            points.append(to_point(spec, seconds))
            args.out.write_text(json.dumps({"hardware": hardware, "points": points}, indent=1) + "\n")
            print(f"[{i}/{len(specs)}] {spec.label():<42} {seconds * 1e3:9.3f} ms ({mode})", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # free the graph's private pool before the next shape
    print(f"wrote {len(points)} points to {args.out} in {time.monotonic() - started:.1f} s")
    name = "tiny-llama" if args.tiny else "meta-llama/Llama-3.1-8B"
    print(f"profile `model:` section for this shape:\n  name: {name}\n"
          + "\n".join(f"  {k}: {v}" for k, v in vars(shape).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
