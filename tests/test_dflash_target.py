"""Target taps: the truncated decoder gives exactly the whole model's hidden states, runs no layer
after the last tap, and compiled (CPU inductor here) matches eager with one graph for every layer."""

from __future__ import annotations

import threading

import pytest
import torch

from dflash.model.target import Target, build_tiny_target


def tiny(layer_ids, compile_taps=False) -> Target:
    model, tok = build_tiny_target()
    model.requires_grad_(False).eval()
    return Target(model=model, tokenizer=tok, layer_ids=tuple(layer_ids), mask_token_id=5,
                  device=torch.device("cpu"), dtype=torch.float32, source="test", compile_taps=compile_taps)


def whole_model_taps(t: Target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = t.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in t.layer_ids], dim=-1)


def ids(batch=2, seq=24, seed=0) -> torch.Tensor:
    return torch.randint(10, 200, (batch, seq), generator=torch.Generator().manual_seed(seed))


def layer_calls(t: Target) -> list[int]:
    calls = [0] * t.num_layers
    for i, layer in enumerate(t.model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("layer_ids", [(1, 3), (0, 2, 4), (3,)])
def test_truncated_taps_equal_the_whole_model_and_skip_later_layers(layer_ids):
    t = tiny(layer_ids)
    x = ids()
    want = whole_model_taps(t, x)
    calls = layer_calls(t)
    got = t.taps(x)
    assert torch.equal(got, want)  # the same kernels on the same inputs: bit-identical
    last = max(layer_ids)
    assert calls == [1] * (last + 1) + [0] * (t.num_layers - last - 1)
    assert t.layers_run == last + 1


def test_tapping_the_last_layer_keeps_the_final_norm():
    t = tiny((1, 5))  # 6 layers: hidden_states[6] of the whole model is after the final norm
    x = ids()
    assert torch.equal(t.taps(x), whole_model_taps(t, x))
    assert t.layers_run == 6


def test_the_model_itself_is_unchanged():
    t = tiny((1, 3))
    x = ids()
    with torch.no_grad():
        before = t.model(input_ids=x, use_cache=False).logits
    t.taps(x)
    with torch.no_grad():
        after = t.model(input_ids=x, use_cache=False).logits
    assert len(t.model.model.layers) == 6 and type(t.model.model.norm).__name__ != "Identity"
    assert torch.equal(before, after)


def test_a_decoder_of_another_layout_runs_the_whole_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=4, n_head=2, n_positions=64)).eval()
    t = Target(model=model, tokenizer=None, layer_ids=(0, 2), mask_token_id=5, device=torch.device("cpu"),
               dtype=torch.float32, source="test")
    x = ids(seq=16)
    assert t.tapper() is None and t.layers_run == 4
    assert torch.equal(t.taps(x), whole_model_taps(t, x))


def test_threads_keep_their_own_taps():
    t = tiny((1, 3))
    xs = [ids(seed=s) for s in range(2)]
    want = [whole_model_taps(t, x) for x in xs]
    got: list = [None, None]
    start = threading.Barrier(2)

    def run(k: int) -> None:
        start.wait()
        for _ in range(3):
            got[k] = t.taps(xs[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_compiled_taps_match_eager_with_one_graph_for_every_layer():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    t = tiny((1, 2, 4), compile_taps=True)
    x = ids()
    # the reference from a second, eager copy (same seed, same weights): asking the compiled target's
    # model for output_hidden_states would put transformers' capture hooks (a ContextVar dynamo cannot
    # trace) on its layers and break the graph; dflash's training forward never asks for them
    want = tiny((1, 2, 4)).taps(x)
    got = t.taps(x)
    # inductor fuses the fp32 RMSNorm / RoPE / SwiGLU: a different summation order, so not bit-equal;
    # values are O(1), the layers' float32 rounding stays far below 1e-4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1  # five layers, one compiled graph
    t.taps(x)
    assert counters["stats"]["unique_graphs"] == 1  # and no recompile on the second call
