"""torch.nn containers with layers inside (nn.TransformerEncoder, nn.TransformerDecoder,
nn.Transformer) are traced into, so a model built on them is cut between and inside its layers;
a container that must stay one stage says which one and why."""

import copy

import pytest
import torch
from torch import nn

from edgetrain.core.simulator import simulate
from edgetrain.frontend.cuts import as_stages
from edgetrain.frontend.fx_capture import capture
from edgetrain.frontend.profiling import analytic_chain
from edgetrain.planners.optimal import minimum_memory, store_all
from edgetrain.runtime.checkpointed import Checkpointed
from tests.helpers import same_state
from tests.runtime.test_any_model import measured_peak, schedules, train_step


class Encoder(nn.Module):
    def __init__(self, layers: int = 4, norm_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(32), enable_nested_tensor=False
        )
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.body = nn.Transformer(16, 2, 2, 2, 32, 0.1, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.body(h, h[:, :6]))


CASES = [
    ("encoder", lambda: Encoder(layers=3), 0.5),
    ("encoder-norm-first", lambda: Encoder(layers=1, norm_first=True), 0.8),
]


@pytest.mark.parametrize(("name", "make", "least"), CASES, ids=[c[0] for c in CASES])
def test_a_container_model_is_cut_between_its_layers_and_trains_exactly(name, make, least):
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(4, 16, 8, dtype=torch.float64)
    assert capture(model, x).kept_whole == ()
    stages = as_stages(model, x)
    chain = analytic_chain(stages, x)
    assert chain.length >= 12, chain.length  # traced into: kept whole, the encoder is one stage
    plain_peak = simulate(chain, store_all(chain)).peak_bytes
    assert minimum_memory(chain) < least * plain_peak
    for schedule in schedules(chain)[:2]:  # half-way to the least memory, and the least
        ours, plain = copy.deepcopy(model), copy.deepcopy(model)
        net = Checkpointed(ours, x, chain=chain, schedule=schedule)
        assert torch.equal(train_step(net, x, seed=3), train_step(plain, x, seed=3))
        same_state(ours, plain)  # dropout's random numbers replayed, gradients bitwise equal
        measured = measured_peak(net, x)
        assert measured == pytest.approx(net.cost.peak_bytes, rel=0.05), schedule.params


def test_nn_transformer_is_traced_into_its_encoder_and_decoder_layers():
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    captured = capture(EncoderDecoder().double(), x)
    assert captured.kept_whole == ()
    called = {n.target for n in captured.nodes if n.kind == "module"}
    assert {"body.encoder.layers.1.self_attn", "body.decoder.layers.1.multihead_attn"} <= called


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class Masked(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x), mask=self.mask).mean(1))


@pytest.mark.parametrize(
    ("make", "training", "path", "why"),
    [
        (Recurrent, True, "rnn", "nn.LSTM runs its 2 layers in one fused kernel"),
        (Encoder, False, "encoder", "nn.TransformerEncoder in eval mode"),
        (Masked, True, "encoder", "nn.TransformerEncoder is given mask"),
    ],
)
def test_a_container_kept_whole_says_which_and_why(make, training, path, why):
    model = make().double().train(training)
    kept = dict(capture(model, torch.randn(2, 12, 8, dtype=torch.float64)).kept_whole)
    assert why in kept[path]
