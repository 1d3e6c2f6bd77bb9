import subprocess
import sys

import torch

import edgetrain


def test_the_pure_core_plans_without_importing_torch():
    code = (
        "import sys, edgetrain\n"
        "from edgetrain import plan, simulate, uniform_chain\n"
        "from edgetrain.memory import paper_estimate\n"
        "chain = uniform_chain(50)\n"
        "cost = simulate(chain, plan(chain, 'optimal', recompute=1.5))\n"
        "assert cost.recompute_factor <= 1.5\n"
        "assert 'torch' not in sys.modules, 'the pure core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_side_names_load_on_first_use():
    model = edgetrain.build_model("resnet18")
    net = edgetrain.Checkpointed(model, torch.randn(2, 3, 64, 64), max_recompute=1.5)
    assert net.cost.recompute_factor <= 1.5
    assert isinstance(net.chain, edgetrain.Chain)
