"""A user's model from ``--model-file`` travels to the workers as its file and weights; only
that model (and its copies) does, not every model of its class."""

import copy
import pickle

import torch
from torch import nn

from edgetrain.models.factory import load_model_file
from edgetrain.tiles.graphjob import ship_file_model

MODEL_FILE = """
import torch
from torch import nn


class Scale(nn.Module):
    def forward(self, x):
        return 2 * x


def model():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Scale(), nn.ReLU())
"""


def test_a_shipped_bare_sequential_travels_as_its_file_and_other_sequentials_as_themselves(
    tmp_path,
):
    path = tmp_path / "user_model.py"
    path.write_text(MODEL_FILE)
    torch.manual_seed(0)
    user = load_model_file(f"{path}:model").model
    ship_file_model(user, f"{path}:model")
    with torch.no_grad():
        user[0].weight.add_(1.0)  # weights changed after shipping travel too

    other = nn.Sequential(nn.Linear(2, 2))
    again = pickle.loads(pickle.dumps(other))
    assert type(again) is nn.Sequential and isinstance(again[0], nn.Linear)
    assert copy.deepcopy(other)[0].weight.shape == (2, 2)

    for shipped in (user, copy.deepcopy(user)):
        rebuilt = pickle.loads(pickle.dumps(shipped))
        assert [type(m).__name__ for m in rebuilt] == ["Conv2d", "Scale", "ReLU"]
        assert torch.equal(rebuilt[0].weight, user[0].weight)
        x = torch.randn(1, 3, 5, 5)
        assert torch.equal(rebuilt(x), user(x))
