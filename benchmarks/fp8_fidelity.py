"""How far target.fp8 moves a target's hidden states, beside how far bf16 rounding alone moves them.

One random-weight Qwen3 (the 8B shape by default, `--small` a tiny one on CPU) is built in fp32; a row of
`--tokens` random token ids runs through it three times: in fp32, then with the same weights rounded to bf16
(the target's dtype on a GPU), then with its decoder linears in FP8 (dflash.model.fp8.quantize_decoder, as
`target.fp8` loads it). For every layer: the relative error ||x - ref|| / ||ref|| of its output against fp32,
for bf16 and for FP8, and their cosine similarity per token. The ratio FP8 / bf16 says how much more FP8
moves the states than the rounding every bf16 target already has; the growth with depth says how much the
network amplifies a small perturbation (random weights: a trained model's own growth is not measured here).

    GPU:  python benchmarks/fp8_fidelity.py --out $OUT
    CPU:  python benchmarks/fp8_fidelity.py --small --out /tmp/fp8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def hidden_states(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return [h.float() for h in out.hidden_states[1:]]  # each layer's output


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[dict]:
    return [{"rel_err": round(float((g - r).norm() / r.norm()), 5),
             "cos_mean": round(float(torch.nn.functional.cosine_similarity(g, r, dim=-1).mean()), 6)}
            for g, r in zip(got, ref)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--small", action="store_true", help="a tiny Qwen3 on CPU (smoke test)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--device", default=None)
    a = p.parse_args(argv)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.model import fp8
    from dflash_e2e import QWEN3_8B

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() and not a.small else "cpu"))
    low = torch.bfloat16  # target.fp8's dtype (and target.dtype "auto"'s on a GPU)
    fields = TINY if a.small else QWEN3_8B
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**fields)).eval().requires_grad_(False)
    ids = torch.randint(0, fields["vocab_size"] - 1, (1, a.tokens), generator=torch.Generator().manual_seed(1)).to(device)
    ref = hidden_states(model, ids)
    model.to(low)
    rounded = hidden_states(model, ids)
    note = fp8.quantize_decoder(model)
    quant = hidden_states(model, ids)
    rows = []
    q = compare(quant, ref)
    for i, (qi, ri) in enumerate(zip(q, compare(rounded, ref))):
        rows.append({"layer": i, "fp8": qi, "bf16": ri, "fp8_over_bf16": round(qi["rel_err"] / max(ri["rel_err"], 1e-12), 2)})
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": "tiny" if a.small else "qwen3-8b", "tokens": a.tokens,
              "note": note, "layers": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"fp8_fidelity{'_small' if a.small else ''}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
