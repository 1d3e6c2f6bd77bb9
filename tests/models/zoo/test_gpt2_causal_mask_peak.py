"""Hugging Face GPT-2 at 128 tokens, float32, at its smallest budget, in the loop that keeps
gradients (as ``benchmarks/zoo.py`` trains it), given token ids and labels. Its causal mask is
captured as a constant of the batch's size that both layers read: held once before the step,
copied when an attention's addition runs again and not kept by that addition's graph. The
measured peak equals the prediction within 5 %."""

import pytest
import torch

from edgetrain.autograd.storage_counter import StorageCounter
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.models.zoo import ZOO, call
from edgetrain.runtime.checkpointed import Checkpointed
from edgetrain.runtime.peak_probe import distinct_bytes

BATCH, TOKENS = 2, 128


@pytest.mark.slow
def test_gpt2_at_128_tokens_peaks_as_predicted_when_its_mask_is_recomputed():
    torch.manual_seed(0)
    model = ZOO["hf-gpt2"].make(TOKENS)
    # Without an attention_mask the causal mask is captured as a constant (with one, it is an
    # input of the step).
    x = {k: v for k, v in ZOO["hf-gpt2"].inputs(BATCH, TOKENS).items() if k != "attention_mask"}
    net = Checkpointed(model, x, chain=analytic_chain(model, x), memory_budget="min")
    mask_bytes = BATCH * TOKENS * TOKENS * 4
    masked = [s for s in net.chain.stages if s.recompute_buffer_bytes == mask_bytes]
    assert masked and all(s.recompute_saved_buffer_bytes == 0 for s in masked)
    assert net.chain.buffer_bytes == distinct_bytes(list(net.model.buffers()))

    def step() -> None:
        out = call(net, x)
        out.loss.backward()  # the caller holds the output (its logits) through the backward
        del out
        for p in model.parameters():
            p.grad.zero_()

    step()  # creates the gradients the loop keeps
    counter = StorageCounter()
    with counter:
        step()
    assert counter.peak_bytes == pytest.approx(net.cost.peak_bytes, rel=0.05), net.runs_as
